"""Scheduler with a fake runner: budgets, chunked prefill, preemption, fairness (no model)."""

from __future__ import annotations

import itertools

from convoy.config import SchedulerConfig
from convoy.engine.block_manager import BlockManager
from convoy.engine.request import Request, RequestStatus
from convoy.engine.scheduler import Scheduler
from convoy.outputs import FinishReason
from convoy.sampling_params import SamplingParams
from convoy.worker.batch import ModelRunnerOutput
from convoy.worker.worker import accepted_prefix

BS = 4
_ids = itertools.count()


def _req(group: str, prompt_len: int, max_tokens: int = 8) -> Request:
    base = next(_ids) * 1000  # distinct prompts: no accidental prefix sharing
    return Request(
        f"{group}-{base}", list(range(base, base + prompt_len)),
        SamplingParams(max_tokens=max_tokens), group_id=group, arrival=0.0,
    )  # fmt: skip


class FakeEngine:
    """Plays the worker's part: every sequence that samples in a step gets `token`."""

    def __init__(
        self,
        num_blocks: int,
        max_seqs: int = 8,
        max_tokens: int = 64,
        max_model_len: int = 4096,
        speculative: str = "auto",
    ) -> None:
        self.bm = BlockManager(num_blocks, BS)
        config = SchedulerConfig(max_seqs, max_tokens, speculative=speculative)
        self.sched = Scheduler(config, self.bm, max_model_len)
        self.now = 0.0  # the scheduler's clock (seconds): tests move it
        self.sched.clock = lambda: self.now
        self.steps = 0
        self.token = 7

    def step(self) -> list[tuple[Request, int]]:
        out = self.sched.schedule()
        self.steps += 1
        runner_out = ModelRunnerOutput()
        for (req, n), seq in zip(out.scheduled, out.seqs, strict=True):
            assert req.num_computed_tokens + n - len(seq.draft) <= req.num_tokens
            assert seq.req_id == req.req_id and len(seq.token_ids) == n
            if seq.sampling is not None:  # every position samples `token`
                sampled = [self.token] * (len(seq.draft) + 1)
                kept = accepted_prefix(sampled, seq.draft) + 1
                runner_out.sampled_token_ids[seq.req_id] = sampled[:kept]
        self.sched.update_from_output(out, runner_out)
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
    # it counts the tokens computed: drafts (their rejected tokens) would add to them
    eng = FakeEngine(num_blocks=256, max_seqs=16, max_tokens=512, speculative="off")
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


def test_update_from_output_finishes_on_stop_tokens_and_lengths() -> None:
    eng = FakeEngine(num_blocks=64, max_model_len=10)
    eos = Request("eos", [1, 2, 3], SamplingParams(max_tokens=8), "g", 0.0)
    eos.eos_token_ids = frozenset({7})
    early = Request("early", [1, 2, 4], SamplingParams(max_tokens=8, min_tokens=2), "g", 0.0)
    early.eos_token_ids = frozenset({7})  # EOS is not a stop below min_tokens
    stop_id = Request("stop-id", [1, 2, 5], SamplingParams(stop_token_ids=[7]), "g", 0.0)
    ctx = Request("ctx", [1] * 8, SamplingParams(max_tokens=None), "g", 0.0)
    for r in (eos, early, stop_id, ctx):
        eng.sched.add_request(r)
    eng.step()
    assert (eos.finish_reason, eos.stop_reason) == (FinishReason.STOP, None)
    assert (stop_id.finish_reason, stop_id.stop_reason) == (FinishReason.STOP, 7)
    assert early.finish_reason is None and ctx.finish_reason is None
    eng.step()
    assert early.finish_reason == FinishReason.STOP and early.num_output_tokens == 2
    assert ctx.finish_reason == FinishReason.LENGTH and ctx.num_tokens == 10  # the context
    assert eos.status == RequestStatus.FINISHED and not eng.sched.has_work()
    assert eng.bm.num_used_blocks == 0


