"""Streaming: SSE chunks concatenate to the non-streamed result; usage chunk; wire format."""

from __future__ import annotations

import json

import httpx
from openai import AsyncOpenAI, OpenAI

from tests.e2e.helpers import (
    MAX_TOKENS,
    MODEL,
    PROMPTS,
    complete,
    counts,
    merge_stream,
    texts,
)

CHAT = [{"role": "user", "content": "Name two planets."}]


async def test_stream_concatenation_equals_non_stream(aclient: AsyncOpenAI) -> None:
    prompts = PROMPTS[:3]
    sampling = {"n": 2, "temperature": 0.8, "seed": 3, "max_tokens": MAX_TOKENS}
    full = await aclient.completions.create(model=MODEL, prompt=prompts, **sampling)
    stream = await aclient.completions.create(model=MODEL, prompt=prompts, stream=True, **sampling)
    chunks = [chunk async for chunk in stream]
    streamed, finish, usage = merge_stream(chunks)
    assert usage is None  # not asked for
    assert [streamed[i] for i in range(len(full.choices))] == texts(full)
    assert [finish[i] for i in range(len(full.choices))] == [c.finish_reason for c in full.choices]


def test_include_usage_adds_one_final_chunk_with_summed_usage(client: OpenAI) -> None:
    prompts = PROMPTS[3:6]
    full = complete(client, prompts)
    stream = complete(client, prompts, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(full.usage)
    assert all(chunk.usage is None for chunk in chunks[:-1])
    streamed, _, _ = merge_stream(chunks)
    assert [streamed[i] for i in range(len(prompts))] == texts(full)


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(client: OpenAI) -> None:
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries
    the prompt tokens and the completion tokens generated so far (chat and completions); the
    last is the usual usage chunk."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    prompts = PROMPTS[3:5]
    full = complete(client, prompts)
    chat_full = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,  # type: ignore[arg-type]
                                               max_tokens=MAX_TOKENS)  # fmt: skip
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,  # type: ignore[arg-type]
                                          max_tokens=MAX_TOKENS, stream=True,
                                          stream_options=opts)  # type: ignore[typeddict-unknown-key]  # fmt: skip
    for chunks, whole in ((list(complete(client, prompts, stream=True, stream_options=opts)),
                           full), (list(chat), chat_full)):  # fmt: skip
        assert all(chunk.usage is not None for chunk in chunks)
        done = [chunk.usage.completion_tokens for chunk in chunks]  # type: ignore[union-attr]
        assert done == sorted(done) and 0 < done[-2] == done[-1]
        assert {chunk.usage.prompt_tokens for chunk in chunks} == {whole.usage.prompt_tokens}  # type: ignore[union-attr]
        assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(whole.usage)


def test_echo_logprobs_stream_like_non_stream(client: OpenAI) -> None:
    prompt = PROMPTS[6]
    full = complete(client, prompt, echo=True, logprobs=2)
    tokens: list[str] = []
    text = ""
    for chunk in complete(client, prompt, echo=True, logprobs=2, stream=True):
        choice = chunk.choices[0]
        text += choice.text
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        tokens += choice.logprobs.tokens
    assert text == full.choices[0].text
    assert full.choices[0].logprobs is not None
    assert tokens == full.choices[0].logprobs.tokens


def test_sse_wire_format(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPTS[:2],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    payloads = [line[len("data: ") :] for line in lines]
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert None not in chunks
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1
    finished = [
        c["choices"][0]["index"]
        for c in chunks
        if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert sorted(finished) == [0, 1]  # exactly one finish chunk per choice
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0


def test_chat_stream_equals_non_stream(client: OpenAI) -> None:
    args = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": MAX_TOKENS}
    full = client.chat.completions.create(**args)  # type: ignore[call-overload]
    stream = client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )  # type: ignore[call-overload]
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(full.usage)


async def test_chat_stream_with_n_sends_a_role_delta_per_choice(aclient: AsyncOpenAI) -> None:
    stream = await aclient.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        n=2,
        temperature=0.7,
        seed=8,
        max_tokens=6,
        stream=True,  # type: ignore[arg-type]
    )
    chunks = [chunk async for chunk in stream]
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    full = await aclient.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        n=2,
        temperature=0.7,
        seed=8,
        max_tokens=6,  # type: ignore[arg-type]
    )
    for choice in full.choices:
        streamed = "".join(
            c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == choice.index
        )
        assert streamed == choice.message.content
