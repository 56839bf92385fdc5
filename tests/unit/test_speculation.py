"""Draft sources and the step-cost rule of speculative decoding (engine/speculation.py)."""

from __future__ import annotations

import math
import random

from convoy.engine.draft_planner import worth
from convoy.engine.speculation import Drafter, DraftGate, NgramIndex, find_in
from convoy.engine.step_costs import StepCosts
from convoy.worker.worker import accepted_prefix


def _brute_lookup(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The longest suffix of n_max..n_min tokens that occurred earlier, its latest occurrence."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                draft = tokens[start + n : start + n + k]
                while len(draft) < k:  # a repeating pattern: continued
                    draft.append(draft[len(draft) - (len(tokens) - start - n)])
                return draft
    return []


def test_ngram_index_finds_the_longest_latest_suffix_like_a_brute_force_search() -> None:
    rng = random.Random(7)
    for _ in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        index = NgramIndex(tokens[: len(tokens) // 2], 4)
        index.extend(tokens[len(tokens) // 2 :])  # built in two parts: the same index
        for n_min in (1, 2):
            assert index.lookup(3, n_min, 4) == _brute_lookup(tokens, 3, n_min, 4), tokens


def test_ngram_lookup_proposes_what_followed_a_repeated_phrase() -> None:
    text = [5, 6, 7, 8, 9, 10, 1, 2, 5, 6, 7]
    assert NgramIndex(text, 4).lookup(4, 1, 4) == [8, 9, 10, 1]
    assert NgramIndex([3, 7, 7], 4).lookup(4, 1, 4) == [7, 7, 7, 7]  # a run goes on
    assert NgramIndex([0, 1, 2, 0, 1, 2, 0], 4).lookup(5, 1, 4) == [1, 2, 0, 1, 2]
    assert NgramIndex([1, 2, 3], 4).lookup(4, 1, 4) == []  # nothing repeats
    assert NgramIndex([1, 2, 3, 3], 4).lookup(4, 2, 4) == []  # only a 1-gram repeats


def test_a_prediction_is_followed_from_its_start_and_found_again_after_an_edit() -> None:
    prompt = [100, 101]
    prediction = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    d = Drafter.create(prompt, prediction, lookup=False, n_min=1, n_max=4)
    assert d.propose(prompt + [1], 2, 3) == [2, 3, 4]  # first output token matched
    assert d.source == "prediction"
    # the output diverged (an edit: 42 instead of 4), then goes on with 5: found again after 5
    assert d.propose(prompt + [1, 2, 3, 42], 2, 3) == []  # 42 occurs nowhere in the prediction
    assert d.propose(prompt + [1, 2, 3, 42, 5], 2, 3) == [6, 7, 8]
    assert d.propose(prompt + [1, 2, 3, 42, 5, 6, 7], 2, 8) == [8, 9]  # to its end


def test_find_in_prefers_an_occurrence_after_the_last_match() -> None:
    pred = [7, 1, 2, 7, 1, 3]
    assert find_in(pred, [7, 1], 0) == 2
    assert find_in(pred, [7, 1], 3) == 5
    assert find_in(pred, [7, 1], 6) == 2  # none after: the first one
    assert find_in(pred, [9], 0) is None


def test_acceptance_sets_the_draft_length_and_misses_back_off_lookup() -> None:
    d = Drafter.create([1, 2, 3, 1, 2, 3], None, lookup=True, n_min=1, n_max=4)
    assert d.propose([1, 2, 3, 1, 2, 3, 1], 6, 4) == [2, 3, 1, 2]
    for _ in range(10):
        d.record(4, 4)
    assert d.budget(8) == 8  # always kept: the longest drafts
    assert d.budget(0) == 0  # no room left (max_tokens): no draft
    for _ in range(3):
        d.source = "lookup"
        d.record(4, 0)
    assert d.budget(8) < 8
    assert d.skip > 0  # misses in a row: no lookup drafts for a few steps
    skipped = d.skip
    for _ in range(skipped):
        assert d.propose([1, 2, 3, 1, 2, 3, 1], 6, 4) == []
    assert d.propose([1, 2, 3, 1, 2, 3, 1], 6, 4) == [2, 3, 1, 2]
    assert d.num_drafted == 52 and d.num_accepted == 40
    low = d.acceptance
    for _ in range(30):  # steps in which its drafts were not worth a row
        d.relax()
    assert low < d.acceptance < d.prior  # drifts back: it tries again later


def test_a_draft_row_runs_only_while_its_chance_beats_what_a_row_costs() -> None:
    costs = StepCosts()
    assert costs.threshold(8) == math.inf  # a step of this size is measured without drafts first
    costs.record(8, 0.050)
    assert costs.threshold(8) == 0.0  # then drafts are tried
    assert costs.explore_cap(8) == 16  # one bucket up at a time
    for _ in range(5):  # memory-bound: 16 rows cost what 8 do
        costs.record(8, 0.050)
        costs.record(16, 0.051)
    assert costs.threshold(8) < 0.05
    assert costs.explore_cap(8) is None and costs.explore_cap(16) == 32
    for _ in range(50):  # compute-bound: twice the rows, twice the time
        costs.record(64, 0.5)
        costs.record(128, 1.0)
    assert costs.threshold(64) > 0.95
    assert worth(0.9, costs.threshold(64)) == 0  # even a 90% draft is not worth a row there
    assert worth(0.9, costs.threshold(8)) > 8
    assert worth(0.5, 0.2) == 2  # 0.5, 0.25 pass; 0.125 does not
    costs.record(1000, 8.0)  # a prefill step far above: the slope from 128 to it, per row
    assert 0.95 < costs.threshold(128) < 1.05


def test_accepted_prefix_keeps_the_draft_tokens_the_samples_reproduce() -> None:
    assert accepted_prefix([5], []) == 0
    assert accepted_prefix([1, 2, 3, 9], [1, 2, 3]) == 3  # all kept, 9 is the bonus token
    assert accepted_prefix([1, 7, 3, 9], [1, 2, 3]) == 1  # 7 replaces 2, the rest is dropped
    assert accepted_prefix([4, 2, 3, 9], [1, 2, 3]) == 0


def test_the_draft_gate_stops_drafts_where_drafted_steps_gave_fewer_tokens_a_second() -> None:
    gate = DraftGate()
    assert all(gate.allow(64) for _ in range(4))  # nothing measured: drafts may run
    for _ in range(8):  # 64 sequences: drafted steps 70 tokens in 0.2 s, plain 64 in 0.16 s
        gate.record(64, True, 70, 0.2)
        gate.record(64, False, 64, 0.16)
    allowed = [gate.allow(64) for _ in range(64)]
    assert sum(allowed) == 64 // DraftGate.EXPLORE  # only the exploring steps draft
    for _ in range(8):  # one sequence: drafts pay (3 tokens in 12 ms against 1 in 8 ms)
        gate.record(1, True, 3, 0.012)
        gate.record(1, False, 1, 0.008)
    allowed = [gate.allow(1) for _ in range(64)]
    assert sum(allowed) == 64 - 64 // DraftGate.EXPLORE  # one step in 16 measures plain steps
    # the bucket's rates follow what steps give now: drafted steps turn out to pay at 64
    for _ in range(60):
        gate.record(64, True, 90, 0.17)
    assert sum(gate.allow(64) for _ in range(64)) == 64 - 64 // DraftGate.EXPLORE


def test_a_step_is_capped_only_where_it_is_long_and_smaller_steps_cost_little_more() -> None:
    costs = StepCosts()
    assert costs.row_cap(256, 0.15, 0.9) is None  # nothing measured: the full step first
    costs.record(256, 0.470)
    assert costs.row_cap(256, 0.15, 0.9) == 128  # too long: half of it is measured next
    assert costs.row_cap(256, 0.5, 0.9) is None  # within the target
    costs.record(128, 0.240)
    assert costs.row_cap(256, 0.15, 0.9) == 64  # 128 rows are still too long: explore 64
    costs.record(64, 0.125)
    assert costs.row_cap(256, 0.15, 0.9) == 64  # fits, at 94% of the full step's rate
    assert costs.row_cap(256, 0.3, 0.9) == 128
    costs.record(32, 0.100)  # memory-bound below 64: rows no longer share the weights' read
    assert costs.row_cap(256, 0.05, 0.9) == 64  # the smallest size that is still efficient
    memory_bound = StepCosts()
    memory_bound.record(64, 0.200)
    memory_bound.record(32, 0.180)
    assert memory_bound.row_cap(64, 0.1, 0.9) is None  # halving would cost 80% more a row
