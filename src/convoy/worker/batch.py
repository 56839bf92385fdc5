"""What crosses the engine/worker boundary in one step: plain data, no torch, no engine objects.

scheduler --list[ScheduledSeq]--> Worker.execute --ModelRunnerOutput--> scheduler.update_from_output
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from convoy.outputs import PositionLogprobs
from convoy.sampling_params import Pooling, SamplingParams


@dataclass(slots=True)
class SamplerRow:
    """How the sequence's next token is sampled."""

    params: SamplingParams
    seed: int | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids: list[int]  # EOS and stop token ids: masked while below min_tokens
    need_logprob: bool  # sampled-token logprob needed (logprobs asked, or best_of ranking)
    # Constrained sequences: the tokens allowed next, one bit each (int32 words, llguidance's
    # layout: bit t % 32 of word t // 32); filled by the engine before the step runs.
    bitmask: npt.NDArray[np.int32] | None = None


@dataclass(slots=True)
class PromptScoring:
    """Prompt logprobs wanted from one scheduled sequence this step."""

    first: int  # position of the first prompt token to score
    targets: list[int]  # the prompt tokens to score, from `first` on
    k: int


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence of a step, as the worker sees it."""

    req_id: str
    token_ids: list[int]  # the new tokens to compute this step
    start_pos: int  # tokens of this sequence already in the cache
    block_table: list[int]
    sampling: SamplerRow | None = None  # set when the last new token samples
    scoring: PromptScoring | None = None  # set when this chunk scores prompt tokens
    prompt_len: int = 0  # the request's prompt tokens; 0: unknown, taken as start_pos + new
    # Embeddings: reduce the new tokens' final hidden states (mean: their sum; last: the last
    # row) into ModelRunnerOutput.pooled; such a sequence never samples
    pooling: Pooling | None = None
    # Speculative decoding: the last len(draft) of token_ids are draft tokens to verify; the
    # sampling rows of the positions after each of them (`sampling` is the one before the first)
    draft: list[int] = field(default_factory=list)
    draft_rows: list[SamplerRow] = field(default_factory=list)

    @property
    def need_logits(self) -> bool:
        return self.sampling is not None

    @property
    def prompt_logits_from(self) -> int | None:
        """Index among the new tokens of the first position whose logits score the prompt."""
        return None if self.scoring is None else self.scoring.first - 1 - self.start_pos


@dataclass(slots=True)
class ModelRunnerOutput:
    """One step's results, keyed by request id."""

    # Per sequence that sampled, its tokens this step, in order: one, or after a verified draft
    # the draft tokens kept and the sample after them; their logprobs alike
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    sampled_logprobs: dict[str, list[float | None]] = field(default_factory=dict)  # need_logprob
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)  # params.logprobs
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # where ScheduledSeq.pooling: the chunk's pooled final hidden states (fp64)
    pooled: dict[str, npt.NDArray[np.float64]] = field(default_factory=dict)
