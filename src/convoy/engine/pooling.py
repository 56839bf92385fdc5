"""Embeddings from a prompt's final hidden states: pooled chunk by chunk, normalised at the end.

A prompt may be computed in several chunks (chunked prefill) and, with last-token pooling, its
prefix may come from the prefix cache; the worker reduces each chunk's rows (`ScheduledSeq.pooling`)
and the scheduler folds them in here. Mean pooling never takes cached blocks (their hidden states
are gone: `Request.computes_whole_prompt`), so it always sums every prompt position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from convoy.outputs import FinishReason
from convoy.sampling_params import Pooling

if TYPE_CHECKING:
    from convoy.engine.request import Request

Vector = npt.NDArray[np.float64]


def fold(pooled: Vector | None, chunk: Vector, pooling: Pooling) -> Vector:
    """The pooled state after one more chunk: `chunk` is its rows' sum (mean) or its last row."""
    if pooling is Pooling.MEAN and pooled is not None:
        return pooled + chunk
    return chunk


def finish(pooled: Vector, num_prompt_tokens: int, pooling: Pooling) -> npt.NDArray[np.float32]:
    """The embedding: the pooled vector (a mean for mean pooling), L2-normalised, as fp32."""
    vec = pooled / num_prompt_tokens if pooling is Pooling.MEAN else pooled
    return normalize(vec).astype(np.float32)


def normalize(vec: npt.NDArray[np.floating]) -> Vector:
    """`vec` / its L2 norm in fp64 (a zero vector stays zero)."""
    v = np.asarray(vec, dtype=np.float64)
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else v


def take_chunk(req: Request, chunk: Vector | None, now: float) -> bool:
    """Fold an embedding request's chunk (None: this step pooled nothing of it) in; once its
    prompt is computed, set its embedding and finish reason (stop) and return True."""
    kind = req.params.pooling
    assert kind is not None
    if chunk is not None:
        req.pooled = fold(req.pooled, chunk, kind)
    if req.num_computed_tokens < req.num_prompt_tokens:
        return False
    assert req.pooled is not None, "the last chunk of an embedding request pools"
    req.embedding = finish(req.pooled, req.num_prompt_tokens, kind)
    req.first_token_time = now
    req.finish_reason = FinishReason.STOP
    return True
