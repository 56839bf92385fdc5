"""Scheduler: which sequences run in the next step, and how many of their tokens. No torch here.

There is no prefill or decode phase. Each step, every scheduled sequence computes
`num_tokens - num_computed_tokens` of its tokens (capped by the step's token budget): a whole
prompt, a chunk of one, or the one token sampled last step. Running sequences go first (oldest
first); when blocks run out the newest running sequence is preempted (its blocks freed, recomputed
later). Waiting sequences are admitted group by group (a group is one API request), the group with
the fewest running sequences first, so a small request is not stuck behind a 1,000-prompt one;
when the sequence cap is reached, a group holding at least two more sequences than the newcomer's
gives one up. Each group's waiting sequences are an ordered dict by id, so aborting any of them is
O(1) (a client that drops a 1,024-prompt request must not stall the engine).

The contract is vLLM v1's: add_request, schedule() -> SchedulerOutput, update_from_output
(sched_out, runner_out) after the worker ran it, finish_requests(ids, reason) (stop strings, aborts).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from convoy.config import SchedulerConfig
from convoy.engine.block_manager import BlockManager, hash_prompt_blocks
from convoy.engine.request import Request, RequestStatus
from convoy.outputs import FinishReason
from convoy.worker.batch import ModelRunnerOutput, PromptScoring, SamplerRow, ScheduledSeq


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
        self.max_model_len = max_model_len
        self.bm = block_manager
        self.requests: dict[str, Request] = {}  # every sequence not yet finished
        # group -> its waiting sequences by id, FIFO (preempted ones go back to the front)
        self.waiting: dict[str, OrderedDict[str, Request]] = {}
        self.num_waiting = 0
        self.running: list[Request] = []  # admission order
        self._num_finished_running = 0  # freed but not yet pruned from `running`
        self.num_running_by_group: dict[str, int] = {}
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # totals since start (one prompt counted once, not per child)
        self.num_generation_tokens = 0
        self.num_computed_tokens = 0  # tokens run through the model (prompts, chunks, decodes)

    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def add_request(self, req: Request) -> None:
        req.block_hashes = self._hashes(req)
        self.requests[req.req_id] = req
        self._enqueue(req)
        if req.index == 0:
            self.num_prompt_tokens += req.num_prompt_tokens

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.seqs = [_scheduled_seq(req, num_new) for req, num_new in out.scheduled]
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
            req.num_computed_tokens += num_new
            self.num_computed_tokens += num_new
            self.bm.cache_computed(req)
            token_id = runner_out.sampled_token_ids.get(req.req_id)
            if token_id is None:
                continue  # a prefill chunk that does not reach the end of the prompt
            if req.first_token_time is None:
                req.first_token_time = now
            if req.params.max_tokens == 0:  # scoring only: the prompt is computed, nothing sampled
                req.finish_reason = FinishReason.LENGTH
            else:
                self._append_token(req, token_id, runner_out)
            if req.finish_reason is not None:
                self._free(req)
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

    def _append_token(self, req: Request, token_id: int, runner_out: ModelRunnerOutput) -> None:
        req.token_ids.append(token_id)
        self.num_generation_tokens += 1
        if (lp := runner_out.sampled_logprobs.get(req.req_id)) is not None:
            req.cumulative_logprob += lp
        if (entry := runner_out.logprobs.get(req.req_id)) is not None:
            req.logprobs.append(entry)
        p = req.params
        num_out = req.num_output_tokens
        if num_out >= p.min_tokens:
            if not p.ignore_eos and token_id in req.eos_token_ids:
                req.finish_reason = FinishReason.STOP
            elif token_id in p.stop_token_ids:
                req.finish_reason, req.stop_reason = FinishReason.STOP, token_id
        if req.finish_reason is None and (
            (p.max_tokens is not None and num_out >= p.max_tokens)
            or req.num_tokens >= self.max_model_len
        ):
            req.finish_reason = FinishReason.LENGTH

    def _free(self, req: Request) -> None:
        """Remove a sequence (finished or aborted) from the queues and free its blocks.

        NOTE: a running sequence stays in `self.running` until `_prune_running`, so ending many
        at once rebuilds the list once instead of searching it per sequence.
        """
        self.requests.pop(req.req_id, None)
        if req.status == RequestStatus.RUNNING:
            self._num_finished_running += 1
            self._count(req.group_id, -1)
        elif req.status == RequestStatus.WAITING:
            self._dequeue(req)
        self.bm.free(req)
        req.status = RequestStatus.FINISHED

    def _prune_running(self) -> None:
        if self._num_finished_running:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
            self._num_finished_running = 0

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.bm.allocate(req, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    return budget
            out.scheduled.append((req, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        held_back: set[str] = set()
        while budget > 0:
            group = self._next_group(held_back)
            if group is None:
                return
            req = next(iter(self.waiting[group].values()))
            cached = self.bm.get_computed_blocks(req)
            if self.bm.is_prefix_pending(req, len(cached)):
                held_back.add(group)  # reuse that block next step instead of computing it twice
                continue
            if len(self.running) >= self.max_num_seqs and not self._make_room(group, out):
                return
            num_new = min(req.num_tokens - len(cached) * self.bm.block_size, budget)
            if not self.bm.allocate(req, num_new, cached):
                return
            req.num_computed_tokens = len(cached) * self.bm.block_size
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
            self._dequeue(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._count(group, +1)
            out.scheduled.append((req, num_new))
            budget -= num_new

    def _next_group(self, held_back: set[str]) -> str | None:
        """The waiting group with the fewest running sequences (oldest group on ties)."""
        best, best_count = None, -1
        for group in self.waiting:  # dict order = order the groups arrived
            if group in held_back:
                continue
            count = self.num_running_by_group.get(group, 0)
            if best is None or count < best_count:
                best, best_count = group, count
        return best

    def _make_room(self, group: str, out: SchedulerOutput) -> bool:
        """At the sequence cap: preempt one sequence of the largest group if it holds at least two
        more than `group` (fair share); else the newcomer waits."""
        big = max(
            self.num_running_by_group, key=lambda g: self.num_running_by_group[g], default=None
        )
        mine = self.num_running_by_group.get(group, 0)
        if big is None or big == group or self.num_running_by_group[big] - mine < 2:
            return False
        victim = next(r for r in reversed(self.running) if r.group_id == big)
        self._preempt(victim, out)
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        for i, (scheduled, _) in enumerate(out.scheduled):
            if scheduled is req:
                del out.scheduled[i]
                break
        self.running.remove(req)
        self._count(req.group_id, -1)
        self.bm.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self._enqueue(req, front=True)
        out.preempted.append(req)

    def _enqueue(self, req: Request, front: bool = False) -> None:
        queue = self.waiting.setdefault(req.group_id, OrderedDict())
        queue[req.req_id] = req
        if front:
            queue.move_to_end(req.req_id, last=False)
        self.num_waiting += 1

    def _dequeue(self, req: Request) -> None:
        """Take a waiting sequence out of its group's queue (the head, or any one: an abort)."""
        queue = self.waiting[req.group_id]
        del queue[req.req_id]
        if not queue:
            del self.waiting[req.group_id]
        self.num_waiting -= 1

    def _count(self, group: str, delta: int) -> None:
        n = self.num_running_by_group.get(group, 0) + delta
        if n:
            self.num_running_by_group[group] = n
        else:
            self.num_running_by_group.pop(group, None)

    def _hashes(self, req: Request) -> list[bytes]:
        if not self.bm.enable_prefix_caching:
            return []
        return hash_prompt_blocks(req.prompt_token_ids, self.bm.block_size, req.params.cache_salt)


def _scheduled_seq(req: Request, num_new: int) -> ScheduledSeq:
    """The worker's view of one scheduled sequence."""
    start = req.num_computed_tokens
    seq = ScheduledSeq(req.req_id, req.token_ids[start : start + num_new], start, req.block_table)
    seq.scoring = _scoring(req, start, num_new)
    if start + num_new == req.num_tokens:
        p = req.params
        stop_ids = [] if p.ignore_eos else sorted(req.eos_token_ids)
        seq.sampling = SamplerRow(
            p, req.seed, req.prompt_token_ids, req.output_token_ids, stop_ids + p.stop_token_ids,
            need_logprob=p.num_seqs > p.n,
        )  # fmt: skip
    return seq


def _scoring(req: Request, start: int, num_new: int) -> PromptScoring | None:
    """Prompt logprobs this chunk must produce (position i predicts token i + 1); after a
    preemption, positions already scored are not scored again."""
    k = req.params.prompt_logprobs
    first = max(start + 1, len(req.prompt_logprobs) or 1)
    end = min(start + num_new + 1, req.num_prompt_tokens)
    if k is None or not req.wants_prompt_logprobs or first >= end:
        return None
    return PromptScoring(first, req.token_ids[first:end], k)
