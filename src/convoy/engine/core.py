"""EngineCore: the synchronous engine over sequences. `step()` is schedule -> execute -> update.

It knows nothing of prompts with several samples (the front end's ParentRequest), of threads or
of HTTP: add a sequence, abort sequences, step. A step that fails raises EngineStepError naming
the prompts it ran; the caller ends those (their sequences are left for it to abort).

Side steps: a server that can tell when new requests arrive (`SideSteps`, the AsyncEngine) lets
a newcomer that finds a long step in flight run its prompt in a step of its own between two of
that step's layers (`--side-step-ms`), so its first token does not wait for hundreds of rows it
has no part in. The step in flight is untouched: its sequences keep their blocks and tensors, the
side step's sequences are new ones in free slots and free blocks (`Scheduler.schedule_side`),
and each row computes what it would in any step (batch invariance).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from convoy.config import EngineConfig
from convoy.engine.block_manager import BlockManager
from convoy.engine.errors import EngineStepError
from convoy.engine.faults import FaultInjector
from convoy.engine.output_processor import OutputProcessor, SeqDelta
from convoy.engine.request import Request
from convoy.engine.scheduler import Scheduler, SchedulerOutput
from convoy.engine.stats import EngineStats
from convoy.engine.tokenizer import Tokenizer
from convoy.outputs import FinishReason
from convoy.sampling_params import Pooling
from convoy.structured.compiler import GrammarCompiler
from convoy.structured.matcher import GrammarMatcher, fill_bitmasks
from convoy.worker.batch import SamplerRow
from convoy.worker.worker import Worker

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SideSteps:
    """What a server gives the core for side steps (module docstring)."""

    # are interactive requests waiting to be added? Called between layers: must be cheap
    waiting: Callable[[], bool]
    # add them and run `side_step` through the frontend, reporting its failures to their
    # clients; must not raise (the step in flight would fail with it)
    run: Callable[[], None]


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.model_name: str = self.worker.model_name
        model_cfg = self.worker.model_config
        family = self.worker.model_family
        self.tokenizer = Tokenizer(self.worker.model_dir, family.default_chat_template)
        self.vocab_size = model_cfg.vocab_size  # the embedding's rows bound every token id
        block_size = config.cache.block_size
        self.block_manager = BlockManager(
            self.worker.num_blocks, block_size, config.cache.enable_prefix_caching
        )
        # NOTE: one sequence must always fit in the pool, or preempting it could never help.
        self.max_model_len = min(
            config.scheduler.max_model_len or model_cfg.max_position_embeddings,
            model_cfg.max_position_embeddings,
            self.worker.num_blocks * block_size,
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.scheduler.rope_switch_len = model_cfg.rope_switch_len()
        self.eos_token_ids = self._eos_ids(family.extra_stop_tokens)
        # Structured outputs: compiled in callers' threads, matched here (`_constrain`).
        self.grammars = GrammarCompiler(
            self.tokenizer.hf_tokenizer, self.vocab_size, self.eos_token_ids
        )
        self.output = OutputProcessor(self.tokenizer)
        # /v1/embeddings: the server's choice, else the model's own (an embedding GGUF's), else last
        self.pooling = Pooling(
            config.pooling if config.pooling != "auto" else model_cfg.pooling_type or "last"
        )
        self._faults = FaultInjector.from_env()  # None unless a test asks for faults
        self.side_steps: SideSteps | None = None  # the server sets it (module docstring)
        self.side_step_s = config.scheduler.side_step_ms / 1e3
        self.num_side_steps = 0
        self._step_start = 0.0
        self._side_seconds: float | None = None  # this step's side step took; None: none yet
        # NOTE: other threads (the server's /metrics) read this snapshot, refreshed on the engine
        # thread after each step and abort, and never the scheduler's live dicts.
        self.last_stats = self.stats()

    def add_request(self, req: Request) -> None:
        self.output.add(req)
        self.scheduler.add_request(req)

    def abort_requests(self, req_ids: Iterable[str]) -> list[SeqDelta]:
        """Finish sequences with `abort` now; returns their last deltas."""
        req_ids = list(req_ids)
        aborted = self.scheduler.finish_requests(req_ids, FinishReason.ABORT)
        deltas = [self.output.delta(req) for req in aborted]
        for req_id in req_ids:  # finished inside a failed step: their text state is left over
            self.output.states.pop(req_id, None)
        self.last_stats = self.stats()
        return deltas

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[SeqDelta]:
        """Run one step; returns what every sequence that sampled (or finished) gained in it."""
        sched = self.scheduler.schedule()
        with self._failing(sched):
            if self._faults is not None:
                self._faults.check()
            self._constrain(sched)
            hook = None
            if self.side_steps is not None and self.side_step_s > 0:
                hook = self._between_layers
            self._side_seconds = None
            start = self._step_start = time.perf_counter()
            runner_out = self.worker.execute(sched.seqs, hook)
            # what a step costs by rows (step sizes, drafts): decode rows and verifications
            # only, not prefills, nor a side step run inside it
            if all(seq.draft or len(seq.token_ids) == 1 for seq in sched.seqs):
                seconds = time.perf_counter() - start - (self._side_seconds or 0.0)
                rows = sum(len(seq.token_ids) for seq in sched.seqs)
                self.scheduler.step_costs.record(rows, seconds)
                tokens = sum(map(len, runner_out.sampled_token_ids.values()))
                drafted = rows > len(sched.seqs)
                self.scheduler.drafts.draft_gate.record(len(sched.seqs), drafted, tokens, seconds)
            deltas = self._process_outputs(self.scheduler.update_from_output(sched, runner_out))
        self.last_stats = self.stats()
        return deltas

    @contextlib.contextmanager
    def _failing(self, sched: SchedulerOutput) -> Iterator[None]:
        """A step's failure as EngineStepError naming the prompts it ran."""
        try:
            yield
        except Exception as e:
            failed = frozenset(req.parent_id or req.req_id for req, _ in sched.scheduled)
            raise EngineStepError("the engine failed while running this request", failed) from e

    def _between_layers(self, done: int, total: int) -> None:
        """Inside a step's forward: run a side step now if interactive newcomers wait and what
        is left of this step, extrapolated from its layers so far, is at least --side-step-ms.
        One side step a step at most, so a step in flight is delayed by one at most."""
        side = self.side_steps
        if self._side_seconds is not None or side is None or not side.waiting():
            return
        elapsed = time.perf_counter() - self._step_start
        if elapsed * (total - done) / done < self.side_step_s:
            return
        start = time.perf_counter()
        side.run()
        self._side_seconds = time.perf_counter() - start

    def side_step(self) -> list[SeqDelta]:
        """A side step (module docstring): the waiting interactive prompts that fit, run by
        themselves; returns their deltas. Called from `_between_layers` only, via the server."""
        sched = self.scheduler.schedule_side()
        if not sched.scheduled:
            return []
        self.num_side_steps += 1
        with self._failing(sched):
            if self._faults is not None:
                self._faults.check(side=True)
            self._constrain(sched)
            runner_out = self.worker.execute(sched.seqs)
            deltas = self._process_outputs(self.scheduler.update_from_output(sched, runner_out))
        self.last_stats = self.stats()
        return deltas

    def _constrain(self, sched: SchedulerOutput) -> None:
        """Fill the allowed-token bitmask of every constrained sequence that samples this step
        (one array, a row each). A matcher that failed gets no mask: its sequence ends with its
        error once the step is done, whatever it samples."""
        rows = [
            (req.grammar, seq)
            for (req, _), seq in zip(sched.scheduled, sched.seqs, strict=True)
            if req.grammar is not None and seq.sampling is not None
        ]
        if not rows:
            return
        bitmask = fill_bitmasks([grammar for grammar, _ in rows], self.grammars.num_words)
        for (grammar, seq), mask in zip(rows, bitmask, strict=True):
            assert seq.sampling is not None
            seq.sampling.bitmask = None if grammar.is_failed else mask
            if seq.draft and not grammar.is_failed:
                self._constrain_draft(grammar, seq.draft, seq.draft_rows)

    def _constrain_draft(
        self, grammar: GrammarMatcher, draft: list[int], rows: list[SamplerRow]
    ) -> None:
        """The mask of each draft position: the grammar's state after the draft tokens before
        it (the scheduler kept only tokens the grammar allows), from a copy of the matcher: the
        kept tokens are accepted for real once the step is verified."""
        masks = np.zeros((len(rows), self.grammars.num_words), dtype=np.int32)
        grammar.draft_masks(draft, masks)
        for row, mask in zip(rows, masks, strict=True):
            row.bitmask = mask

    def _process_outputs(self, reqs: list[Request]) -> list[SeqDelta]:
        deltas = self.output.process(reqs)  # detokenize; a stop string finishes a sequence
        stopped = (d.req.req_id for d in deltas if d.finished)
        self.scheduler.finish_requests(stopped, FinishReason.STOP)  # frees those still held
        return deltas

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_kv_blocks_used=self.block_manager.num_used_blocks,
            num_kv_blocks_total=self.block_manager.num_blocks,
            num_prompt_tokens=s.num_prompt_tokens,
            num_generation_tokens=s.num_generation_tokens,
            num_preemptions=s.num_preemptions,
            num_prefix_cache_hit_tokens=self.block_manager.num_hit_tokens,
            num_draft_tokens=s.drafts.num_draft_tokens,
            num_accepted_draft_tokens=s.drafts.num_accepted_draft_tokens,
            num_side_steps=self.num_side_steps,
        )

    def _eos_ids(self, extra_stop_tokens: tuple[str, ...]) -> frozenset[int]:
        """The model's EOS ids, the tokenizer's, and the family's turn-end tokens."""
        ids = set(self.worker.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        for text in extra_stop_tokens:
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(token_ids) == 1:
                ids.add(token_ids[0])
        return frozenset(ids)
