"""Two priority classes in the scheduler: interactive first, Batch API lines share what is left."""

from __future__ import annotations

import math

import pytest

from convoy.cli import parse_serve_args
from convoy.config import ConfigError, SchedulerConfig
from convoy.engine.request import Priority, Request, RequestStatus
from convoy.engine.scheduler import Scheduler
from convoy.outputs import FinishReason
from convoy.sampling_params import SamplingParams
from tests.unit.test_scheduler import FakeEngine, _req


def _batch(group: str, prompt_len: int, max_tokens: int = 8) -> Request:
    req = _req(group, prompt_len, max_tokens)
    req.priority = Priority.BATCH
    return req


def _batch_lines(num: int, prompt_len: int, max_tokens: int = 8) -> list[Request]:
    """Batch API lines: each line is its own API request (group)."""
    return [_batch(f"line{i}", prompt_len, max_tokens) for i in range(num)]


def _add(eng: FakeEngine, reqs: list[Request]) -> None:
    for r in reqs:
        eng.sched.add_request(r)


def test_interactive_groups_are_admitted_before_batch_ones() -> None:
    eng = FakeEngine(num_blocks=256, max_seqs=4)
    lines = _batch_lines(4, 4)
    users = [_req("u1", 4), _req("u2", 4)]
    _add(eng, lines + users)  # the batch arrived first
    scheduled = [r for r, _ in eng.step()]
    # Interactive first; batch keeps max(1, floor(0.25 * 4)) = 1 slot while they run.
    assert scheduled == users + lines[:1]
    assert all(r.status == RequestStatus.WAITING for r in lines[1:])
    eng.run()
    assert all(r.num_output_tokens == 8 for r in lines + users)
    assert eng.bm.num_used_blocks == 0


def test_batch_pauses_beyond_its_share_while_interactive_runs_then_resumes() -> None:
    eng = FakeEngine(num_blocks=256, max_seqs=8, max_tokens=64)
    lines = _batch_lines(8, 6, max_tokens=40)
    _add(eng, lines)
    eng.step()
    eng.step()
    assert len(eng.sched.running) == 8  # the batch fills the sequence cap
    user = _req("user", 6, max_tokens=5)
    eng.sched.add_request(user)
    scheduled = [r for r, _ in eng.step()]
    # The newcomer takes the newest line's slot (preempted: back to the front of its queue) and
    # gets its first token at once; two lines (0.25 x 8) run, five pause.
    assert scheduled == [user, *lines[:2]] and user.num_output_tokens == 1
    assert lines[-1].status == RequestStatus.WAITING and lines[-1].num_preemptions == 1
    paused = lines[2:7]
    progress = [r.num_computed_tokens for r in paused]
    eng.sched.finish_requests([paused[0].req_id], FinishReason.ABORT)  # an abort frees a paused one
    assert paused[0].block_table == []
    while user.status != RequestStatus.FINISHED:
        scheduled = [r for r, _ in eng.step()]
        assert user in scheduled and len(scheduled) <= 3
    assert [r.num_computed_tokens for r in paused[1:]] == progress[1:]  # paused: no progress
    assert all(r.status == RequestStatus.RUNNING and r.block_table for r in paused[1:])
    scheduled = [r for r, _ in eng.step()]  # interactive work gone, the grace period not
    assert scheduled == lines[:2]
    eng.now += eng.sched.batch_grace  # then everything runs again
    scheduled = [r for r, _ in eng.step()]
    assert scheduled == lines[:2] + paused[1:] + lines[-1:]
    eng.run()
    assert all(r.num_preemptions == 0 for r in paused)  # resumed, not recomputed
    assert all(r.num_output_tokens == 40 for r in lines if r is not paused[0])
    assert eng.bm.num_used_blocks == 0


