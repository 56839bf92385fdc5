"""Scheduler: which sequences run in the next step, and how many of their tokens. No torch here.

There is no prefill or decode phase. Each step, every scheduled sequence computes
`num_tokens - num_computed_tokens` of its tokens (capped by the step's token budget): a whole
prompt, a chunk of one, or the one token sampled last step. Running sequences go first (oldest
first); when blocks run out the newest running sequence is preempted (its blocks freed, recomputed
later). Waiting sequences are admitted group by group (a group is one API request), the group with
the fewest running sequences first, so a small request is not stuck behind a 1,000-prompt one;
when the sequence cap is reached, a group holding at least two more sequences than the newcomer's
gives one up (see SeqQueues: waiting sequences are an ordered dict per group, so aborts are O(1)).

Two priority classes, each with its own queues: interactive requests, then Batch API lines. Each
step schedules interactive running sequences, admits interactive newcomers, and only then
schedules batch sequences with what is left. While interactive work waits or runs, and for
`batch_grace` seconds after, batch sequences keep at most `batch_share` of their sequence cap,
with one prompt token per kept slot: the running ones past that share are paused (kept with
their blocks, not scheduled). Victims (blocks or sequence slots) are batch sequences first,
newest first; an interactive sequence is never preempted for a batch one. With no batch
traffic the batch queues stay empty and cost nothing.

The contract is vLLM v1's: add_request, schedule() -> SchedulerOutput, update_from_output
(sched_out, runner_out) after the worker ran it, finish_requests(ids, reason) (stop strings, aborts).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter

from convoy.config import SchedulerConfig
from convoy.engine import pooling
from convoy.engine.block_manager import BlockManager, hash_prompt_blocks
from convoy.engine.draft_planner import DraftPlanner
from convoy.engine.request import Priority, Request, RequestStatus
from convoy.engine.seq_queues import SeqQueues
from convoy.engine.step_costs import StepSizer
from convoy.engine.step_inputs import scheduled_seq
from convoy.engine.token_append import append_tokens
from convoy.outputs import FinishReason
from convoy.worker.batch import ModelRunnerOutput, ScheduledSeq


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Request] = field(default_factory=list)
    seqs: list[ScheduledSeq] = field(default_factory=list)  # what the worker runs, in order


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        # What batch sequences may use of a step: always at most max_batch_seqs (the step an
        # interactive request may find in flight stays short), and while interactive work waits
        # or runs, their share of that and of the token budget.
        self.max_batch_seqs = min(config.max_num_seqs, config.batch_max_seqs)
        self.max_shared_batch_seqs = max(1, int(config.batch_share * self.max_batch_seqs))
        # Alone, batch steps carry every running line's decode plus prompt chunks of up to a
        # share of the token budget (throughput); shared, one prompt token per shared slot at
        # most, so the step an interactive request finds in flight stays short.
        self.max_batch_tokens = self.max_batch_seqs + max(
            1, int(config.batch_share * config.max_num_batched_tokens)
        )
        self.max_shared_batch_tokens = 2 * self.max_shared_batch_seqs
        self.batch_grace = config.batch_grace
        self.clock = time.monotonic  # tests replace it
        self._interactive_seen = -math.inf  # when interactive work was last present
        self.max_model_len = max_model_len
        self.bm = block_manager
        # Prompts longer than this compute all their K/V otherwise (LongRoPE's long factors):
        # their prompt blocks are hashed apart (ModelConfig.rope_switch_len; EngineCore sets it)
        self.rope_switch_len: int | None = None
        self.requests: dict[str, Request] = {}  # every sequence not yet finished
        self.interactive = SeqQueues()
        self.batch = SeqQueues()
        self._queues = (self.interactive, self.batch)  # indexed by Priority
        # How large a step is: measured step costs (EngineCore records them) against
        # --step-target-ms. The same costs price draft rows: drafts go to decoding sequences
        # after everything else is scheduled, into the token budget and free blocks left over
        self.sizer = StepSizer(config.step_target_ms / 1e3)
        self.step_costs = self.sizer.costs
        self.drafts = DraftPlanner(config, block_manager, self.step_costs)
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # totals since start (one prompt counted once, not per child)
        self.num_generation_tokens = 0
        self.num_computed_tokens = 0  # tokens run through the model (prompts, chunks, decodes)

    @property
    def running(self) -> list[Request]:
        """Every running sequence (paused batch ones too), interactive first; a new list."""
        return self.interactive.running + self.batch.running

    @property
    def num_running(self) -> int:
        return len(self.interactive.running) + len(self.batch.running)

    @property
    def num_waiting(self) -> int:
        return self.interactive.num_waiting + self.batch.num_waiting

    def has_work(self) -> bool:
        fg, bg = self.interactive, self.batch
        return bool(fg.running or fg.waiting or bg.running or bg.waiting)

    def add_request(self, req: Request) -> None:
        req.block_hashes = self._hashes(req)
        self.requests[req.req_id] = req
        self._queues[req.priority].enqueue(req)
        if req.index == 0:
            self.num_prompt_tokens += req.num_prompt_tokens

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        fg = self.interactive
        # Batch sequences keep only their share while interactive work is present, and for
        # batch_grace seconds after (the next request of a conversation comes soon).
        now = self.clock()
        if fg.running or fg.waiting:
            self._interactive_seen = now
        is_shared = now - self._interactive_seen < self.batch_grace or bool(
            fg.running or fg.waiting
        )
        self.num_steps += 1
        cap = self.sizer.cap(self.num_running)  # decode rows, when a step of all is too long
        budget = self.max_num_batched_tokens
        lane = self.sizer.lane(self.num_steps, self.num_running, bool(fg.waiting))
        if lane:  # newcomers beside a long step: their prompts in a step of their own
            budget = self._schedule_prompts(out, budget, decode_rows=0)
            lane = bool(out.scheduled)  # none could be admitted: an ordinary step instead
        if lane:
            self.sizer.last_lane = self.num_steps
        elif cap is None:
            budget = self._schedule_running(out, fg.running, budget)
            budget = self._admit_interactive(out, budget)
        else:
            budget = self._schedule_prompts(out, budget, decode_rows=cap)
        if (self.batch.running or self.batch.waiting) and not lane:
            self._schedule_batch(out, budget, is_shared, rotate=cap is not None)
        room = self.max_num_batched_tokens - sum(num_new for _, num_new in out.scheduled)
        if cap is not None:  # a cut step's drafts fit in its decode rows' cap
            room = min(room, cap - sum(num_new == 1 for _, num_new in out.scheduled))
        self.drafts.add_drafts(out.scheduled, room, self.max_model_len)
        out.seqs = [scheduled_seq(req, num_new) for req, num_new in out.scheduled]
        return out

    def schedule_side(self) -> SchedulerOutput:
        """A side step: interactive newcomers' whole prompts (at most the step's token budget),
        to run between two layers of a step in flight (EngineCore.step). Nothing of that step
        may change, so nothing is preempted, paused or drafted: a newcomer is admitted only
        into free sequence slots and free blocks, only if its whole prompt fits (it samples
        its first token in the side step), and never onto a prompt block still pending."""
        out = SchedulerOutput()
        if self.interactive.waiting:
            self._schedule_waiting(
                out, self.interactive, self.max_num_batched_tokens, self.max_num_seqs, side=True
            )
        out.seqs = [scheduled_seq(req, num_new) for req, num_new in out.scheduled]
        return out

    def update_from_output(
        self, sched: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[Request]:
        """Fold a step's results in; returns the sequences that sampled (or finished scoring)."""
        now = time.monotonic()
        updated: list[Request] = []
        for req, num_new in sched.scheduled:
            scored = runner_out.prompt_logprobs.get(req.req_id)
            if scored is not None:
                if not req.prompt_logprobs:
                    req.prompt_logprobs.append(None)  # nothing predicts the first prompt token
                req.prompt_logprobs.extend(scored)
            token_ids = runner_out.sampled_token_ids.get(req.req_id)
            draft, req.draft = req.draft, []
            # a verified draft: its kept tokens' K/V are valid, the rest is overwritten later
            kept = len(token_ids) - 1 if draft and token_ids else 0
            req.num_computed_tokens += num_new - len(draft) + kept
            self.num_computed_tokens += num_new - len(draft) + kept
            self.bm.cache_computed(req)
            if req.params.pooling is not None:
                if pooling.take_chunk(req, runner_out.pooled.get(req.req_id), now):
                    self._free(req)  # its embedding is done (finish reason stop)
                    updated.append(req)
                continue
            if token_ids is None:
                continue  # a prefill chunk that does not reach the end of the prompt
            if req.first_token_time is None:
                req.first_token_time = now
            if draft:
                self.drafts.verified(req, len(draft), kept)
            if req.params.max_tokens == 0:  # scoring only: the prompt is computed, nothing sampled
                req.finish_reason = FinishReason.LENGTH
            else:
                self.num_generation_tokens += append_tokens(
                    req, token_ids, runner_out, self.max_model_len
                )
                if req.drafter is not None and req.drafter.prediction is not None:
                    req.drafter.sync(req.token_ids)  # (usage counts the prediction's matches;
                    # a lookup index catches up when it next drafts)
            if req.finish_reason is not None:
                self._free(req)
            elif draft:
                self.bm.trim(req, req.num_tokens)  # blocks that held only rejected draft K/V
            updated.append(req)
        self._prune_running()
        return updated

    def finish_requests(self, req_ids: Iterable[str], reason: FinishReason) -> list[Request]:
        """End sequences (a stop string, an abort): leave the queues, free their blocks.

        A sequence that already has a finish reason keeps it. Returns the sequences that were
        still in the scheduler.
        """
        finished = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.finish_reason is None:
                req.finish_reason = reason
            self._free(req)
            finished.append(req)
        self._prune_running()
        return finished

    def _free(self, req: Request) -> None:
        """Remove a sequence (finished or aborted) from the queues and free its blocks.

        NOTE: a running sequence stays in its `running` list until `_prune_running`, so ending
        many at once rebuilds the list once instead of searching it per sequence.
        """
        self.requests.pop(req.req_id, None)
        q = self._queues[req.priority]
        if req.status == RequestStatus.RUNNING:
            q.num_finished_running += 1
            q.count(req.group_id, -1)
        elif req.status == RequestStatus.WAITING:
            q.dequeue(req)
        self.bm.free(req)
        req.status = RequestStatus.FINISHED

    def _prune_running(self) -> None:
        self.interactive.prune()
        self.batch.prune()

    def _schedule_batch(
        self, out: SchedulerOutput, budget: int, is_shared: bool, rotate: bool
    ) -> None:
        """Batch sequences get what interactive ones left; while interactive work is present, at
        most their share of sequences and tokens (the running ones past it are paused: they
        keep their blocks and are simply not scheduled)."""
        bg = self.batch
        limit = self.max_batch_seqs
        batch_budget = min(budget, self.max_batch_tokens)
        if is_shared:
            limit = self.max_shared_batch_seqs
            batch_budget = min(budget, self.max_shared_batch_tokens)
        num_before = len(out.scheduled)
        batch_budget = self._schedule_running(out, bg.running, batch_budget, limit, rotate)
        num_scheduled = len(out.scheduled) - num_before
        if bg.waiting and not out.preempted and num_scheduled < limit:
            self._schedule_waiting(out, bg, batch_budget, limit - num_scheduled)

    def _schedule_running(
        self,
        out: SchedulerOutput,
        running: list[Request],
        budget: int,
        limit: int | None = None,
        rotate: bool = False,
    ) -> int:
        """Schedule the oldest `limit` of `running` (all by default) while tokens are left, or
        with `rotate` (a capped step: not all of them fit) the ones that waited longest since
        they last ran; returns the tokens left."""
        limit = len(running) if limit is None else limit
        order = sorted(running, key=attrgetter("last_step")) if rotate else running
        i = n = 0
        while i < len(order) and n < limit and budget > 0:
            req = order[i]
            i += 1
            if req.status != RequestStatus.RUNNING:
                continue  # preempted this step (a rotated order is a copy)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.bm.allocate(req, num_new):
                victim = self._victim()
                self._preempt(victim, out)
                if victim is req:
                    return budget
            out.scheduled.append((req, num_new))
            req.last_step = self.num_steps
            budget -= num_new
            n += 1
        return budget

    def _admit_interactive(self, out: SchedulerOutput, budget: int) -> int:
        if self.interactive.waiting and not any(
            r.priority == Priority.INTERACTIVE for r in out.preempted
        ):
            budget = self._schedule_waiting(out, self.interactive, budget, self.max_num_seqs)
        return budget

    def _schedule_prompts(self, out: SchedulerOutput, budget: int, decode_rows: int) -> int:
        """Prompt work first (the chunks of prompts under way, then newcomers, in the whole
        token budget but `decode_rows` tokens), so a first token comes soon; then at most
        `decode_rows` decode rows (a cut step, `StepSizer.cap`; none in a fast-lane step,
        `StepSizer.lane`), which take turns: those that ran longest ago first. Returns the
        tokens left."""
        prompts: list[Request] = []
        decodes: list[Request] = []
        for req in self.interactive.running:
            (decodes if req.num_tokens - req.num_computed_tokens == 1 else prompts).append(req)
        kept = min(decode_rows, len(decodes))
        left = self._schedule_running(out, prompts, budget - kept)
        left = self._admit_interactive(out, left)
        if not decode_rows:
            return left
        return self._schedule_running(out, decodes, left + kept, decode_rows, rotate=True)

    def _victim(self) -> Request:
        """Who gives blocks back: the newest batch sequence (paused ones are the newest), else
        the newest interactive one. Batch sequences are scheduled last, so a batch sequence
        short of blocks always finds a batch victim (itself at worst)."""
        return (self.batch.running or self.interactive.running)[-1]

    def _schedule_waiting(
        self, out: SchedulerOutput, q: SeqQueues, budget: int, max_new: int, side: bool = False
    ) -> int:
        """Admit up to `max_new` of q's waiting sequences, fewest-running group first; returns
        the tokens left. `side` (schedule_side): whole prompts only, in free slots and blocks."""
        held_back: set[str] = set()
        while budget > 0 and max_new > 0:
            group = q.next_group(held_back)
            if group is None:
                break
            req = next(iter(q.waiting[group].values()))
            cached = self.bm.get_computed_blocks(req)
            if self.bm.is_prefix_pending(req, len(cached)):
                held_back.add(group)  # reuse that block next step instead of computing it twice
                continue
            at_cap = self.num_running >= self.max_num_seqs
            if at_cap and (side or not self._make_room(q, group, out)):
                break
            num_new = min(req.num_tokens - len(cached) * self.bm.block_size, budget)
            if side and num_new < req.num_tokens - len(cached) * self.bm.block_size:
                held_back.add(group)  # its prompt needs chunks: the ordinary steps'
                continue
            allocated = (
                self.bm.allocate(req, num_new, cached)  # never preempting (a step is in flight)
                if side
                else self._allocate_new(req, num_new, cached, out)
            )
            if not allocated:
                break
            req.num_computed_tokens = len(cached) * self.bm.block_size
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
            q.admit(req)
            out.scheduled.append((req, num_new))
            budget -= num_new
            max_new -= 1
        return budget

    def _allocate_new(
        self, req: Request, num_new: int, cached: list[int], out: SchedulerOutput
    ) -> bool:
        """Blocks for a newcomer; an interactive one takes them from batch sequences if it must
        (a batch newcomer waits)."""
        while not self.bm.allocate(req, num_new, cached):
            if req.priority == Priority.BATCH or not self.batch.running:
                return False
            self._preempt(self.batch.running[-1], out)
        return True

    def _make_room(self, q: SeqQueues, group: str, out: SchedulerOutput) -> bool:
        """At the sequence cap: an interactive newcomer takes the newest batch sequence's slot;
        else one sequence of the class's largest group gives way if that is fair (see
        SeqQueues.fair_share_victim); else the newcomer waits."""
        if q is self.interactive and self.batch.running:
            self._preempt(self.batch.running[-1], out)
            return True
        victim = q.fair_share_victim(group)
        if victim is None:
            return False
        self._preempt(victim, out)
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        for i, (scheduled, _) in enumerate(out.scheduled):
            if scheduled is req:
                del out.scheduled[i]
                break
        q = self._queues[req.priority]
        q.stop_running(req)
        self.bm.free(req)
        req.num_computed_tokens = 0
        req.draft = []
        req.pooled = None  # computed again from the first token
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        q.enqueue(req, front=True)
        out.preempted.append(req)

    def _hashes(self, req: Request) -> list[bytes]:
        if not self.bm.enable_prefix_caching:
            return []
        switch = self.rope_switch_len
        variant = b"long rope" if switch is not None and req.num_prompt_tokens > switch else b""
        return hash_prompt_blocks(
            req.prompt_token_ids, self.bm.block_size, req.params.cache_salt, variant
        )
