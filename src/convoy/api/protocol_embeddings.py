"""/v1/embeddings wire types, as the official `openai` client's CreateEmbeddingResponse defines
them. `input` takes the four prompt forms of /v1/completions (a string, strings, token ids, lists
of token ids), at most MAX_EMBEDDING_INPUTS of them (OpenAI's bound)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from convoy.api.protocol_base import OpenAIModel, RequestModel
from convoy.api.protocol_common import (
    MAX_INT32,
    PromptInput,
    TruncatePromptTokens,
    check_truncation,
)
from convoy.sampling_params import Pooling, SamplingParams

MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    # keep the first `dimensions` values and normalise again (as OpenAI's v3 models shorten)
    dimensions: int | None = Field(default=None, ge=1, le=MAX_INT32)
    user: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # vLLM's: keep the last k tokens

    stream: ClassVar[bool] = (
        False  # what ServingBase asks of every request: embeddings are never streamed
    )

    def check(self) -> None:
        """`dimensions` is checked against the model (EmbeddingServing)."""
        check_truncation(self.truncate_prompt_tokens)

    def to_sampling_params(self, pooling: Pooling = Pooling.LAST) -> SamplingParams:
        """The prompt computed once, nothing generated, its hidden states pooled."""
        return SamplingParams(max_tokens=0, pooling=pooling)


class Embedding(OpenAIModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 values' little-endian bytes


class EmbeddingUsage(OpenAIModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
