"""OpenAI wire types: requests, responses, stream chunks and errors, fields in OpenAI's doc order.
This module holds what the endpoints share: errors, usage, stream options, the prompt forms and
SamplingRequest (the sampling fields of completions and chat); each endpoint's own models live in
protocol_completions.py, protocol_chat.py and the other protocol_*.py modules beside it.

Requests ignore unknown fields (as vLLM does) so clients that send newer OpenAI fields keep working.
Request models are strict (a wrong JSON type, e.g. `"n": "2"` or `"echo": "no"`, is a 400 as on
OpenAI; an integer still fills a float field) and reject non-finite numbers (`NaN`, `Infinity`,
`1e400`). Range checks and list bounds live on the fields, so `/openapi.json` states them; checks
across fields live in `check()`, which raises SamplingParamsError naming the offending field (the
server answers 400 with it).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag

from convoy.api.protocol_base import OpenAIModel, RequestModel, is_none
from convoy.api.protocol_prediction import Prediction
from convoy.api.protocol_structured import (
    Choices,
    Grammar,
    JsonSchema,
    Regex,
    StructuredOutputsRequest,
    guided_constraints,
    one_constraint,
)
from convoy.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    RequestOutputKind,
    SamplingParamsError,
)

MAX_N = 128  # choices per prompt; OpenAI's own cap
MAX_INT32 = 2**31 - 1  # token counts and top_k: past any context, and safe in int32 tensors


def _json_form(value: Any) -> str:
    """The union member a JSON value is meant as, so an error names only that member's problem
    (a bad list is not also reported as "not a string"). The tags read as types in `loc`."""
    if not isinstance(value, list):
        return "str"
    first = value[0] if value else ""
    if isinstance(first, list):
        return "list[list[int]]"
    return "list[str]" if isinstance(first, str) else "list[int]"


TokenId = Annotated[int, Field(ge=0)]  # the upper bound is the model's vocabulary: checked later
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
StopInput = Annotated[
    Annotated[StopString, Tag("str")]
    | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS), Tag("list[str]")],
    Discriminator(_json_form),
]
BiasTokenId = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # JSON keys are strings
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE)]
LogitBias = Annotated[
    dict[BiasTokenId, Bias],
    Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False}),
]
PromptInput = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[list[str], Tag("list[str]")]
    | Annotated[list[TokenId], Tag("list[int]")]
    | Annotated[list[list[TokenId]], Tag("list[list[int]]")],
    Discriminator(_json_form),
]


# -- errors ------------------------------------------------------------------------------------


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# -- shared ------------------------------------------------------------------------------------


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk carries the usage so far too
    continuous_usage_stats: bool | None = False


class CompletionTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0
    # predicted outputs: the prediction's tokens kept in the output, and those rejected
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0  # served from the prefix cache


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = Field(default=None, exclude_if=is_none)
    # a reasoning model's chat usage only
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default=None, exclude_if=is_none
    )

    @classmethod
    def of(
        cls,
        num_prompt_tokens: int,
        num_completion_tokens: int,
        num_reasoning_tokens: int | None = None,
        num_cached_tokens: int | None = None,
        prediction: tuple[int, int] | None = None,
    ) -> UsageInfo:
        """`prediction`: (accepted, rejected) prediction tokens, when the request had one."""
        total = num_prompt_tokens + num_completion_tokens
        details = None
        if num_reasoning_tokens is not None or prediction is not None:
            accepted, rejected = prediction or (0, 0)
            details = CompletionTokensDetails(
                reasoning_tokens=num_reasoning_tokens or 0,
                accepted_prediction_tokens=accepted,
                rejected_prediction_tokens=rejected,
            )
        cached = None
        if num_cached_tokens is not None:
            cached = PromptTokensDetails(cached_tokens=num_cached_tokens)
        return cls(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=total,
            prompt_tokens_details=cached,
            completion_tokens_details=details,
        )


# vLLM's truncate_prompt_tokens: keep a prompt's last k tokens (-1: as many as the context holds)
TruncatePromptTokens = Annotated[int, Field(ge=-1, le=MAX_INT32)]


def check_truncation(value: int | None, param: str = "truncate_prompt_tokens") -> None:
    if value == 0:
        raise SamplingParamsError(f"{param} must be -1 or at least 1", param)


def refuse_set(
    request: RequestModel, fields: dict[str, str], unset: tuple[Any, ...] = (None,)
) -> None:
    """A 400 naming the first of `fields` (name -> why) the request sets (a value other than
    those in `unset`): what this server does not do, refused rather than answered without it."""
    for name, message in fields.items():
        value = getattr(request, name)
        if value not in unset:
            raise SamplingParamsError(message, name)


_UNSUPPORTED_SAMPLING = {  # vLLM's
    "use_beam_search": "beam search is not supported",
    "bad_words": "bad_words is not supported (logit_bias can ban single tokens)",
    "allowed_token_ids": "allowed_token_ids is not supported (structured outputs can restrict"
    " the text)",
    "logits_processors": "logits_processors are not supported",
    # as vLLM without --scheduling-policy priority: another priority than 0 is an error
    "priority": "priority scheduling is not enabled: requests run first come, first served",
}


class SamplingRequest(RequestModel):
    """Fields completions and chat share: OpenAI's, then vLLM's extensions."""

    model: str | None = None
    frequency_penalty: float | None = Field(default=0.0, ge=-2, le=2)
    logit_bias: LogitBias | None = None
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=0.0, ge=-2, le=2)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # int64, as OpenAI's
    stop: StopInput | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=1.0, ge=0, le=2)
    top_p: float | None = Field(default=1.0, gt=0, le=1)
    user: str | None = None
    # vLLM extensions
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=MAX_REPETITION_PENALTY)
    min_tokens: int | None = Field(default=None, ge=0, le=MAX_INT32)
    ignore_eos: bool | None = False
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool | None = False
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    # logprobs name tokens `token_id:<id>` (vLLM's; the text of a token may not be its own)
    return_tokens_as_token_ids: bool | None = False
    # vLLM's, for sampling this server does not do: a 400 naming them when set, not an output
    # made without them
    use_beam_search: bool | None = False
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logits_processors: list[Any] | None = None
    priority: int | None = Field(default=0, ge=-(2**63), lt=2**63)
    skip_special_tokens: bool | None = True
    # only requests with the same salt share prefix-cache blocks (tenant isolation)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # structured outputs: one constraint object, or one of the older guided_* fields
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: JsonSchema | None = None
    guided_regex: Regex | None = None
    guided_choice: Choices | None = None
    guided_grammar: Grammar | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: there is one backend
    # predicted outputs: drafts for speculative decoding (never changes the output)
    prediction: Prediction | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        options = self.stream_options
        return self.include_usage and options is not None and bool(options.continuous_usage_stats)

    def check(self) -> None:
        """Cross-field rules; raises SamplingParamsError naming the field."""
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        check_truncation(self.truncate_prompt_tokens)
        refuse_set(self, _UNSUPPORTED_SAMPLING, unset=(None, False, []))

    def _sampling_kwargs(self) -> dict[str, Any]:
        return {
            "n": self.n or 1,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k or 0,
            "min_p": self.min_p or 0.0,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": self.repetition_penalty or 1.0,
            "logit_bias": _logit_bias(self.logit_bias),
            "seed": self.seed,
            "stop": _stop_list(self.stop),
            "stop_token_ids": list(self.stop_token_ids or []),
            "include_stop_str_in_output": bool(self.include_stop_str_in_output),
            "ignore_eos": bool(self.ignore_eos),
            "min_tokens": self.min_tokens or 0,
            "skip_special_tokens": self.skip_special_tokens is not False,
            "output_kind": RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            "cache_salt": self.cache_salt,
            "structured_outputs": one_constraint(self.constraints()),
        }

    def constraints(self) -> list[tuple[str, dict[str, Any]]]:
        """Every output constraint the request sets, as (field, its spec)."""
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        return guided_constraints(self.structured_outputs, guided)


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON object keys are strings (decimal token ids, checked by the field's pattern)."""
    if not bias:
        return None
    return {int(token_id): float(value) for token_id, value in bias.items()}
