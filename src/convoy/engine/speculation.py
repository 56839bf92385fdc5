"""Draft tokens for speculative decoding, without a second model. No torch here.

A decoding sequence may be scheduled with a draft: k guessed next tokens after its last sampled
one. The step computes all k + 1 positions at once (like a prefill chunk), samples each from the
target model, and keeps the longest prefix of the draft that the samples reproduce plus the
sample after it (`accepted_prefix`). Sampling row i is the row plain decoding would have used
for that output position (the same history, seed and constraint state), so greedy and seeded
output is the same tokens with or without speculation, and unseeded output has exactly the
model's distribution (a draft is a one-hot proposal: keeping a sample that equals it is the
rejection sampler's rule).

Drafts come from two sources per sequence (`Drafter`):
- the request's `prediction` (OpenAI's predicted outputs): followed from its start while the
  output reproduces it; after a miss, re-found by the longest of the sequence's last 1..n_max
  tokens that occurs in it (the earliest occurrence at or after where the last match ended);
- prompt lookup: the longest of the sequence's last n_max..n_min tokens that occurred before in
  its own tokens (prompt + output) proposes the tokens that followed its latest occurrence.

How many tokens a sequence drafts follows its recent acceptance (`Drafter.budget`); how many
draft tokens a step takes in all follows what a row costs (`StepCosts`): a draft token whose
chance of being kept is below the extra row's cost relative to a decode row's is not run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# A sequence's guess of how likely its next draft token is kept, before any verification
PRIOR_PREDICTION = 0.9
PRIOR_LOOKUP = 0.5
EMA = 0.3  # weight of the newest verification in a sequence's acceptance estimate
RELAX = 0.05  # per step without a draft, the estimate moves this share back to its prior


class NgramIndex:
    """Where each n-gram (n = 1..n_max) of a token list last ended, so the longest suffix of the
    list that occurred before is found in O(n_max), and appending a token costs O(n_max).

    `last_end[gram]` is the end (exclusive) of the gram's latest occurrence that is not the
    list's current suffix."""

    __slots__ = ("n_max", "tokens", "last_end")

    def __init__(self, tokens: Sequence[int], n_max: int) -> None:
        self.n_max = n_max
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        toks, index, n_max = self.tokens, self.last_end, self.n_max
        for t in tokens:
            end = len(toks)  # the grams ending here stop being the suffix
            for n in range(1, min(n_max, end) + 1):
                index[tuple(toks[end - n : end])] = end
            toks.append(t)

    def lookup(self, k: int, n_min: int, n_max: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest suffix of
        n_max..n_min tokens (a pattern repeating up to the end continued); [] if none occurred."""
        toks = self.tokens
        for n in range(min(n_max, self.n_max, len(toks) - 1), n_min - 1, -1):
            end = self.last_end.get(tuple(toks[len(toks) - n :]))
            if end is not None:
                draft = toks[end : end + k]
                # A match that runs into the suffix itself is a repeating pattern of period
                # len - end (7 7 7, or a b c a b c a b): continue it.
                period = len(toks) - end
                while len(draft) < k:
                    draft.append(draft[len(draft) - period])
                return draft
        return []


def find_in(prediction: Sequence[int], suffix: Sequence[int], start: int) -> int | None:
    """The end of the first occurrence of `suffix` in `prediction` at or after `start` (else
    before it); None if it does not occur."""
    n = len(suffix)
    if n == 0:
        return None
    first = suffix[0]
    found = None
    for i in range(len(prediction) - n + 1):
        if prediction[i] == first and list(prediction[i : i + n]) == list(suffix):
            if i + n >= start:
                return i + n
            if found is None:
                found = i + n
    return found


@dataclass(slots=True)
class Drafter:
    """One sequence's draft source and acceptance record."""

    lookup: NgramIndex | None  # prompt lookup over the sequence's tokens; None: off
    prediction: list[int] | None  # the request's predicted output tokens
    n_min: int
    n_max: int
    pred_pos: int | None = 0  # where the next output token should be in the prediction; None: lost
    acceptance: float = 0.0  # estimated chance that a draft token is kept
    prior: float = 0.0  # the estimate before any verification
    misses: int = 0  # verifications in a row that kept no draft token
    skip: int = 0  # steps left without a lookup draft (after misses)
    source: str = ""  # where the pending draft came from ("prediction" or "lookup")
    num_drafted: int = 0
    num_accepted: int = 0
    # Usage of predicted outputs: output tokens the prediction foretold (in step with it), and
    # draft tokens taken from it that verification rejected
    num_prediction_matched: int = 0
    num_prediction_rejected: int = 0
    last_match: int = 0  # where the output last followed the prediction
    num_seen: int = 0  # sequence tokens the drafter has seen

    @classmethod
    def create(
        cls,
        tokens: Sequence[int],
        prediction: list[int] | None,
        lookup: bool,
        n_min: int,
        n_max: int,
    ) -> Drafter:
        index = NgramIndex(tokens, n_max) if lookup else None
        prior = PRIOR_PREDICTION if prediction else PRIOR_LOOKUP
        return cls(
            index, prediction or None, n_min, n_max, acceptance=prior, prior=prior,
            num_seen=len(tokens),
        )  # fmt: skip

    def propose(self, tokens: Sequence[int], num_prompt: int, k: int) -> list[int]:
        """Up to k draft tokens to follow `tokens` (the sequence's prompt + output so far)."""
        self.sync(tokens)
        if k <= 0:
            return []
        if self.prediction is not None:
            draft = self._from_prediction(tokens, num_prompt, k)
            if draft:
                self.source = "prediction"
                return draft
        if self.lookup is not None:
            if self.skip > 0:
                self.skip -= 1
                return []
            draft = self.lookup.lookup(k, self.n_min, self.n_max)
            if draft:
                self.source = "lookup"
                return draft
        return []

    def _from_prediction(self, tokens: Sequence[int], num_prompt: int, k: int) -> list[int]:
        pred = self.prediction
        assert pred is not None
        if self.pred_pos is None:  # re-find the output's tail in the prediction
            output = tokens[num_prompt:]
            for n in range(min(self.n_max, len(output)), 0, -1):
                end = find_in(pred, output[len(output) - n :], self.last_match)
                if end is not None:
                    self.pred_pos = end
                    break
            else:
                return []
        return list(pred[self.pred_pos : self.pred_pos + k])

    def sync(self, tokens: Sequence[int]) -> None:
        """Follow the tokens the sequence (prompt + output) gained since the last call."""
        new = tokens[self.num_seen :]
        if not new:
            return
        if self.lookup is not None:
            self.lookup.extend(new)
        if self.prediction is not None:
            for t in new:
                pos = self.pred_pos
                if pos is not None and pos < len(self.prediction) and self.prediction[pos] == t:
                    self.pred_pos = pos + 1
                    self.last_match = pos + 1
                    self.num_prediction_matched += 1
                else:
                    self.pred_pos = None
        self.num_seen = len(tokens)

    def record(self, drafted: int, accepted: int) -> None:
        """Fold in one verification: `accepted` of `drafted` draft tokens kept."""
        if drafted == 0:
            return
        self.num_drafted += drafted
        self.num_accepted += accepted
        if self.source == "prediction":
            self.num_prediction_rejected += drafted - accepted
        # the per-token chance that explains this run: kept `accepted`, then (maybe) a miss
        rate = accepted / (accepted + (1 if accepted < drafted else 0))
        self.acceptance = (1 - EMA) * self.acceptance + EMA * rate
        if accepted == 0:
            self.misses += 1
            if self.source == "lookup":  # back off: 1, 2, 4, ... steps without lookup drafts
                self.skip = min(64, 1 << min(self.misses - 1, 6))
        else:
            self.misses = 0

    def relax(self) -> None:
        """A step in which this sequence's draft was not worth running: its estimate drifts
        back toward the prior, so a sequence that missed for a while tries again later (the
        text may have turned repetitive)."""
        self.acceptance += RELAX * (self.prior - self.acceptance)

    def budget(self, k_max: int) -> int:
        """Draft tokens worth proposing now: while the chance that all of them are kept stays
        above a tenth, at least one, at most k_max (none when k_max is 0)."""
        if k_max <= 0:  # no room (max_tokens, the context, the step's budget)
            return 0
        a = min(self.acceptance, 0.99)
        if a <= 0.0:
            return 1
        return max(1, min(k_max, int(math.log(0.1) / math.log(a))))


class DraftGate:
    """Whether drafts pay at all, measured: per bucket of decode sequences (a power of 2), the
    tokens a second that decode-only steps gave with drafts and without them.

    `StepCosts` prices a draft row by rows alone; when attention over long contexts dominates a
    step, a verification row costs what a sequence's row costs, which rows alone do not show (64
    edit streams of ~1,000-token contexts ran 8% slower with drafts). The gate compares what
    the steps gave: while drafted steps give less than plain ones, a bucket drafts only one
    step in `EXPLORE` (to keep measuring); while they give more, one step in `EXPLORE` runs
    without drafts (to keep measuring the other side)."""

    EXPLORE = 16
    MARGIN = 0.98  # drafted steps must give at least this share of plain steps' tokens a second
    MIN_STEPS = 4  # steps of each kind a bucket measures before the comparison counts

    __slots__ = ("rates", "counts", "steps")

    def __init__(self) -> None:
        self.rates: dict[tuple[int, bool], float] = {}  # (bucket, drafted) -> tokens a second
        self.counts: dict[tuple[int, bool], int] = {}
        self.steps: dict[int, int] = {}  # bucket -> steps asked about

    @staticmethod
    def bucket(seqs: int) -> int:
        return 1 << max(0, seqs - 1).bit_length()

    def record(self, seqs: int, drafted: bool, tokens: int, seconds: float) -> None:
        if seqs <= 0 or seconds <= 0:
            return
        key = (self.bucket(seqs), drafted)
        rate = tokens / seconds
        n = self.counts.get(key, 0)
        self.counts[key] = n + 1
        # the first steps' plain mean, then a moving average (contexts grow over a run)
        w = 1.0 / (n + 1) if n < 8 else 0.1
        self.rates[key] = rate if n == 0 else (1 - w) * self.rates[key] + w * rate

    def allow(self, seqs: int) -> bool:
        """Whether a step of `seqs` decode sequences may carry drafts."""
        b = self.bucket(seqs)
        k = self.steps[b] = self.steps.get(b, 0) + 1
        if self.counts.get((b, True), 0) < self.MIN_STEPS:
            return True  # (StepCosts first measures the bucket without drafts)
        if self.counts.get((b, False), 0) < self.MIN_STEPS:
            return k % 2 == 0
        wins = self.rates[(b, True)] >= self.MARGIN * self.rates[(b, False)]
        return (k % self.EXPLORE != 0) if wins else (k % self.EXPLORE == 0)