def test_a_batch_prefill_does_not_eat_the_token_budget_of_interactive_requests() -> None:
    eng = FakeEngine(num_blocks=256, max_seqs=8, max_tokens=64)
    line = _batch("line", 200)
    eng.sched.add_request(line)
    # alone, a batch step carries its decodes (at most 8 sequences) and 0.25 x 64 prompt tokens
    assert eng.step() == [(line, 8 + 16)]
    user = _req("user", 40)
    eng.sched.add_request(user)
    # The user's whole prompt; the line keeps two tokens per shared slot, 2 x floor(0.25 x 8).
    assert eng.step() == [(user, 40), (line, 4)]
    assert eng.step() == [(user, 1), (line, 4)]


def test_the_batch_keeps_its_share_for_the_grace_period_after_interactive_work() -> None:
    """The next request of a conversation comes soon: until batch_grace seconds have passed
    without interactive work the batch stays at its share, so that request finds a short step
    in flight; then it takes its whole cap again."""
    eng = FakeEngine(num_blocks=256, max_seqs=8, max_tokens=64)
    lines = _batch_lines(8, 4, max_tokens=100)
    _add(eng, lines)
    eng.step()
    assert len(eng.step()) == 8
    user = _req("user", 4, max_tokens=2)
    eng.sched.add_request(user)
    while user.status != RequestStatus.FINISHED:
        eng.step()
    last_seen = eng.now
    for elapsed in (0.0, 1.0, eng.sched.batch_grace - 0.01):
        eng.now = last_seen + elapsed
        assert len(eng.step()) == 2  # still the share: floor(0.25 x 8)
    eng.now = last_seen + eng.sched.batch_grace
    assert len(eng.step()) == 8


def test_without_a_grace_period_the_batch_resumes_at_once() -> None:
    eng = FakeEngine(num_blocks=256, max_seqs=8, max_tokens=64)
    config = SchedulerConfig(8, 64, batch_grace=0.0)
    eng.sched = Scheduler(config, eng.bm, 4096)
    eng.sched.clock = lambda: eng.now
    _add(eng, _batch_lines(8, 4, max_tokens=100))
    eng.step()
    user = _req("user", 4, max_tokens=2)
    eng.sched.add_request(user)
    assert len(eng.step()) == 3  # the user and the batch's share
    while user.status != RequestStatus.FINISHED:
        eng.step()
    assert len(eng.step()) == 8


@pytest.mark.parametrize("grace", [-1.0, math.inf, math.nan])
def test_batch_grace_must_be_finite_and_not_negative(grace: float) -> None:
    with pytest.raises(ConfigError, match="batch_grace"):
        SchedulerConfig(batch_grace=grace)


def test_victims_are_batch_sequences_newest_first_never_interactive_ones() -> None:
    eng = FakeEngine(num_blocks=8, max_seqs=8, max_tokens=128)
    lines = _batch_lines(4, 8, max_tokens=12)  # 2 blocks each: the pool is full
    _add(eng, lines)
    eng.step()  # a batch step takes 8 decodes + 0.25 x 128 prompt tokens: all four prompts
    assert eng.bm.num_used_blocks == 8
    users = [_req("u1", 4, max_tokens=8), _req("u2", 4, max_tokens=8)]
    _add(eng, users)
    scheduled = [r for r, _ in eng.step()]
    # No block is free: the users take the newest line's; the oldest two lines (the share) grow
    # into the next newest one's, a paused one.
    assert scheduled[:2] == users and all(u.num_output_tokens == 1 for u in users)
    assert [r.num_preemptions for r in lines] == [0, 0, 1, 1]
    while any(u.status != RequestStatus.FINISHED for u in users):
        eng.step()
        assert all(u.num_preemptions == 0 for u in users)
    eng.run()
    assert all(u.num_output_tokens == 8 for u in users)
    assert all(r.num_output_tokens == 12 for r in lines)
    assert eng.bm.num_used_blocks == 0 and not eng.sched.has_work()


