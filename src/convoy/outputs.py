"""What generation returns: RequestOutput (one prompt) holding CompletionOutputs (its n choices)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

# One position's logprobs: token id -> logprob, the top-k in descending order, then the sampled
# (or prompt) token if it is not among them.
PositionLogprobs = dict[int, float]


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # client went away / aborted

    def __str__(self) -> str:
        return self.value


@dataclass(slots=True)
class CompletionOutput:
    index: int  # choice index within its prompt, 0..n-1
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None  # per generated token, when asked
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # Per prompt token (the first is None: nothing predicts it), when prompt_logprobs was asked.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Tokens generated for this prompt by every sequence, best_of candidates not returned too
    # (what usage.completion_tokens bills).
    num_generated_tokens: int = 0
    # Predicted outputs (SamplingParams.prediction), summed over the prompt's sequences: output
    # tokens the prediction foretold, and draft tokens taken from it that were rejected
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first_token, finished times
    # An embedding request's (SamplingParams.pooling) L2-normalised vector, once finished
    embedding: npt.NDArray[np.float32] | None = None
