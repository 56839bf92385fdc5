"""One sequence in the engine (its tokens, how many are in the KV cache, its blocks and status),
and the validated prompt it comes from."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from convoy.engine.speculation import Drafter
from convoy.outputs import FinishReason, PositionLogprobs
from convoy.sampling_params import Pooling, SamplingParams
from convoy.structured.compiler import CompiledGrammar
from convoy.structured.matcher import GrammarMatcher
from convoy.structured.params import StructuredOutputsError


class Priority(enum.IntEnum):
    """Scheduling class: interactive requests go first; Batch API lines use what they leave."""

    INTERACTIVE = 0
    BATCH = 1


@dataclass(slots=True, frozen=True)
class EngineRequest:
    """One prompt that passed the front door's checks (`InputProcessor.process`), ready to run."""

    request_id: str
    prompt: str | None  # the text, when the prompt was given as text
    prompt_token_ids: list[int]
    params: SamplingParams
    group_id: str  # the API request it belongs to (fair scheduling); its own id when alone
    arrival: float
    priority: Priority = Priority.INTERACTIVE
    grammar: CompiledGrammar | None = None  # params.structured_outputs, compiled

    def new_matcher(self) -> GrammarMatcher | None:
        """A matcher for one of this prompt's sequences (each n / best_of child its own)."""
        spec = self.params.structured_outputs
        if self.grammar is None or spec is None:
            return None
        return self.grammar.matcher(spec.param)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    group_id: str  # the API request this sequence belongs to (fair scheduling)
    arrival: float
    parent_id: str = ""  # the prompt this sequence samples for (n / best_of children share it)
    index: int = 0  # which of the prompt's params.num_seqs sequences this is
    seed: int | None = None  # per-sequence sampling seed (a child of a seeded request gets its own)
    eos_token_ids: frozenset[int] = frozenset()  # end the sequence unless params.ignore_eos
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    # NOTE: invariant num_computed_tokens <= len(token_ids); the scheduler closes the gap each step.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first schedule
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # digests of the full prompt blocks
    status: RequestStatus = RequestStatus.WAITING
    last_step: int = -1  # the scheduler's step that last ran it (capped steps take turns)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    first_token_time: float | None = None
    priority: Priority = Priority.INTERACTIVE
    grammar: GrammarMatcher | None = None  # constrained: advanced with every output token
    error: StructuredOutputsError | None = None  # why the engine ended it (finish reason abort)
    # Embeddings (params.pooling): the pooled final hidden states so far (fp64; a sum for mean
    # pooling), then, once the prompt is computed, the L2-normalised embedding (fp32)
    pooled: npt.NDArray[np.float64] | None = None
    embedding: npt.NDArray[np.float32] | None = None
    # Speculative decoding: the draft tokens scheduled after the last sampled one this step,
    # where drafts come from (created at the first chance to draft), and how many tokens the
    # last step appended (one, or more when a draft was kept)
    draft: list[int] = field(default_factory=list)
    drafter: Drafter | None = None
    num_step_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Does this sequence score its prompt? Only child 0 of an n / best_of fan-out: the
        others reuse its prompt KV through the prefix cache instead of scoring it again."""
        return self.params.prompt_logprobs is not None and self.index == 0

    @property
    def computes_whole_prompt(self) -> bool:
        """Must every prompt position run through the model (no prefix-cache hits)? When it
        scores its prompt, or pools the mean of its hidden states."""
        return self.wants_prompt_logprobs or self.params.pooling is Pooling.MEAN
