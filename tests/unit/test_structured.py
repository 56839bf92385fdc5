"""Structured outputs without a model: the spec's checks and bounds (every rejection names the
request field the constraint came from), the wire fields' mapping to it, and the sampler's
bitmask (the constraint wins over min_tokens; other rows untouched)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from convoy.api.protocol_chat import ChatCompletionRequest
from convoy.api.protocol_completions import CompletionRequest
from convoy.sampling_params import SamplingParams, SamplingParamsError
from convoy.structured.params import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_REGEX_CHARS,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    StructuredOutputsError,
    StructuredOutputsParams,
)
from convoy.worker.batch import SamplerRow
from convoy.worker.sampler import sample


def _nested(levels: int) -> dict[str, Any]:
    """A schema 2 * levels + 1 JSON containers deep (an object and its properties a level)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


BIG_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}

REJECTED = [
    {},
    {"regex": "a", "choice": ["a"]},
    {"json_object": False},
    {"json": "[1, 2"},
    {"json": "[1, 2]"},
    {"json": _nested(MAX_SCHEMA_DEPTH // 2)},
    {"json": BIG_SCHEMA},
    {"json": "x" * (MAX_SCHEMA_BYTES + 1)},
    {"json": {"type": "number", "maximum": float("nan")}},
    {"regex": ""},
    {"regex": "a" * (MAX_REGEX_CHARS + 1)},
    {"choice": []},
    {"choice": ["a"] * (MAX_CHOICES + 1)},
    {"choice": ["a", ""]},
    {"choice": ["a" * (MAX_CHOICE_CHARS + 1)]},
    {"grammar": "x" * (MAX_GRAMMAR_CHARS + 1)},
]


@pytest.mark.parametrize("spec", REJECTED)
def test_each_rejection_names_its_field(spec: dict[str, Any]) -> None:
    with pytest.raises(StructuredOutputsError) as info:
        StructuredOutputsParams(**spec, param="guided_json")
    assert info.value.param == "guided_json"


def test_the_cache_key_is_canonical_and_keeps_key_order() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    as_text = StructuredOutputsParams(json='{"type": "object",\n "properties": {"b": {"type":'
                                      ' "integer"}, "a": {"type": "string"}}}')  # fmt: skip
    as_dict = StructuredOutputsParams(json=schema, param="response_format")
    assert as_text.json == schema and as_text.cache_key == as_dict.cache_key
    swapped = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    assert StructuredOutputsParams(json=swapped).cache_key != as_dict.cache_key
    assert StructuredOutputsParams(json=_nested((MAX_SCHEMA_DEPTH - 1) // 2)).kind == "json"
    assert StructuredOutputsParams(choice=["a", "b"]).cache_key == ("choice", '["a","b"]')
    assert StructuredOutputsParams(json_object=True).cache_key == ("json_object", "")


_MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("body", "param", "kind"),
    [
        ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs", "json"),
        ({"structured_outputs": {"json_object": True}}, "structured_outputs", "json_object"),
        ({"guided_json": '{"type": "integer"}'}, "guided_json", "json"),
        ({"guided_regex": "a|b"}, "guided_regex", "regex"),
        (
            {"guided_choice": ["a", "b"], "guided_decoding_backend": "xgrammar"},
            "guided_choice",
            "choice",
        ),
        ({"guided_grammar": 'root ::= "a"'}, "guided_grammar", "grammar"),
    ],
)
def test_wire_fields_map_to_one_constraint(body: dict[str, Any], param: str, kind: str) -> None:
    for request in (
        CompletionRequest.model_validate({"prompt": "x", **body}),
        ChatCompletionRequest.model_validate({"messages": _MESSAGES, **body}),
    ):
        spec = request.to_sampling_params().structured_outputs
        assert spec is not None and (spec.param, spec.kind) == (param, kind)


def test_chat_response_format_maps_to_a_constraint() -> None:
    def spec(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
        body = {"messages": _MESSAGES, "response_format": response_format}
        return ChatCompletionRequest.model_validate(body).to_sampling_params().structured_outputs

    assert spec({"type": "text"}) is None
    json_object = spec({"type": "json_object"})
    assert json_object is not None and json_object.kind == "json_object"
    fmt = {"name": "Point", "schema": SCHEMA, "strict": True, "description": "a point"}
    schema = spec({"type": "json_schema", "json_schema": fmt})
    assert schema is not None and schema.json == SCHEMA and schema.param == "response_format"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "a", "json_object": True}}, "structured_outputs"),
        ({"guided_json": "{"}, "guided_json"),
    ],
)
def test_bad_constraints_are_named_before_any_work(body: dict[str, Any], param: str) -> None:
    request = ChatCompletionRequest.model_validate({"messages": _MESSAGES, **body})
    with pytest.raises((SamplingParamsError, StructuredOutputsError)) as info:
        request.to_sampling_params()
    assert info.value.param == param  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs"),
        ({"structured_outputs": {"choice": ["a"] * (MAX_CHOICES + 1)}}, "structured_outputs"),
        ({"guided_regex": "a" * (MAX_REGEX_CHARS + 1)}, "guided_regex"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_json": 5}, "guided_json"),
    ],
)
def test_wrong_shapes_fail_validation_at_their_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": _MESSAGES, **body})
    assert info.value.errors()[0]["loc"][0] == param


def _row(bitmask: np.ndarray | None, **params: Any) -> SamplerRow:
    return SamplerRow(SamplingParams(temperature=0, **params), None, [1], [], [3], False, bitmask)


def _bitmask(allowed: list[int], vocab: int) -> np.ndarray:
    bits = np.zeros(vocab, dtype=np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def test_the_bitmask_constrains_only_its_row_and_wins_over_min_tokens() -> None:
    vocab = 64
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    logits[:, 7] = 10.0  # the model's favourite, forbidden to the constrained rows
    rows = [
        _row(None),
        _row(_bitmask([5, 40], vocab)),
        _row(_bitmask([3], vocab), min_tokens=4),  # only the stop token: the grammar wins
        _row(_bitmask([3, 9], vocab), min_tokens=4),  # min_tokens still bans 3
    ]
    before = logits.clone()
    out = sample(logits, rows)
    assert out.token_ids[0] == 7
    assert out.token_ids[1] == (5 if logits[1, 5] > logits[1, 40] else 40)
    assert out.token_ids[2:] == [3, 9]
    assert torch.equal(logits, before)  # the raw logits (and their logprobs) stay as they were
    alone = sample(logits[:1].clone(), rows[:1])
    assert alone.token_ids == out.token_ids[:1]
