"""POST /v1/chat/completions through the official client."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.e2e.helpers import MAX_TOKENS, MODEL

MESSAGES = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


def chat(client: OpenAI, messages: list[dict[str, object]] = MESSAGES, **kwargs: object) -> object:
    args = {"temperature": 0, "max_tokens": MAX_TOKENS, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=messages, **args)  # type: ignore[call-overload]


def test_chat_completion_shape_and_usage(client: OpenAI, http: httpx.Client) -> None:
    completion = chat(client)
    assert completion.object == "chat.completion" and completion.model == MODEL  # type: ignore[attr-defined]
    choice = completion.choices[0]  # type: ignore[attr-defined]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    # the prompt is exactly the chat template's tokens
    tokenized = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert completion.usage.prompt_tokens == tokenized["count"]  # type: ignore[attr-defined]


def test_text_parts_equal_string_content(client: OpenAI) -> None:
    parts = [
        MESSAGES[0],
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
    ]
    assert chat(client, parts).choices[0].message.content == chat(client).choices[0].message.content  # type: ignore[attr-defined]


def test_max_completion_tokens_caps_the_answer(client: OpenAI) -> None:
    completion = chat(client, max_completion_tokens=3, max_tokens=None)
    assert completion.usage.completion_tokens == 3  # type: ignore[attr-defined]
    assert completion.choices[0].finish_reason == "length"  # type: ignore[attr-defined]


def test_n_choices_are_seeded_and_indexed(client: OpenAI) -> None:
    first = chat(client, n=3, temperature=1.0, seed=21)
    again = chat(client, n=3, temperature=1.0, seed=21)
    assert [c.index for c in first.choices] == [0, 1, 2]  # type: ignore[attr-defined]
    contents = [c.message.content for c in first.choices]  # type: ignore[attr-defined]
    assert contents == [c.message.content for c in again.choices]  # type: ignore[attr-defined]


def test_chat_logprobs_shape(client: OpenAI) -> None:
    completion = chat(client, logprobs=True, top_logprobs=2)
    logprobs = completion.choices[0].logprobs  # type: ignore[attr-defined]
    assert logprobs is not None and logprobs.content
    assert len(logprobs.content) == completion.usage.completion_tokens  # type: ignore[attr-defined]
    for entry in logprobs.content:
        assert len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client: OpenAI) -> None:
    """prompt_tokens_details.cached_tokens, as OpenAI reports it: 0 for a prompt never seen,
    whole blocks of it the second time (the last token is always computed)."""
    import uuid

    system = f"Session {uuid.uuid4().hex}. " + "You answer briefly and politely. " * 8
    messages = [{"role": "system", "content": system}, MESSAGES[1]]
    first = chat(client, messages, max_tokens=2).usage  # type: ignore[attr-defined]
    again = chat(client, messages, max_tokens=2).usage  # type: ignore[attr-defined]
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = again.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and again.prompt_tokens - 16 <= cached < again.prompt_tokens
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    usage = [c.usage for c in stream if c.usage is not None][-1]
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == cached


def test_continue_final_message(client: OpenAI, http: httpx.Client) -> None:
    """vLLM's continue_final_message: the prompt ends inside the last (assistant) message, its
    end-of-turn cut, and the model goes on with it; it needs add_generation_prompt false."""
    started = [{"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": "The colour I pick is"}]  # fmt: skip
    body = {"model": MODEL, "messages": started, "add_generation_prompt": False}
    closed = http.post("/tokenize", json={**body, "return_token_strs": True}).json()
    open_ = http.post("/tokenize", json={**body, "continue_final_message": True,
                                          "return_token_strs": True}).json()  # fmt: skip
    assert open_["token_strs"][-1] == "Ġis" and closed["token_strs"][-2:] == ["<|im_end|>", "Ċ"]
    assert open_["tokens"] == closed["tokens"][: open_["count"]]
    go_on = chat(client, started, extra_body={"add_generation_prompt": False,  # type: ignore[arg-type]
                                              "continue_final_message": True})  # fmt: skip
    assert go_on.usage.prompt_tokens == open_["count"]  # type: ignore[attr-defined]
    expected = http.post("/v1/completions", json={"model": MODEL, "prompt": open_["tokens"],
                                                   "max_tokens": MAX_TOKENS,
                                                   "temperature": 0}).json()  # fmt: skip
    assert go_on.choices[0].message.content == expected["choices"][0]["text"]  # type: ignore[attr-defined]
    for path in ("/v1/chat/completions", "/tokenize"):
        refused = http.post(path, json={"model": MODEL, "messages": started,
                                        "continue_final_message": True})  # fmt: skip
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "continue_final_message"


def test_echo_puts_the_continued_message_first(client: OpenAI, http: httpx.Client) -> None:
    """vLLM's chat `echo`: the reply starts with the last message's text when that message is
    the assistant's, whole and streamed (right after the role delta, with no logprobs); the
    tokens counted are the model's only; a last message of another role puts nothing first."""
    said = "The colour I pick is"
    started = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": said},
    ]
    go_on = {"add_generation_prompt": False, "continue_final_message": True}
    plain = chat(client, started, extra_body=go_on)
    echoed = chat(client, started, extra_body={**go_on, "echo": True})
    reply = plain.choices[0].message.content  # type: ignore[attr-defined]
    assert reply and echoed.choices[0].message.content == said + reply  # type: ignore[attr-defined]
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens  # type: ignore[attr-defined]
    stream = chat(client, started, stream=True, logprobs=True,
                  extra_body={**go_on, "echo": True})  # fmt: skip
    choices = [c.choices[0] for c in stream if c.choices]  # type: ignore[attr-defined]
    assert [c.delta.content for c in choices[:2]] == ["", said] and choices[1].logprobs is None
    assert choices[2].logprobs is not None
    assert "".join(c.delta.content or "" for c in choices) == said + reply
    asked = [{"role": "user", "content": "Name a colour."}]
    answer = chat(client, asked).choices[0].message.content  # type: ignore[attr-defined]
    assert chat(client, asked, extra_body={"echo": True}).choices[0].message.content == answer  # type: ignore[attr-defined]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": asked, "echo": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    # a long message echoed once a choice is bounded (truncate_prompt_tokens lets it run)
    long = [asked[0], {"role": "assistant", "content": "word " * 60_000}]  # 300 KB
    body = {"model": MODEL, "messages": long, **go_on, "echo": True, "max_tokens": 1,
            "truncate_prompt_tokens": 32}  # fmt: skip
    r = http.post("/v1/chat/completions", json={**body, "n": 128})  # 38 M characters
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    r = http.post("/v1/chat/completions", json={**body, "n": 2})
    assert r.status_code == 200 and r.json()["choices"][1]["message"]["content"].startswith("word ")


def test_an_assistant_refusal_part_is_its_text(http: httpx.Client) -> None:
    """OpenAI's assistant content part `{"type": "refusal", "refusal": ...}` renders as its
    text; on another role it stays a 400."""
    said = "I can't help with that."
    as_text = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": said},
               {"role": "user", "content": "ok"}]  # fmt: skip
    as_part = [*as_text[:1], {"role": "assistant",
                              "content": [{"type": "refusal", "refusal": said}]}, as_text[2]]
    counts = [http.post("/tokenize", json={"model": MODEL, "messages": m}).json()["count"]
              for m in (as_text, as_part)]  # fmt: skip
    assert counts[0] == counts[1]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": as_part,
                                                "max_tokens": 2})  # fmt: skip
    assert r.status_code == 200
    bad = [{"role": "user", "content": [{"type": "refusal", "refusal": said}]}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": bad, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
