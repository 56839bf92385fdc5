"""OpenAI request models: prompt forms, defaults, ranges, cross-field rules, SamplingParams mapping.

Pure pydantic, no model.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from convoy.api.logprobs import token_texts
from convoy.api.protocol_chat import ChatCompletionRequest
from convoy.api.protocol_completions import CompletionRequest, CompletionResponse
from convoy.api.protocol_tools import ChatMessageParam
from convoy.sampling_params import RequestOutputKind, SamplingParamsError


@pytest.mark.parametrize(
    ("prompt", "kind"),
    [
        ("hello", str),
        (["a", "b"], list),
        ([1, 2, 3], list),
        ([[1, 2], [3]], list),
    ],
)
def test_prompt_forms_parse(prompt: object, kind: type) -> None:
    req = CompletionRequest.model_validate({"prompt": prompt})
    assert isinstance(req.prompt, kind)
    assert req.prompt == prompt


def test_token_id_prompts_stay_ints() -> None:
    req = CompletionRequest.model_validate({"prompt": [[5, 6], [7]]})
    assert req.prompt == [[5, 6], [7]]
    assert all(isinstance(t, int) for p in req.prompt for t in p)  # type: ignore[union-attr]


@pytest.mark.parametrize("prompt", [[["a"]], [1, "a"], {"text": "a"}, None])
def test_bad_prompt_forms_are_rejected(prompt: object) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": prompt})
    assert info.value.errors()[0]["loc"][0] == "prompt"


def test_completion_defaults_map_to_sampling_params() -> None:
    params = CompletionRequest(prompt="x").to_sampling_params()
    assert params.max_tokens == 16
    assert params.n == 1 and params.temperature == 1.0 and params.top_p == 1.0
    assert params.logprobs is None and params.prompt_logprobs is None
    assert params.output_kind is RequestOutputKind.FINAL_ONLY


def test_completion_fields_map_to_sampling_params() -> None:
    req = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "n": 2,
            "best_of": 3,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.1,
            "logit_bias": {"42": 5, "7": -100},
            "seed": 1234,
            "stop": "\n",
            "max_tokens": 7,
            "min_tokens": 2,
            "ignore_eos": True,
            "logprobs": 3,
            "echo": True,
            "stream": True,
        }
    )
    params = req.to_sampling_params()
    assert (params.n, params.best_of, params.temperature, params.top_p) == (2, 3, 0.5, 0.9)
    assert (params.top_k, params.min_p, params.repetition_penalty) == (40, 0.05, 1.1)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.logit_bias == {42: 5.0, 7: -100.0}
    assert params.seed == 1234 and params.stop == ["\n"]
    assert (params.max_tokens, params.min_tokens, params.ignore_eos) == (7, 2, True)
    # echo + logprobs scores the prompt too
    assert params.logprobs == 3 and params.prompt_logprobs == 3
    assert params.output_kind is RequestOutputKind.DELTA


def test_null_fields_mean_defaults() -> None:
    req = CompletionRequest.model_validate(
        {"prompt": "x", "temperature": None, "top_p": None, "n": None, "stop": None}
    )
    params = req.to_sampling_params()
    assert (params.temperature, params.top_p, params.n, params.stop) == (1.0, 1.0, 1, [])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.5),
        ("temperature", -0.1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("n", 0),
        ("logprobs", 21),
        ("logprobs", -1),
        ("presence_penalty", 3),
        ("frequency_penalty", -2.5),
        ("max_tokens", -1),
        ("best_of", 0),
        ("min_p", 2),
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"-5": 1}),
        ("logit_bias", {"5": 101}),
    ],
)
def test_out_of_range_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", field: value})
    assert info.value.errors()[0]["loc"][0] == field


def _param_of_check(request: CompletionRequest | ChatCompletionRequest) -> str:
    with pytest.raises(SamplingParamsError) as info:
        request.check()
        request.to_sampling_params()
    return info.value.param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "n": 1, "best_of": 2}, "best_of"),
        ({"suffix": "tail"}, "suffix"),
        ({"n": 3, "best_of": 2}, "best_of"),
    ],
)
def test_completion_cross_field_rules(body: dict[str, object], param: str) -> None:
    assert _param_of_check(CompletionRequest.model_validate({"prompt": "x", **body})) == param


def test_best_of_equal_to_n_may_stream() -> None:
    CompletionRequest(prompt="x", stream=True, n=2, best_of=2).check()


_MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_chat_unsupported_features_are_named(body: dict[str, object], param: str) -> None:
    req = ChatCompletionRequest.model_validate({"messages": _MESSAGES, **body})
    assert _param_of_check(req) == param


def test_chat_max_completion_tokens_wins_and_logprobs_map() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": _MESSAGES,
            "max_tokens": 5,
            "max_completion_tokens": 9,
            "logprobs": True,
            "top_logprobs": 2,
            "response_format": {"type": "text"},
        }
    )
    req.check()
    params = req.to_sampling_params()
    assert params.max_tokens == 9 and params.logprobs == 2 and params.prompt_logprobs is None
    no_limit = ChatCompletionRequest.model_validate({"messages": _MESSAGES})
    assert no_limit.to_sampling_params().max_tokens is None  # up to the context length


def test_chat_messages_render_for_the_template() -> None:
    parts = ChatMessageParam.model_validate(
        {
            "role": "developer",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        }
    )
    assert parts.text() == "a\nb"
    image = ChatMessageParam.model_validate(
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    )
    with pytest.raises(SamplingParamsError) as info:
        image.text()
    assert info.value.param == "messages"


@pytest.mark.parametrize("messages", [[], [{"role": "wizard", "content": "x"}], "hello"])
def test_bad_messages_are_rejected(messages: object) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": messages})
    assert info.value.errors()[0]["loc"][0] == "messages"


def test_unknown_fields_are_ignored() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "some_future_field": 1})
    assert not hasattr(req, "some_future_field")


def test_response_fields_follow_openai_order() -> None:
    fields = list(CompletionResponse.model_fields)
    assert fields == ["id", "object", "created", "model", "choices", "usage"]


class _ByteTokenizer:
    """Token id -> raw bytes; decoding replaces broken UTF-8 as a real tokenizer does."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.pieces[t] for t in token_ids).decode("utf-8", errors="replace")


def test_token_texts_concatenate_to_the_text_and_hold_back_split_characters() -> None:
    euro = "€".encode()  # three bytes, split over two tokens below
    tok = _ByteTokenizer([b"Price", b" is", b" 5", euro[:1], euro[1:], b"!"])
    ids = [0, 1, 2, 3, 4, 5]
    texts = token_texts(tok, ids)  # type: ignore[arg-type]
    assert texts == ["Price", " is", " 5", "", "€", "!"]
    assert "".join(texts) == tok.decode(ids)
    # in the context of earlier tokens, only the new tokens' text is returned
    assert token_texts(tok, [3, 4, 5], context_ids=[0, 1, 2]) == ["", "€", "!"]  # type: ignore[arg-type]
