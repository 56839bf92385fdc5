"""/v1/completions wire types: the request (SamplingRequest's fields and the prompt), its
choices with their logprobs, the response and its stream chunks. Shared rules: protocol_common.py.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from convoy.api.protocol_base import OpenAIModel
from convoy.api.protocol_common import MAX_INT32, MAX_N, PromptInput, SamplingRequest, UsageInfo
from convoy.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError

# -- /v1/completions ---------------------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(default=16, ge=0, le=MAX_INT32)
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
