"""OpenAI wire types: requests, responses, stream chunks and errors, fields in OpenAI's doc order.

Requests ignore unknown fields (as vLLM does) so clients that send newer OpenAI fields keep working.
Range checks that OpenAI documents live on the fields; checks across fields live in `check()`,
which raises SamplingParamsError naming the offending field (the server answers 400 with it).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from convoy.sampling_params import (
    MAX_LOGPROBS,
    RequestOutputKind,
    SamplingParams,
    SamplingParamsError,
)

MAX_N = 128  # choices per prompt; OpenAI's own cap

PromptInput = str | list[str] | list[int] | list[list[int]]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# -- errors ------------------------------------------------------------------------------------


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# -- shared ------------------------------------------------------------------------------------


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
        total = num_prompt_tokens + num_completion_tokens
        return cls(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=total,
        )


class SamplingRequest(OpenAIModel):
    """Fields completions and chat share: OpenAI's, then vLLM's extensions."""

    model: str | None = None
    frequency_penalty: float | None = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=0.0, ge=-2, le=2)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # int64, as OpenAI's
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=1.0, ge=0, le=2)
    top_p: float | None = Field(default=1.0, gt=0, le=1)
    user: str | None = None
    # vLLM extensions
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check(self) -> None:
        """Cross-field rules; raises SamplingParamsError naming the field."""
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError(
                "stream_options is only allowed when stream is true", "stream_options"
            )

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
        }


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON object keys are strings; OpenAI's are token ids."""
    if not bias:
        return None
    try:
        return {int(token_id): float(value) for token_id, value in bias.items()}
    except ValueError:
        raise SamplingParamsError("logit_bias keys must be token ids", "logit_bias") from None


# -- /v1/completions ---------------------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(default=16, ge=0)
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise SamplingParamsError(
                "suffix is not supported: this model has no fill-in-the-middle tokens", "suffix"
            )
        if self.stream and self.best_of is not None and self.best_of > (self.n or 1):
            raise SamplingParamsError("best_of greater than n cannot be streamed", "best_of")

    def to_sampling_params(self) -> SamplingParams:
        """Engine parameters for every prompt of this request (raises SamplingParamsError)."""
        scoring = bool(self.echo) and self.logprobs is not None
        return SamplingParams(
            **self._sampling_kwargs(),
            best_of=self.best_of,
            max_tokens=self.max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if scoring else None,
        )


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)

    def extend(self, other: CompletionLogProbs) -> None:
        self.text_offset.extend(other.text_offset)
        self.token_logprobs.extend(other.token_logprobs)
        self.tokens.extend(other.tokens)
        self.top_logprobs.extend(other.top_logprobs)


class CompletionChoice(OpenAIModel):
    text: str
    index: int
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# -- /v1/chat/completions ----------------------------------------------------------------------


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessageParam(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, str]:
        """The message as the chat template expects it: a role and one text string."""
        role = "system" if self.role == "developer" else self.role
        if self.content is None or isinstance(self.content, str):
            return {"role": role, "content": self.content or ""}
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise SamplingParamsError(
                    f"content part type {part.type!r} is not supported; only text parts are",
                    "messages",
                )
            texts.append(part.text)
        return {"role": role, "content": "\n".join(texts)}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    logprobs: bool | None = False
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    response_format: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool | None = True

    def check(self) -> None:
        super().check()
        if self.tools:
            raise SamplingParamsError("tools are not supported by this server yet", "tools")
        if self.tool_choice not in (None, "none"):
            raise SamplingParamsError(
                "tool_choice is not supported by this server yet", "tool_choice"
            )
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise SamplingParamsError(
                f"response_format type {kind!r} is not supported yet; only 'text' is",
                "response_format",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise SamplingParamsError("top_logprobs requires logprobs to be true", "top_logprobs")

    def to_sampling_params(self) -> SamplingParams:
        """Engine parameters; max_completion_tokens wins over the deprecated max_tokens."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        return SamplingParams(
            **self._sampling_kwargs(),
            max_tokens=max_tokens,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
        )


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIModel):
    content: list[ChatLogprobToken] | None = None


class ChatMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# -- models, tokenizer -------------------------------------------------------------------------


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "convoy"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIModel):
    """vLLM's shape: either `prompt` (completions) or `messages` (chat template applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    return_token_strs: bool = False


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str
