"""Every bad input answers the right status and an OpenAI error object; the server keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import MAX_REQUEST_BYTES, Server
from tests.e2e.helpers import MODEL, PROMPTS, complete, error_object

MESSAGES = [{"role": "user", "content": "hi"}]
# Placeholders for prompts sized from the server's context length (read from /v1/models).
FILLS_CONTEXT = "<a prompt of max_model_len tokens>"
NEARLY_FILLS_CONTEXT = "<a prompt of max_model_len - 4 tokens>"


_error = error_object


BAD_COMPLETIONS = [
    ({"use_beam_search": True, "n": 2}, "use_beam_search"),
    ({"priority": 3}, "priority"),
    ({"bad_words": ["the"]}, "bad_words"),
    ({"temperature": 3}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"prompt": None}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, 2, 99999999]}, "prompt"),
    ({"prompt": [[5], [-1]]}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": ["a"] * 1025}, "prompt"),
    ({"prompt": FILLS_CONTEXT}, "prompt"),
    ({"prompt": NEARLY_FILLS_CONTEXT, "max_tokens": 16}, "max_tokens"),
    ({"suffix": "and then"}, "suffix"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "best_of": 3}, "best_of"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"stop": 5}, "stop"),
    ({"seed": "abc"}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"stop_token_ids": [99999999]}, "stop_token_ids"),
]


@pytest.fixture(scope="module")
def max_model_len(http: httpx.Client) -> int:
    length: int = http.get("/v1/models").json()["data"][0]["max_model_len"]
    return length


@pytest.mark.parametrize(("change", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests_are_400(
    http: httpx.Client, max_model_len: int, change: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, **change}
    if body["prompt"] == FILLS_CONTEXT:
        body["prompt"] = [100] * max_model_len
    elif body["prompt"] == NEARLY_FILLS_CONTEXT:
        body["prompt"] = [100] * (max_model_len - 4)
    error = _error(http.post("/v1/completions", json=body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),  # SmolLM2 does not reason
    ({"reasoning_effort": "lots"}, "reasoning_effort"),
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"bad_words": ["Paris"]}, "bad_words"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"logits_processors": ["x"]}, "logits_processors"),
    ({"priority": -1}, "priority"),
]


def test_vllm_fields_at_their_defaults_pass(http: httpx.Client) -> None:
    """What vLLM's clients send unset (beam search off, no bad words, priority 0) is no 400: only
    a value that asks for what this server does not do is refused."""
    unset = {"use_beam_search": False, "bad_words": [], "allowed_token_ids": None,
             "logits_processors": [], "priority": 0}  # fmt: skip
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **unset}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **unset}
    assert http.post("/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize(("change", "param"), BAD_CHATS)
def test_bad_chat_requests_are_400(http: httpx.Client, change: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **change}
    assert _error(http.post("/v1/chat/completions", json=body), 400)["param"] == param


def test_the_official_client_sees_the_error_fields(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, "hello", temperature=5)
    assert info.value.param == "temperature"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-4", prompt="hello", max_tokens=1)
    assert not_found.value.code == "model_not_found"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/completions", {"model": "gpt-4", "prompt": "x"}),
        ("POST", "/v1/chat/completions", {"model": "gpt-4", "messages": MESSAGES}),
        ("GET", "/v1/models/gpt-4", None),
    ],
)
def test_unknown_model_is_404(
    http: httpx.Client, method: str, path: str, body: dict[str, Any] | None
) -> None:
    error = _error(http.request(method, path, json=body), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_unknown_route_and_wrong_method(http: httpx.Client) -> None:
    assert _error(http.get("/v1/engines"), 404)["code"] == "not_found"
    assert _error(http.get("/v1/completions"), 405)["code"] == "method_not_allowed"


def test_malformed_and_non_object_bodies_are_400(http: httpx.Client) -> None:
    headers = {"Content-Type": "application/json"}
    _error(http.post("/v1/completions", content=b'{"prompt": "x",', headers=headers), 400)
    _error(http.post("/v1/completions", content=b"[1, 2]", headers=headers), 400)
    _error(http.post("/v1/completions", content=b"", headers=headers), 400)


def test_api_key_is_required_everywhere_but_health_and_the_page(server: Server) -> None:
    bare = httpx.Client(base_url=server.base_url, timeout=30)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert _error(bare.post("/v1/completions", json=body), 401)["code"] == "invalid_api_key"
    wrong = {"Authorization": "Bearer sk-wrong"}
    _error(bare.post("/v1/completions", json=body, headers=wrong), 401)
    for path in ("/v1/models", "/metrics", "/version", "/docs"):
        _error(bare.get(path), 401)
    assert bare.get("/health").status_code == 200
    assert bare.get("/").status_code == 200  # the playground page asks for the key itself


def test_oversized_body_is_413(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "x" * (MAX_REQUEST_BYTES + 10)}
    assert _error(http.post("/v1/completions", json=body), 413)["code"] == "request_too_large"


def test_text_certainly_too_long_is_400_before_tokenizing(
    http: httpx.Client, max_model_len: int
) -> None:
    """A text with more characters than the context's tokens could hold is rejected without
    being tokenized (the message counts characters; the front door's counts tokens); /tokenize,
    which has no context limit, still tokenizes it."""
    text = "#" * (MAX_REQUEST_BYTES - 1000)  # ~12k tokens: 81 '#' is SmolLM2's longest token
    body = {"model": MODEL, "prompt": text, "max_tokens": 1}
    error = _error(http.post("/v1/completions", json=body), 400)
    assert error["param"] == "prompt" and "characters" in error["message"], error
    chat = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    error = _error(http.post("/v1/chat/completions", json=chat), 400)
    assert error["param"] == "messages" and "characters" in error["message"], error
    tokenized = http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert tokenized["count"] > max_model_len


def test_tokenizer_routes_validate_input(http: httpx.Client) -> None:
    assert _error(http.post("/detokenize", json={"tokens": [99999999]}), 400)["param"] == "tokens"
    _error(http.post("/tokenize", json={"model": MODEL}), 400)


def test_server_still_serves_after_bad_requests(client: OpenAI) -> None:
    completion = complete(client, PROMPTS[0], max_tokens=3)
    assert completion.choices[0].text and completion.usage is not None
