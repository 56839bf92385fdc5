from __future__ import annotations

import pytest

from convoy import LLM


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The default model in fp32 (the exact mode), default engine settings."""
    return LLM(dtype="float32")


def prompts16() -> list[str]:
    topics = ["the sea", "a robot", "Paris", "winter", "music", "a dragon", "coffee", "the moon",
              "mathematics", "a lighthouse", "trains", "gardens", "the desert", "friendship",
              "volcanoes", "libraries"]  # fmt: skip
    # Lengths differ from a few tokens to a few dozen.
    return [
        f"Write about {t}." + " Please be detailed and vivid." * (i % 5)
        for i, t in enumerate(topics)
    ]