def test_finish_requests_frees_waiting_and_running_sequences() -> None:
    eng = FakeEngine(num_blocks=64, max_seqs=1)
    running, waiting = _req("a", 6), _req("b", 6)
    eng.sched.add_request(running)
    eng.sched.add_request(waiting)
    eng.step()
    assert running.status == RequestStatus.RUNNING and waiting.status == RequestStatus.WAITING
    ended = eng.sched.finish_requests([running.req_id, waiting.req_id, "gone"], FinishReason.ABORT)
    assert ended == [running, waiting]
    assert all(r.finish_reason == FinishReason.ABORT for r in ended)
    assert not eng.sched.has_work() and eng.bm.num_used_blocks == 0
    assert eng.sched.finish_requests([running.req_id], FinishReason.STOP) == []  # once only


def test_aborting_20k_waiting_sequences_frees_them_and_keeps_the_order_of_the_rest() -> None:
    """A client dropping a huge request: every sequence leaves at once (no search of the queue
    per sequence), none runs again, and the sequences left are admitted in arrival order."""
    eng = FakeEngine(num_blocks=512, max_seqs=4, max_tokens=64)
    big = [_req("big", 4, max_tokens=2) for _ in range(20_000)]
    small = [_req("small", 4, max_tokens=2) for _ in range(6)]
    for r in big + small:
        eng.sched.add_request(r)
    eng.step()
    kept = big[::2000]  # ten survivors spread through the queue
    survivors = set(kept)
    aborted = [r for r in big if r not in survivors]
    waiting_before = [r for r in kept + small if r.status == RequestStatus.WAITING]
    # Newest first: the worst order for a queue that is searched from its head.
    ids = [r.req_id for r in reversed(aborted)]
    assert eng.sched.finish_requests(ids, FinishReason.ABORT) == aborted[::-1]
    assert all(r.status == RequestStatus.FINISHED and not r.block_table for r in aborted)
    assert all(r.finish_reason == FinishReason.ABORT for r in aborted)
    assert eng.sched.num_waiting == len(waiting_before)
    admitted: list[Request] = []
    while eng.sched.has_work():
        for req, _ in eng.step():
            if req not in admitted:
                admitted.append(req)
    assert not set(admitted) & set(aborted)
    newly = [r for r in admitted if r in waiting_before]
    for group in ("big", "small"):
        assert [r for r in newly if r.group_id == group] == [
            r for r in waiting_before if r.group_id == group
        ]
    assert all(r.finish_reason == FinishReason.LENGTH for r in kept + small)
    assert eng.bm.num_used_blocks == 0 and eng.sched.num_waiting == 0


def test_drafts_are_verified_kept_and_their_blocks_given_back() -> None:
    """The fake model samples 7 everywhere: once two 7s are out, prompt lookup drafts 7s and
    every one is kept; a sequence never outgrows max_tokens, and ends with no block held."""
    eng = FakeEngine(num_blocks=64, speculative="ngram")
    reqs = [_req("g", 6, max_tokens=30), _req("h", 9, max_tokens=5)]
    for r in reqs:
        eng.sched.add_request(r)
    eng.run()
    assert [r.output_token_ids for r in reqs] == [[7] * 30, [7] * 5]
    assert all(r.finish_reason == FinishReason.LENGTH for r in reqs)
    assert eng.steps < 12  # 30 tokens in far fewer steps than 30
    sched = eng.sched
    assert sched.drafts.num_accepted_draft_tokens == sched.drafts.num_draft_tokens > 20
    # no draft reaches past max_tokens: the last sampled token is never computed
    assert sched.num_computed_tokens == sum(
        r.num_prompt_tokens + r.num_output_tokens - 1 for r in reqs
    )
    assert eng.bm.num_used_blocks == 0


