"""POST /v1/embeddings: inputs -> prefill-only engine requests -> pooled, normalised vectors.

Every input is its own engine request in the same steps as generation (the one model, the one
KV pool and prefix cache): computed once, no logits, its final hidden states pooled as the
engine's `pooling` setting says (EngineCore.pooling) and L2-normalised. `dimensions` keeps the
first values and normalises again; `base64` sends the float32 values' little-endian bytes.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncGenerator
from contextlib import aclosing

import numpy as np

from convoy.api.engine_client import Prompt
from convoy.api.errors import APIError
from convoy.api.protocol_embeddings import (
    MAX_EMBEDDING_INPUTS,
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from convoy.api.serving_base import Job, Outputs, ServingBase
from convoy.api.serving_completion import encode_prompts
from convoy.engine.pooling import normalize
from convoy.sampling_params import SamplingParams

_Job = Job[EmbeddingRequest]


class EmbeddingServing(ServingBase[EmbeddingRequest, EmbeddingResponse, EmbeddingResponse]):
    id_prefix = "embd"
    prompt_param = "input"
    chunk_type = EmbeddingResponse  # never streamed

    @property
    def dimensions(self) -> int:
        """The model's hidden size: the length of a full embedding."""
        return self.client.engine.hidden_size

    def sampling_params(self, request: EmbeddingRequest) -> SamplingParams:
        return request.to_sampling_params(self.client.engine.pooling)

    def prompts(self, request: EmbeddingRequest) -> list[Prompt]:
        if request.dimensions is not None and request.dimensions > self.dimensions:
            raise APIError(
                400,
                f"dimensions must be at most {self.dimensions}, this model's embedding size",
                param="dimensions",
            )
        return encode_prompts(self.client, request.input, "input", MAX_EMBEDDING_INPUTS,
                              request.truncate_prompt_tokens)  # fmt: skip

    async def collect(self, job: _Job, outputs: Outputs) -> EmbeddingResponse:
        vectors: dict[int, np.ndarray] = {}
        async with aclosing(outputs):
            async for i, out in outputs:
                if out.finished and out.embedding is not None:
                    vectors[i] = out.embedding
        request = job.request
        data = [
            Embedding(index=i, embedding=_encode(vectors[i], request))
            for i in range(len(job.prompts))
        ]
        self.usage(job, 0)
        tokens = job.record.num_prompt_tokens
        return EmbeddingResponse(
            data=data,
            model=self.client.served_model_name,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )

    def stream(self, job: _Job, outputs: Outputs) -> AsyncGenerator[EmbeddingResponse, None]:
        raise AssertionError("embeddings are never streamed")


def _encode(vector: np.ndarray, request: EmbeddingRequest) -> list[float] | str:
    """One embedding as the request wants it: shortened and normalised again, float or base64."""
    if request.dimensions is not None and request.dimensions < len(vector):
        vector = normalize(vector[: request.dimensions]).astype(np.float32)
    if request.encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    values: list[float] = vector.tolist()
    return values
