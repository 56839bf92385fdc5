"""Scheduler.schedule_side with a fake runner: a side step runs between two layers of a step in
flight (EngineCore), so it admits only what leaves that step untouched (no model here)."""

from __future__ import annotations

import inspect

from convoy.engine.request import Priority, Request, RequestStatus
from convoy.engine.scheduler import SchedulerOutput
from convoy.models.registry import ARCHITECTURES
from convoy.worker.batch import ModelRunnerOutput
from tests.unit.test_scheduler import BS, FakeEngine, _req


def _finish(eng: FakeEngine, out: SchedulerOutput) -> None:
    """What the worker and update_from_output do for a scheduled step (FakeEngine.step's part
    after schedule), every sampling sequence getting `eng.token`."""
    runner_out = ModelRunnerOutput()
    for seq in out.seqs:
        if seq.sampling is not None:
            runner_out.sampled_token_ids[seq.req_id] = [eng.token]
    eng.sched.update_from_output(out, runner_out)


def _in_flight(eng: FakeEngine, reqs: list[Request]) -> SchedulerOutput:
    """Admit `reqs` and schedule the step that decodes them, left in flight."""
    for r in reqs:
        eng.sched.add_request(r)
    eng.step()
    flight = eng.sched.schedule()
    assert {r.req_id for r, _ in flight.scheduled} == {r.req_id for r in reqs}
    return flight


def _tables(reqs: list[Request]) -> list[list[int]]:
    return [list(r.block_table) for r in reqs]


def test_a_side_step_admits_whole_prompts_beside_the_step_in_flight() -> None:
    eng = FakeEngine(num_blocks=64, max_seqs=8, max_tokens=32, speculative="off")
    running = [_req(f"r{i}", 6, max_tokens=4) for i in range(3)]
    flight = _in_flight(eng, running)
    tables = _tables(running)
    short, long_, short2 = _req("a", 9), _req("b", 40), _req("c", 5)  # 40 > the 32-token budget
    for r in (short, long_, short2):
        eng.sched.add_request(r)
    side = eng.sched.schedule_side()
    assert side.scheduled == [(short, 9), (short2, 5)]  # the long prompt waits for chunks
    assert [len(s.token_ids) for s in side.seqs] == [9, 5]
    assert all(s.sampling is not None and not s.draft for s in side.seqs)
    assert not side.preempted and _tables(running) == tables  # the step in flight is untouched
    _finish(eng, side)
    assert short.num_output_tokens == short2.num_output_tokens == 1  # first tokens, at once
    _finish(eng, flight)  # the step in flight ends as if nothing had run beside it
    assert all(r.num_output_tokens == 2 for r in running)
    assert long_.status == RequestStatus.WAITING
    scheduled = eng.step()  # the next ordinary step: everyone, the long prompt chunked
    assert (long_, 32 - 5) in scheduled and len(scheduled) == 6
    eng.run()
    assert eng.bm.num_used_blocks == 0 and not eng.sched.has_work()


def test_a_side_step_never_preempts_nor_exceeds_the_sequence_cap() -> None:
    eng = FakeEngine(num_blocks=64, max_seqs=3, max_tokens=32, speculative="off")
    running = [_req(f"r{i}", 6, max_tokens=6) for i in range(3)]
    flight = _in_flight(eng, running)
    newcomer = _req("n", 4)
    eng.sched.add_request(newcomer)
    side = eng.sched.schedule_side()  # at the cap: nothing, where a step would make room
    assert not side.scheduled and not side.preempted
    assert newcomer.status == RequestStatus.WAITING
    assert all(r.status == RequestStatus.RUNNING for r in running)
    _finish(eng, flight)
    eng.run()
    assert newcomer.num_output_tokens == newcomer.params.max_tokens
    assert eng.sched.num_preemptions == 0 and eng.bm.num_used_blocks == 0


def test_a_side_step_takes_only_free_blocks_and_never_a_batch_lines_slot() -> None:
    # 6 blocks of 4 tokens: three sequences of 6-token prompts hold 2 blocks each
    eng = FakeEngine(num_blocks=6, max_seqs=8, max_tokens=32, speculative="off")
    lines = [_req(f"b{i}", 6, max_tokens=2) for i in range(3)]
    for line in lines:
        line.priority = Priority.BATCH
    flight = _in_flight(eng, lines)
    newcomer = _req("n", 5)  # needs 2 blocks; an ordinary step would preempt a batch line
    eng.sched.add_request(newcomer)
    assert eng.bm.num_used_blocks == 6
    side = eng.sched.schedule_side()
    assert not side.scheduled and not side.preempted and eng.sched.num_preemptions == 0
    assert all(r.status == RequestStatus.RUNNING for r in lines)
    _finish(eng, flight)
    eng.run()
    assert newcomer.num_output_tokens == newcomer.params.max_tokens


def test_a_side_step_admits_no_batch_line() -> None:
    eng = FakeEngine(num_blocks=64, max_seqs=8, max_tokens=32, speculative="off")
    flight = _in_flight(eng, [_req("r", 6)])
    line = _req("line", 5)
    line.priority = Priority.BATCH
    eng.sched.add_request(line)
    assert not eng.sched.schedule_side().scheduled
    _finish(eng, flight)
    eng.run()
    assert line.num_output_tokens == line.params.max_tokens


def test_a_side_step_waits_on_a_prompt_block_the_step_in_flight_computes() -> None:
    eng = FakeEngine(num_blocks=64, max_seqs=8, max_tokens=32, speculative="off")
    head = list(range(500, 500 + 3 * BS))
    first = Request("first", [*head, 1, 2], eng_params := _req("x", 1).params, "first", 0.0)
    eng.sched.add_request(first)
    flight = eng.sched.schedule()  # first's prompt is being computed: its blocks are pending
    assert flight.scheduled == [(first, 3 * BS + 2)]
    twin = Request("twin", [*head, 3], eng_params, "twin", 0.0)
    other = _req("other", 5)
    eng.sched.add_request(twin)
    eng.sched.add_request(other)
    side = eng.sched.schedule_side()
    assert side.scheduled == [(other, 5)]  # the twin reuses first's blocks once computed
    _finish(eng, side)
    _finish(eng, flight)
    scheduled = eng.step()
    assert (twin, 1) in scheduled  # three blocks from the cache, one token computed
    eng.run()
    assert eng.bm.num_used_blocks == 0


def test_every_family_takes_the_hook_a_side_step_runs_from() -> None:
    """The server's steps pass `between_layers` to the model's forward (EngineCore): a family
    that overrides forward must take it (Phi-3's did not, and every server step failed)."""
    for family in dict.fromkeys(ARCHITECTURES.values()):
        params = inspect.signature(family.forward).parameters
        assert "between_layers" in params, family.__name__
