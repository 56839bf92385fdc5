"""Which decoding sequences of a step verify drafts, and how many tokens; and what verification
gave back. The scheduler calls `add_drafts` once everything else of a step is scheduled, so a
draft only ever takes what the step left over (token budget, free blocks), and `verified` when a
step's results are folded in. No torch here; the draft sources live in engine/speculation.py.
"""

from __future__ import annotations

import math

from convoy.config import SchedulerConfig
from convoy.engine.block_manager import BlockManager
from convoy.engine.request import Request
from convoy.engine.speculation import Drafter, DraftGate
from convoy.engine.step_costs import StepCosts


class DraftPlanner:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, step_costs: StepCosts
    ) -> None:
        # "auto", "ngram" or "off"; tests and benchmarks switch it on a live engine
        self.mode = config.speculative
        self.num_speculative_tokens = config.num_speculative_tokens
        self.lookup_ngrams = (config.prompt_lookup_min, config.prompt_lookup_max)
        self.bm = block_manager
        self.step_costs = step_costs  # the scheduler's (EngineCore records every step's time)
        self.draft_gate = DraftGate()  # and what decode steps gave with drafts and without
        self.num_draft_tokens = 0  # totals since start
        self.num_accepted_draft_tokens = 0

    def add_drafts(
        self, scheduled: list[tuple[Request, int]], budget: int, max_model_len: int
    ) -> None:
        """Give decoding sequences of this step (`scheduled`: (sequence, new tokens), changed in
        place) draft tokens to verify, within `budget` tokens
        and the free blocks (a draft never displaces other work). In "auto" mode a draft token
        runs only while its estimated chance of being kept beats what one more row costs
        against the step's rows now (`StepCosts`): a prediction's drafts start trusted (90%),
        and once the step is compute-bound only drafts that are nearly always kept still run;
        "ngram" mode drafts regardless."""
        if self.mode == "off":
            return
        rows = sum(num_new for _, num_new in scheduled)
        auto = self.mode == "auto"
        if auto and not self.draft_gate.allow(len(scheduled)):
            return
        if auto and (cap := self.step_costs.explore_cap(rows)) is not None:
            budget = min(budget, cap - rows)  # learn the next bucket's cost before going past it
        lookup = self.mode in ("auto", "ngram")
        for i, (req, num_new) in enumerate(scheduled):
            if budget <= 0:
                break
            p = req.params
            if num_new != 1 or req.num_output_tokens == 0 or p.pooling is not None:
                continue
            if req.drafter is None:
                if not (lookup or p.prediction):
                    continue
                req.drafter = Drafter.create(
                    req.prompt_token_ids, p.prediction, lookup, *self.lookup_ngrams
                )
            room = min(self.num_speculative_tokens, budget, max_model_len - req.num_tokens)
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - req.num_output_tokens - 1)
            drafter = req.drafter
            draft = drafter.propose(req.token_ids, req.num_prompt_tokens, drafter.budget(room))
            if draft and auto:
                draft = draft[: worth(drafter.acceptance, self.step_costs.threshold(rows))]
                if not draft:
                    drafter.relax()
            if draft and req.grammar is not None:
                draft = draft[: req.grammar.validate(draft)]
            if not draft or not self.bm.allocate(req, 1 + len(draft)):
                continue
            req.draft = draft
            scheduled[i] = (req, 1 + len(draft))
            rows += len(draft)
            budget -= len(draft)

    def verified(self, req: Request, drafted: int, kept: int) -> None:
        """A step verified `drafted` draft tokens of `req` and kept the first `kept`."""
        assert req.drafter is not None
        req.drafter.record(drafted, kept)
        self.num_draft_tokens += drafted
        self.num_accepted_draft_tokens += kept


def worth(acceptance: float, threshold: float) -> int:
    """How many draft tokens in a row are each kept with a chance of at least `threshold`
    (token i is kept with about acceptance ** i); at most 64."""
    if threshold <= 0.0:
        return 64
    if acceptance <= threshold:  # inf included
        return 0
    return min(64, int(math.log(threshold) / math.log(min(acceptance, 0.999))))