def test_an_interactive_sequence_is_never_preempted_for_a_batch_one() -> None:
    eng = FakeEngine(num_blocks=8, max_seqs=8, max_tokens=64)
    user = _req("user", 16, max_tokens=12)  # grows to 7 blocks
    line = _batch("line", 4, max_tokens=12)
    _add(eng, [user, line])
    eng.run()
    assert user.num_preemptions == 0 and line.num_preemptions > 0
    assert user.num_output_tokens == 12 and line.num_output_tokens == 12
    assert eng.bm.num_used_blocks == 0


def _trace(priority: Priority) -> list[list[tuple[int, int]]]:
    """Per step: (position in the workload, tokens) of what was scheduled."""
    eng = FakeEngine(num_blocks=16, max_seqs=4, max_tokens=32)
    # share 1: batch steps may take the whole token budget in prompt chunks, as interactive ones
    eng.sched = Scheduler(SchedulerConfig(4, 32, batch_share=1.0), eng.bm, 4096)
    reqs = [_req(f"g{i % 3}", 5 + 3 * i, max_tokens=6 + i) for i in range(9)]
    for r in reqs:
        r.priority = priority
    _add(eng, reqs)
    pos = {id(r): i for i, r in enumerate(reqs)}
    trace = []
    while eng.sched.has_work():
        trace.append([(pos[id(r)], n) for r, n in eng.step()])
    assert eng.sched.num_preemptions > 0  # the trace covers preemption and the sequence cap
    return trace


def test_one_class_alone_schedules_exactly_as_the_other_alone() -> None:
    assert _trace(Priority.BATCH) == _trace(Priority.INTERACTIVE)


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, math.nan])
def test_batch_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ConfigError, match="batch_share"):
        SchedulerConfig(batch_share=share)
    with pytest.raises(SystemExit):
        parse_serve_args(["--batch-share", str(share)])


def test_batch_share_flag() -> None:
    assert parse_serve_args(["--batch-share", "0.5"]).engine.scheduler.batch_share == 0.5
    assert parse_serve_args([]).engine.scheduler.batch_share == 0.25


def test_an_interactive_request_never_waits_on_a_block_pending_in_a_paused_batch_line() -> None:
    """A batch line computing a prompt block an interactive request needs, then paused by that
    request's arrival (share: one line), would never finish the block: the interactive request
    computes it itself, and a second one with the same prefix waits for the first instead."""
    eng = FakeEngine(num_blocks=256, max_seqs=4, max_tokens=64, speculative="off")
    line0 = _batch("line0", 4, max_tokens=100)
    line1 = _batch("line1", 200)
    _add(eng, [line0, line1])
    assert eng.step() == [(line0, 4), (line1, 16)]  # alone: 4 decodes + 0.25 x 64 prompt tokens
    assert eng.step() == [(line0, 1), (line1, 19)]  # 35 computed: block 8 (32..35) is pending
    prefix = line1.prompt_token_ids[:40]
    users = [
        Request(f"u{i}", [*prefix, 90_000 + i], SamplingParams(max_tokens=8), f"u{i}", 0.0)
        for i in (1, 2)
    ]
    _add(eng, users)
    # The batch keeps max(1, floor(0.25 x 4)) = 1 line, line0: line1 is paused. u1 takes its
    # first 8 blocks from the cache and computes block 8 and on; u2 waits one step for u1.
    assert eng.step() == [(users[0], 9), (line0, 1)]
    assert users[0].num_cached_tokens == 32
    assert eng.step() == [(users[0], 1), (users[1], 1), (line0, 1)]
    assert users[1].num_cached_tokens == 40
    while any(u.status != RequestStatus.FINISHED for u in users):
        assert line1 not in [r for r, _ in eng.step()]  # paused all along
    assert line1.num_computed_tokens == 35 and line1.num_preemptions == 0
    eng.run()
    assert all(r.num_output_tokens == 8 for r in [line1, *users])
    assert eng.bm.num_used_blocks == 0
