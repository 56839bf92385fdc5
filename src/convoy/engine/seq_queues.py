"""The sequences of one scheduling class (interactive or batch): waiting groups and running list.

A group is one API request. Each group's waiting sequences are an ordered dict by id, FIFO with
preempted sequences put back at the front, so aborting any of them is O(1) (a client that drops a
1,024-prompt request must not stall the engine). Running sequences are kept in admission order.
No torch here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from convoy.engine.request import Request, RequestStatus


@dataclass(slots=True, eq=False)
class SeqQueues:
    # group -> its waiting sequences by id (dict order = order the groups arrived)
    waiting: dict[str, OrderedDict[str, Request]] = field(default_factory=dict)
    running: list[Request] = field(default_factory=list)  # admission order
    num_running_by_group: dict[str, int] = field(default_factory=dict)
    num_waiting: int = 0
    num_finished_running: int = 0  # freed but not yet pruned from `running`

    def enqueue(self, req: Request, front: bool = False) -> None:
        queue = self.waiting.setdefault(req.group_id, OrderedDict())
        queue[req.req_id] = req
        if front:
            queue.move_to_end(req.req_id, last=False)
        self.num_waiting += 1

    def dequeue(self, req: Request) -> None:
        """Take a waiting sequence out of its group's queue (the head, or any one: an abort)."""
        queue = self.waiting[req.group_id]
        del queue[req.req_id]
        if not queue:
            del self.waiting[req.group_id]
        self.num_waiting -= 1

    def admit(self, req: Request) -> None:
        """A waiting sequence starts running."""
        self.dequeue(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.count(req.group_id, +1)

    def stop_running(self, req: Request) -> None:
        """A running sequence leaves `running` now (preempted)."""
        self.running.remove(req)
        self.count(req.group_id, -1)

    def count(self, group: str, delta: int) -> None:
        n = self.num_running_by_group.get(group, 0) + delta
        if n:
            self.num_running_by_group[group] = n
        else:
            self.num_running_by_group.pop(group, None)

    def prune(self) -> None:
        """Drop the sequences freed since the last prune: one pass however many ended."""
        if self.num_finished_running:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
            self.num_finished_running = 0

    def next_group(self, held_back: set[str]) -> str | None:
        """The waiting group with the fewest running sequences (oldest group on ties)."""
        best, best_count = None, -1
        for group in self.waiting:
            if group in held_back:
                continue
            count = self.num_running_by_group.get(group, 0)
            if best is None or count < best_count:
                best, best_count = group, count
        return best

    def fair_share_victim(self, group: str) -> Request | None:
        """The newest sequence of the largest running group, if that group holds at least two
        more sequences than `group` (so giving one up to `group` is fair); else None."""
        counts = self.num_running_by_group
        big = max(counts, key=lambda g: counts[g], default=None)
        if big is None or big == group or counts[big] - counts.get(group, 0) < 2:
            return None
        return next(r for r in reversed(self.running) if r.group_id == big)
