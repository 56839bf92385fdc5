"""Prompts and small helpers shared by the end-to-end tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import httpx
from openai.types import Completion

API_KEY = "sk-convoy-e2e"
MODEL = "smollm2-135m-instruct"
GEMMA = "gemma3-270m"  # the `gemma` server (conftest) serves it in dtype auto

# Sixteen prompts of different lengths and kinds, so a batch mixes short and long prefills.
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "List three colors:",
    "The quick brown fox",
    "In 1969, the first humans landed on",
    "Water boils at",
    "Translate to French: Good morning, how are you?",
    "The three laws of thermodynamics are",
    "import numpy as np\n",
    "Q: What is 2 + 2?\nA:",
    "My favourite book is",
    "Photosynthesis is the process by which plants",
    "Hello",
    "The weather today is sunny and warm, so we decided to go to the park and",
    "A haiku about autumn:\n",
]

MAX_TOKENS = 10


def complete(client: Any, prompt: Any, **kwargs: Any) -> Completion:
    """A greedy completion unless told otherwise."""
    args: dict[str, Any] = {"temperature": 0, "max_tokens": MAX_TOKENS, **kwargs}
    completion: Completion = client.completions.create(model=MODEL, prompt=prompt, **args)
    return completion


def texts(completion: Completion) -> list[str]:
    assert [c.index for c in completion.choices] == list(range(len(completion.choices)))
    return [c.text for c in completion.choices]


def merge_stream(chunks: Iterable[Any]) -> tuple[dict[int, str], dict[int, str | None], Any]:
    """Concatenate completion stream chunks per choice index; return texts, finishes, usage."""
    out: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        assert len(chunk.choices) == 1  # one choice per chunk, carrying its global index
        choice = chunk.choices[0]
        assert finish.get(choice.index) is None, "a chunk after the choice finished"
        out[choice.index] = out.get(choice.index, "") + choice.text
        finish[choice.index] = choice.finish_reason
    return out, finish, usage


def error_object(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error object of a response that must have `status`."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"]
    error: dict[str, Any] = body["error"]
    assert list(error) == ["message", "type", "param", "code"]
    assert isinstance(error["message"], str) and error["message"]
    return error


T = TypeVar("T")


def poll(fetch: Callable[[], T], is_done: Callable[[T], bool], what: str, timeout_s: float) -> T:
    """`fetch()` again until `is_done` says so; fails naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fetch()
        if is_done(value):
            return value
        assert time.monotonic() < deadline, f"{what}: still {value!r:.300} after {timeout_s} s"
        time.sleep(0.1)  # polling interval, not synchronisation


def counts(usage: Any) -> tuple[int, int, int]:
    """A usage's token counts, without prompt_tokens_details: how many prompt tokens the prefix
    cache served differs between two runs of one request (the second finds the first's blocks)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens
