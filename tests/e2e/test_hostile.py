"""Hostile requests against the real server: each gets a 400/429 OpenAI error naming the field,
fast, never a 5xx or a hang; sequence admission holds under concurrency; and after all of them a
normal request is served with no KV block or sequence left behind.

(Plainer bad values, e.g. out-of-range temperatures and out-of-vocabulary token ids, are in
test_errors.py.)
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import MAX_QUEUE, Server
from tests.e2e.helpers import MODEL, PROMPTS, complete, error_object

KV_USED = "convoy_kv_blocks_used"
IN_FLIGHT = "convoy_engine_requests_in_flight"
FAST_S = 10  # generous on a shared 2-core machine; these used to take minutes
MESSAGES = [{"role": "user", "content": "hi"}]
JSON = {"Content-Type": "application/json"}
BASE_BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": MODEL, "prompt": "x", "max_tokens": 1},
    "/v1/chat/completions": {"model": MODEL, "messages": MESSAGES, "max_tokens": 1},
    "/tokenize": {"model": MODEL, "prompt": "x"},
    "/detokenize": {"model": MODEL, "tokens": [1]},
}


def _raw(http: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers=JSON, timeout=FAST_S)


@pytest.mark.parametrize(
    "body",
    [
        # deep nesting in an ignored field, then in a known one
        b'{"prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"prompt": "\xff\xfe\xfd", "max_tokens": 1}',  # invalid UTF-8
        b'{"prompt": "x", "max_tokens": 1, ' + b'"a": 1, ' * 10_000 + b'"b": ',  # truncated
    ],
    ids=["deep-unknown-field", "deep-prompt", "invalid-utf8", "truncated"],
)
def test_malformed_bodies_are_400(http: httpx.Client, body: bytes) -> None:
    error_object(_raw(http, "/v1/completions", body), 400)


# (field, JSON literal): numbers JSON parsers turn into inf / NaN, or past any integer type
NON_FINITE = [
    ("temperature", "NaN"),
    ("top_p", "Infinity"),
    ("presence_penalty", "-Infinity"),
    ("frequency_penalty", "1e400"),
    ("repetition_penalty", "1e400"),
    ("min_p", "NaN"),
    ("max_tokens", "1e400"),
    ("n", "1" + "0" * 400),
    ("seed", "1" + "0" * 30),
    ("top_k", "1" + "0" * 30),
    ("logit_bias", '{"5": NaN}'),
    ("logit_bias", '{"5": -1e400}'),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("field", "literal"), NON_FINITE)
def test_non_finite_and_huge_numbers_are_400(
    http: httpx.Client, path: str, field: str, literal: str
) -> None:
    base = {k: v for k, v in BASE_BODIES[path].items() if k != field}
    body = json.dumps(base)[:-1] + f', "{field}": {literal}}}'  # not expressible by json.dumps
    assert error_object(_raw(http, path, body.encode()), 400)["param"] == field


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"prompt": ["a"] * 100_000}, "prompt"),  # max_prompts_per_request, before tokenizing
        ({"prompt": [[1]] * 100_000}, "prompt"),
        ({"prompt": [[1]] * 1024, "n": 128}, "n"),  # 131k sequences
        ({"prompt": [[1]] * 2, "n": 2, "best_of": MAX_QUEUE}, "best_of"),
        ({"prompt": [[1]] * (MAX_QUEUE + 1)}, "prompt"),  # one sequence per prompt: too many
        ({"stop": [f"s{i}" for i in range(10_000)]}, "stop"),
        ({"stop": "s" * 100_000}, "stop"),
        ({"stop_token_ids": list(range(10_000))}, "stop_token_ids"),
        ({"logit_bias": {str(i): 1 for i in range(10_000)}}, "logit_bias"),
        ({"logit_bias": {"123456789012": 1}}, "logit_bias"),
        ({"prompt": [2**70]}, "prompt"),
        ({"stop_token_ids": [2**70]}, "stop_token_ids"),
        ({"repetition_penalty": 50}, "repetition_penalty"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, dict) else v,
)
def test_amplifying_requests_are_400_naming_the_field(
    http: httpx.Client, change: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, **change}
    response = http.post("/v1/completions", json=body, timeout=FAST_S)
    assert error_object(response, 400)["param"] == param


def test_whole_responses_of_too_many_logprobs_are_400(http: httpx.Client) -> None:
    """A response that is not streamed holds all its logprobs at once (a few KB each on the way
    out): one that could hold more than a million is a 400 naming the field, before any work
    (64 choices x 21 alternatives x what the context leaves would be ~10M, tens of GB); the
    same request streamed runs (its logprobs go out as they come)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": MAX_QUEUE,
            "logprobs": True, "top_logprobs": 20}  # fmt: skip
    response = http.post("/v1/chat/completions", json=chat, timeout=FAST_S)
    assert error_object(response, 400)["param"] == "top_logprobs"
    capped = {**chat, "max_tokens": 800}  # 64 x 800 x 21: just over
    response = http.post("/v1/chat/completions", json=capped, timeout=FAST_S)
    assert "stream it" in error_object(response, 400)["message"]
    with http.stream("POST", "/v1/chat/completions", json={**capped, "stream": True}) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["object"] == "chat.completion.chunk"
    # scoring 60 prompts of 1,000 tokens with 20 alternatives each (echo): 1.26M
    scoring = {"model": MODEL, "prompt": [[5] * 1000] * 60, "echo": True, "logprobs": 20,
               "max_tokens": 0}  # fmt: skip
    response = http.post("/v1/completions", json=scoring, timeout=FAST_S)
    assert error_object(response, 400)["param"] == "logprobs"


# One wrong JSON type per request field: (route, field, value). OpenAI answers 400 to each.
WRONG_TYPES: list[tuple[str, str, Any]] = (
    [
        ("/v1/completions", field, value)
        for field, value in {
            "model": 5,
            "prompt": 5,
            "best_of": "2",
            "echo": "no",
            "frequency_penalty": "0",
            "logit_bias": [5],
            "logprobs": True,
            "max_tokens": 1.5,
            "n": "2",
            "presence_penalty": "0",
            "seed": 1.5,
            "stop": [1],
            "stream": "true",
            "stream_options": "yes",
            "suffix": 5,
            "temperature": "1",
            "top_p": "1",
            "user": 5,
            "top_k": 1.5,
            "min_p": "0",
            "repetition_penalty": "1",
            "min_tokens": 1.5,
            "ignore_eos": "no",
            "stop_token_ids": "1",
            "include_stop_str_in_output": 1,
            "skip_special_tokens": 0,
        }.items()
    ]
    + [
        ("/v1/chat/completions", field, value)
        for field, value in {
            "messages": "hi",
            "logprobs": 1,
            "max_completion_tokens": "5",
            "max_tokens": 1.5,
            "n": 2.0,
            "response_format": "text",
            "tools": {"type": "function"},
            "tool_choice": 5,
            "parallel_tool_calls": "yes",
            "top_logprobs": "2",
            "add_generation_prompt": "yes",
            "stream": 1,
            "temperature": "0",
        }.items()
    ]
    + [
        ("/v1/chat/completions", "messages", [{"role": "user", "content": 5}]),
        ("/v1/chat/completions", "messages", [{"role": "user", "content": [{"type": 1}]}]),
        ("/tokenize", "prompt", 5),
        ("/tokenize", "add_special_tokens", "yes"),
        ("/tokenize", "return_token_strs", 1),
        ("/detokenize", "tokens", "1 2"),
        ("/detokenize", "tokens", [1.0]),
    ]
)


@pytest.mark.parametrize(("path", "field", "value"), WRONG_TYPES)
def test_wrong_types_are_400_naming_the_field(
    http: httpx.Client, path: str, field: str, value: Any
) -> None:
    response = http.post(path, json={**BASE_BODIES[path], field: value}, timeout=FAST_S)
    assert error_object(response, 400)["param"] == field


@pytest.mark.parametrize("path", list(BASE_BODIES))
def test_unknown_fields_are_ignored(http: httpx.Client, path: str) -> None:
    extras = {"frobnicate": {"deep": [1, None, "x"]}, "metadata": {"a": "b"}, "store": True}
    response = http.post(path, json={**BASE_BODIES[path], **extras}, timeout=60)
    assert response.status_code == 200, response.text


def _hold(num_prompts: int, n: int) -> dict[str, Any]:
    """A streamed request of num_prompts x n sequences that runs until its client leaves."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(num_prompts)]
    return {"model": MODEL, "prompt": prompts, "n": n, "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0.8, "seed": 1, "stream": True}  # fmt: skip


def test_full_sequence_queue_answers_429_with_retry_after(
    server: Server, http: httpx.Client
) -> None:
    server.wait_for_metric(IN_FLIGHT, 0)
    # one prompt with n=64 fills the queue though only one engine request is in flight
    with http.stream("POST", "/v1/completions", json=_hold(1, MAX_QUEUE)) as stream:
        assert stream.status_code == 200  # admitted: its sequences are reserved from now on
        assert server.metric(IN_FLIGHT) == 1
        one = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        response = http.post("/v1/completions", json=one)
        error = error_object(response, 429)
        assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
        assert int(response.headers["Retry-After"]) >= 1
        stream_one = http.post("/v1/completions", json={**one, "stream": True})
        assert error_object(stream_one, 429)["code"] == "queue_full"  # a 429, not a 200 stream
    server.wait_for_metric(IN_FLIGHT, 0)
    assert http.post("/v1/completions", json=one).status_code == 200


async def test_concurrent_requests_cannot_race_past_the_queue_bound(server: Server) -> None:
    """Six requests of 40 sequences each arrive together at a 64-sequence queue: one fits, and
    every other one is refused, because each reserves all its sequences before any await."""
    await asyncio.to_thread(server.wait_for_metric, IN_FLIGHT, 0)
    num_requests = 6
    statuses: list[int] = []
    all_answered = asyncio.Event()

    async def one(ac: httpx.AsyncClient) -> None:
        async with ac.stream("POST", "/v1/completions", json=_hold(1, 40)) as response:
            statuses.append(response.status_code)
            if len(statuses) == num_requests:
                all_answered.set()
            await asyncio.wait_for(all_answered.wait(), 60)  # hold the admitted one open

    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers) as ac:
        await asyncio.gather(*(one(ac) for _ in range(num_requests)))
    assert sorted(statuses) == [200] + [429] * (num_requests - 1)
    await asyncio.to_thread(server.wait_for_metric, IN_FLIGHT, 0)


def test_server_is_clean_after_the_hostile_requests(server: Server, client: OpenAI) -> None:
    server.wait_for_metric(IN_FLIGHT, 0)
    server.wait_for_metric(KV_USED, 0)
    completion = complete(client, PROMPTS[0], max_tokens=3)
    assert completion.choices[0].text and completion.usage is not None
    server.wait_for_metric(KV_USED, 0)