def test_a_rejected_draft_gives_its_blocks_back_and_its_positions_are_computed_again() -> None:
    eng = FakeEngine(num_blocks=64, speculative="ngram")
    req = _req("g", 5, max_tokens=40)
    eng.sched.add_request(req)
    tokens = itertools.cycle([7, 7, 8])  # 7 7 8 7 7 8 ...: lookup guesses right, then wrong
    while eng.sched.has_work():
        eng.token = next(tokens)
        before = req.num_computed_tokens
        scheduled = dict((r.req_id, n) for r, n in eng.step())
        if req.finish_reason is None:
            # trimmed to what its tokens use (the last one's slot may come next step)
            assert -(-req.num_computed_tokens // BS) <= len(req.block_table)
            assert len(req.block_table) <= -(-req.num_tokens // BS)
            assert req.num_computed_tokens == req.num_tokens - 1
            assert req.num_computed_tokens - before <= scheduled[req.req_id]
    assert eng.sched.drafts.num_draft_tokens > eng.sched.drafts.num_accepted_draft_tokens  # some rejected
    assert req.num_output_tokens == 40 and eng.bm.num_used_blocks == 0


def _decoding(n: int, max_seqs: int = 128) -> tuple[FakeEngine, list[Request]]:
    """An engine whose n sequences have computed their prompts and sampled once."""
    eng = FakeEngine(num_blocks=1024, max_seqs=max_seqs, max_tokens=256, speculative="off")
    assert eng.sched.sizer.target == 0  # off by default
    eng.sched.sizer.target = 0.15
    reqs = [_req(f"g{i}", 4, max_tokens=100) for i in range(n)]
    for r in reqs:
        eng.sched.add_request(r)
    eng.step()  # every prompt in one step
    assert all(r.num_output_tokens == 1 for r in reqs)
    return eng, reqs


def test_a_long_step_is_cut_decode_rows_take_turns_and_a_newcomer_goes_first() -> None:
    eng, reqs = _decoding(64)
    costs = eng.sched.step_costs  # compute-bound, 5 ms a row: 64 rows take 320 ms
    for rows in (64, 32, 16, 8):
        costs.record(rows, 0.005 * rows)
    # a target of 150 ms: a step of at most 16 rows here
    seen: list[str] = []
    for _ in range(4):
        scheduled = eng.step()
        assert [n for _, n in scheduled] == [1] * 16
        seen += [r.req_id for r, _ in scheduled]
    assert sorted(seen) == sorted(r.req_id for r in reqs)  # each decoded once in four steps
    assert all(r.num_output_tokens == 2 for r in reqs)
    new = _req("new", 16)
    eng.sched.add_request(new)
    scheduled = eng.step()  # the fast lane: the newcomer's prompt in a step of its own
    assert scheduled == [(new, 16)] and new.num_output_tokens == 1
    new2 = _req("new2", 20)
    eng.sched.add_request(new2)
    scheduled = eng.step()  # never two lanes in a row: the whole prompt first, 16 decode rows
    assert scheduled[0] == (new2, 20) and [n for _, n in scheduled[1:]] == [1] * 16
    eng.sched.sizer.target = 0.0  # off: every running sequence in each step
    assert len(eng.step()) == 66


def test_newcomers_beside_a_long_step_that_cannot_be_split_get_a_step_of_their_own() -> None:
    eng, _ = _decoding(32)
    costs = eng.sched.step_costs  # memory-bound: 32 rows take 200 ms, 16 rows 190 ms
    costs.record(32, 0.2)
    costs.record(16, 0.19)
    assert len(eng.step()) == 32  # too long, but halving it would cost 90% more a row
    a, b = _req("a", 3), _req("b", 5)
    eng.sched.add_request(a)
    eng.sched.add_request(b)
    assert eng.step() == [(a, 3), (b, 5)]  # the newcomers alone
    assert a.num_output_tokens == b.num_output_tokens == 1
    c = _req("c", 3)
    eng.sched.add_request(c)
    scheduled = eng.step()  # never two lanes in a row; 34 decode rows are cut to 32
    assert scheduled[0] == (c, 3) and [n for _, n in scheduled[1:]] == [1] * 32
    eng.sched.sizer.target = 0.0
    d = _req("d", 3)
    eng.sched.add_request(d)
    assert len(eng.step()) == 36  # off: newcomers join the full step


def test_few_sequences_are_never_cut_nor_given_a_lane() -> None:
    eng, _ = _decoding(8, max_seqs=32)
    for rows in (8, 4, 2, 1):  # compute-bound and long, but 8 rows are few: memory-bound on a CPU
        eng.sched.step_costs.record(rows, 0.05 * rows)
    assert len(eng.step()) == 8
    new = _req("new", 3)
    eng.sched.add_request(new)
    assert len(eng.step()) == 9
