"""Scheduler: which sequences run in the next step, and how many of their tokens. No torch here.

There is no prefill or decode phase. Each step, every scheduled sequence computes
`num_tokens - num_computed_tokens` of its tokens (capped by the step's token budget): a whole
prompt, a chunk of one, or the one token sampled last step. Running sequences go first (oldest
first); when blocks run out the newest running sequence is preempted (its blocks freed, recomputed
later). Waiting sequences are admitted group by group (a group is one API request), the group with
the fewest running sequences first, so a small request is not stuck behind a 1,000-prompt one;
when the sequence cap is reached, a group holding at least two more sequences than the newcomer's
gives one up.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from convoy.config import SchedulerConfig
from convoy.engine.block_manager import BlockManager, hash_prompt_blocks
from convoy.engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.bm = block_manager
        self.waiting: dict[str, deque[Request]] = {}  # group -> its waiting sequences, FIFO
        self.running: list[Request] = []  # admission order
        self.num_running_by_group: dict[str, int] = {}
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def add_request(self, req: Request) -> None:
        req.block_hashes = self._hashes(req)
        self.waiting.setdefault(req.group_id, deque()).append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def finish(self, req: Request) -> None:
        """Remove a sequence (finished or aborted) from the queues and free its blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._count(req.group_id, -1)
        elif req.status == RequestStatus.WAITING:
            queue = self.waiting.get(req.group_id)
            if queue is not None and req in queue:
                queue.remove(req)
                if not queue:
                    del self.waiting[req.group_id]
        self.bm.free(req)
        req.status = RequestStatus.FINISHED

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
            req = self.waiting[group][0]
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
            self.waiting[group].popleft()
            if not self.waiting[group]:
                del self.waiting[group]
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
        self.waiting.setdefault(req.group_id, deque()).appendleft(req)
        out.preempted.append(req)

    def _count(self, group: str, delta: int) -> None:
        n = self.num_running_by_group.get(group, 0) + delta
        if n:
            self.num_running_by_group[group] = n
        else:
            self.num_running_by_group.pop(group, None)

    def _hashes(self, req: Request) -> list[int]:
        if not self.bm.enable_prefix_caching:
            return []
        return hash_prompt_blocks(req.prompt_token_ids, self.bm.block_size)
