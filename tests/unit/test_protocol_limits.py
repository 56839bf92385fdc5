"""Request limits without a model: strict JSON types, finite numbers, list bounds, the OpenAPI
schema that states them, and sequence admission (prompts x n per request, the queue bound)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import pytest
from pydantic import ValidationError

from convoy.api.engine_client import EngineClient, ServingLimits
from convoy.api.errors import APIError
from convoy.api.metrics import RequestRecord
from convoy.api.protocol_base import RequestModel
from convoy.api.protocol_chat import ChatCompletionRequest
from convoy.api.protocol_completions import CompletionRequest
from convoy.api.server import build_app
from convoy.config import ServerConfig
from convoy.engine.request import EngineRequest
from convoy.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    SamplingParamsError,
)


def _error_field(body: str | dict[str, Any], model: type[RequestModel] = CompletionRequest) -> Any:
    """The field the first validation error names, for a JSON body (as the server parses it)."""
    text = body if isinstance(body, str) else json.dumps(body)
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(text)
    return info.value.errors()[0]["loc"][0]


@pytest.mark.parametrize(
    ("field", "value"),
    [("echo", "no"), ("stream", "true"), ("n", "2"), ("max_tokens", 1.5), ("temperature", "1")],
)
def test_wrong_json_types_are_rejected(field: str, value: object) -> None:
    assert _error_field({"prompt": "x", field: value}) == field


def test_integers_fill_float_fields() -> None:
    req = CompletionRequest.model_validate_json('{"prompt": "x", "temperature": 1, "top_p": 1}')
    assert req.temperature == 1.0 and isinstance(req.temperature, float)


FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_non_finite_numbers_are_rejected(field: str, literal: str) -> None:
    assert _error_field(f'{{"prompt": "x", "{field}": {literal}}}') == field
    chat = f'{{"messages": [{{"role": "user", "content": "hi"}}], "{field}": {literal}}}'
    assert _error_field(chat, ChatCompletionRequest) == field


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop", ["s"] * (MAX_STOP_STRINGS + 1)),
        ("stop", "s" * (MAX_STOP_CHARS + 1)),
        ("stop", ["s" * (MAX_STOP_CHARS + 1)]),
        ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1)),
        ("logit_bias", {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}),
        ("logit_bias", {"5": '"1"'}),
        ("repetition_penalty", 0),
        ("repetition_penalty", 2.5),
        ("top_k", 2**31),
        ("max_tokens", 2**63),
    ],
)
def test_bounds_name_the_field(field: str, value: object) -> None:
    assert _error_field({"prompt": "x", field: value}) == field


def test_values_at_the_bounds_pass() -> None:
    req = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "stop": ["s" * MAX_STOP_CHARS] * MAX_STOP_STRINGS,
            "stop_token_ids": [1] * MAX_STOP_TOKEN_IDS,
            "logit_bias": {str(i): -100 for i in range(MAX_LOGIT_BIAS)},
            "repetition_penalty": 2,
        }
    )
    params = req.to_sampling_params()
    assert len(params.stop) == MAX_STOP_STRINGS and len(params.logit_bias or {}) == MAX_LOGIT_BIAS


def test_unknown_fields_even_non_finite_are_ignored() -> None:
    req = CompletionRequest.model_validate_json('{"prompt": "x", "future": NaN, "x": {"y": []}}')
    assert req.prompt == "x"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"repetition_penalty": 3.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["s" * (MAX_STOP_CHARS + 1)]}, "stop"),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ],
)
def test_sampling_params_hold_the_same_bounds(kwargs: dict[str, Any], param: str) -> None:
    """The offline LLM path (no pydantic) is bounded too."""
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_openapi_schema_states_types_ranges_and_bounds() -> None:
    schemas = build_app(ServerConfig()).openapi()["components"]["schemas"]
    props = schemas["CompletionRequest"]["properties"]

    def non_null(name: str) -> dict[str, Any]:
        member: dict[str, Any] = next(m for m in props[name]["anyOf"] if m["type"] != "null")
        return member

    assert non_null("echo")["type"] == "boolean" and non_null("n")["type"] == "integer"
    assert (non_null("n")["minimum"], non_null("n")["maximum"]) == (1, 128)
    assert non_null("repetition_penalty")["maximum"] == 2
    assert non_null("stop_token_ids")["maxItems"] == MAX_STOP_TOKEN_IDS
    bias = non_null("logit_bias")
    assert bias["maxProperties"] == MAX_LOGIT_BIAS and bias["additionalProperties"] is False
    stop_forms = props["stop"]["anyOf"][0]["oneOf"]
    assert {"type": "string", "maxLength": MAX_STOP_CHARS} in stop_forms
    assert any(form.get("maxItems") == MAX_STOP_STRINGS for form in stop_forms)
    roles = schemas["ChatMessageParam"]["properties"]["role"]["enum"]
    assert roles == ["system", "developer", "user", "assistant", "tool"]


# -- admission ---------------------------------------------------------------------------------


def _client(max_seqs_per_request: int | None, max_queue_seqs: int | None) -> EngineClient:
    """Admission is bookkeeping before the engine is touched, so no engine is needed."""
    limits = ServingLimits(8, max_seqs_per_request, max_queue_seqs)
    return EngineClient(cast(Any, None), "m", limits)


def _requests(num_prompts: int, **params: Any) -> list[EngineRequest]:
    sp = SamplingParams(**params)
    return [EngineRequest(f"r-{i}", None, [1], sp, "r", 0.0) for i in range(num_prompts)]


@pytest.mark.parametrize(
    ("num_prompts", "params", "param"),
    [
        (4, {"n": 3}, "n"),
        (2, {"n": 2, "best_of": 6}, "best_of"),
        (9, {}, "prompt"),
    ],
)
def test_sequences_per_request_are_capped(
    num_prompts: int, params: dict[str, int], param: str
) -> None:
    client = _client(max_seqs_per_request=8, max_queue_seqs=None)
    client.check_num_seqs(4, SamplingParams(n=2), "prompt")  # 8: at the cap
    with pytest.raises(APIError) as info:
        client.check_num_seqs(num_prompts, SamplingParams(**params), "prompt")
    assert (info.value.status, info.value.param) == (400, param)


def test_admission_reserves_every_sequence_at_once_and_gives_them_back() -> None:
    client = _client(max_seqs_per_request=None, max_queue_seqs=10)
    first = client.generate(_requests(3, n=2), RequestRecord("a"))  # 6 sequences
    assert (client.num_in_flight, client.num_seqs_in_flight) == (3, 6)
    with pytest.raises(APIError) as info:  # 6 + 6 > 10, though nothing has started running yet
        client.generate(_requests(2, n=3), RequestRecord("b"))
    assert info.value.status == 429 and info.value.code == "queue_full"
    assert info.value.headers is not None and int(info.value.headers["Retry-After"]) >= 1
    assert client.num_seqs_in_flight == 6  # a refused request reserves nothing
    second = client.generate(_requests(4), RequestRecord("c"))  # 6 + 4 fits exactly
    assert client.num_seqs_in_flight == 10
    # a stream closed before its first read (client gone before the response began) gives back
    asyncio.run(first.aclose())
    assert (client.num_in_flight, client.num_seqs_in_flight) == (4, 4)
    asyncio.run(second.aclose())
    assert (client.num_in_flight, client.num_seqs_in_flight) == (0, 0)
