"""The prompts every benchmark uses: 16 topics x 4 templates, short to long."""

from __future__ import annotations

TOPICS = [
    "the Roman Empire", "photosynthesis", "black holes", "the French Revolution", "jazz music",
    "volcanoes", "the printing press", "honeybees", "quantum computing", "the Silk Road",
    "coral reefs", "the steam engine", "ancient Egypt", "climate change", "chess openings",
    "the human immune system",
]  # fmt: skip
TEMPLATES = [  # short to long; every run of four consecutive prompts spans all lengths
    "Tell me about {t}.",
    "Write a short story for children in which a curious fox learns about {t}.",
    "You are a patient teacher. Explain {t} to a high-school student, step by step, using one "
    "everyday analogy and ending with a question that checks understanding.",
    "I am preparing a public lecture and need an outline. Summarise what is known about {t}, "
    "the main open questions that researchers still debate, two common misconceptions that "
    "the audience may hold, and three books or sources that a beginner could read next.",
]


def make_prompts(n: int) -> list[str]:
    out = [tpl.format(t=topic) for topic in TOPICS for tpl in TEMPLATES]
    while len(out) < n:  # beyond 64: still distinct
        out.append(f"Question {len(out)}: " + out[len(out) % 64])
    return out[:n]
