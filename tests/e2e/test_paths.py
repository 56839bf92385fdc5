"""Paths the other end-to-end files leave out: stop strings while streaming, and Gemma 3 served
in dtype auto (its GGUF quantized, as `convoy serve gemma3-270m` runs it)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.e2e.helpers import GEMMA, PROMPTS, complete, merge_stream


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_stop_string_never_reaches_the_stream(client: OpenAI, prompt: str) -> None:
    """A stop string that spans tokens: the streamed text is the non-streamed text cut before
    it, no chunk carries any of it, and the choice finishes with `stop`."""
    full = complete(client, prompt, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = f"{words[1]} {words[2][:2]}"  # from the middle of the text, across a word boundary
    chunks = list(complete(client, prompt, max_tokens=16, stop=[stop], stream=True))
    texts, finish, _ = merge_stream(chunks)
    assert texts[0] == full[: full.index(stop)]
    assert stop not in texts[0] and finish[0] == "stop"
    again = complete(client, prompt, max_tokens=16, stop=[stop]).choices[0]
    assert again.text == texts[0] and again.finish_reason == "stop"


def test_gemma3_completion_and_stream_agree(gemma: OpenAI) -> None:
    out = gemma.completions.create(
        model=GEMMA, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    choice = out.choices[0]
    assert out.model == GEMMA and choice.text.strip()
    assert out.usage is not None and out.usage.completion_tokens <= 8
    stream = gemma.completions.create(
        model=GEMMA, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    texts, finish, _ = merge_stream(stream)
    assert texts[0] == choice.text and finish[0] == choice.finish_reason


def test_gemma3_chat_through_its_template(gemma: OpenAI) -> None:
    """Greedy chat, whole and streamed, the same text. (What it says is the base 270M model's:
    transformers' greedy continuation of the same template is as odd.)"""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = gemma.chat.completions.create(
        model=GEMMA,
        messages=messages,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert "<start_of_turn>" not in choice.message.content  # the template's markers are special
    assert out.usage is not None and out.usage.completion_tokens <= 8
    stream = gemma.chat.completions.create(
        model=GEMMA,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == choice.message.content
