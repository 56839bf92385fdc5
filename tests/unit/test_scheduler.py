"""Scheduler with a fake runner: budgets, chunked prefill, preemption, fairness (no model)."""

from __future__ import annotations

import itertools

from convoy.config import SchedulerConfig
from convoy.engine.block_manager import BlockManager
from convoy.engine.request import Request, RequestStatus
from convoy.engine.scheduler import Scheduler
from convoy.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def _req(group: str, prompt_len: int, max_tokens: int = 8) -> Request:
    base = next(_ids) * 1000  # distinct prompts: no accidental prefix sharing
    return Request(
        f"{group}-{base}", list(range(base, base + prompt_len)),
        SamplingParams(max_tokens=max_tokens), group_id=group, arrival=0.0,
    )  # fmt: skip


class FakeEngine:
    """Plays the engine's part: after each step, sequences that reached their end get a token."""

    def __init__(self, num_blocks: int, max_seqs: int = 8, max_tokens: int = 64) -> None:
        self.bm = BlockManager(num_blocks, BS)
        self.sched = Scheduler(SchedulerConfig(max_seqs, max_tokens), self.bm)
        self.steps = 0

    def step(self) -> list[tuple[Request, int]]:
        out = self.sched.schedule()
        self.steps += 1
        for req, n in out.scheduled:
            assert req.num_computed_tokens + n <= req.num_tokens
            req.num_computed_tokens += n
            self.bm.cache_computed(req)
            if req.num_computed_tokens == req.num_tokens:
                req.token_ids.append(7)
                if req.num_output_tokens >= (req.params.max_tokens or 0):
                    self.sched.finish(req)
        return out.scheduled

    def run(self, limit: int = 10_000) -> None:
        while self.sched.has_work() and self.steps < limit:
            self.step()


def test_token_budget_chunks_a_long_prompt() -> None:
    eng = FakeEngine(num_blocks=64, max_tokens=16)
    req = _req("g", 40)
    eng.sched.add_request(req)
    chunks = [n for _, n in eng.step()] + [n for _, n in eng.step()] + [n for _, n in eng.step()]
    assert chunks == [16, 16, 8]
    assert req.num_output_tokens == 1  # sampled only after the last chunk


def test_mixed_prefill_and_decode_in_one_step() -> None:
    eng = FakeEngine(num_blocks=64, max_tokens=32)
    a = _req("a", 8)
    eng.sched.add_request(a)
    eng.step()
    b = _req("b", 20)
    eng.sched.add_request(b)
    scheduled = dict((r.req_id, n) for r, n in eng.step())
    assert scheduled == {a.req_id: 1, b.req_id: 20}


def test_sequence_cap() -> None:
    eng = FakeEngine(num_blocks=256, max_seqs=3)
    for _ in range(5):
        eng.sched.add_request(_req("g", 4))
    eng.step()
    assert len(eng.sched.running) == 3 and eng.sched.num_waiting == 2


def test_preemption_when_blocks_run_out_then_everything_finishes() -> None:
    eng = FakeEngine(num_blocks=10, max_seqs=8, max_tokens=64)
    reqs = [_req("g", 6, max_tokens=12) for _ in range(4)]  # 18 tokens = 5 blocks each
    for r in reqs:
        eng.sched.add_request(r)
    eng.run()
    assert eng.sched.num_preemptions > 0
    assert all(r.status == RequestStatus.FINISHED and r.num_output_tokens == 12 for r in reqs)
    assert eng.bm.num_used_blocks == 0


def test_small_request_is_not_stuck_behind_a_big_one() -> None:
    eng = FakeEngine(num_blocks=4096, max_seqs=16, max_tokens=256)
    for _ in range(1000):
        eng.sched.add_request(_req("big", 12, max_tokens=50))
    for _ in range(5):
        eng.step()
    small = _req("small", 12, max_tokens=4)
    eng.sched.add_request(small)
    steps = 0
    while small.num_output_tokens == 0:
        eng.step()
        steps += 1
    assert steps <= 2
    eng.run(limit=100)
    assert small.status == RequestStatus.FINISHED


def test_shared_prefix_is_computed_once() -> None:
    eng = FakeEngine(num_blocks=256, max_seqs=16, max_tokens=512)
    header = list(range(5000, 5040))  # 10 full blocks
    reqs = []
    for i in range(8):
        r = Request(f"r{i}", header + [i, i + 1], SamplingParams(max_tokens=2), "g", 0.0)
        reqs.append(r)
        eng.sched.add_request(r)
    computed = 0
    while eng.sched.has_work():
        computed += sum(n for _, n in eng.step())
    # Header once, each request's 2-token tail, plus one decode step each.
    assert computed == 40 + 8 * 2 + 8 * 1
    assert all(r.num_cached_tokens == 40 for r in reqs[1:])
