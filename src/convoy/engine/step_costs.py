"""What a step costs by its rows (tokens computed), measured (`StepCosts`), and how large the
next step is against --step-target-ms (`StepSizer`); the step costs also price draft rows
(engine/draft_planner.py). No torch here."""

from __future__ import annotations

import math


class StepCosts:
    """Measured step time by rows (tokens computed in the step), in power-of-two buckets, so the
    scheduler can tell what one more row costs against what a row of the step costs now.

    While a step is memory-bound, more rows cost little (the weights are read once for all of
    them); once compute-bound, each row costs about as much as the step's rows on average, and
    a draft token only pays if it is kept with at least that ratio. Buckets above the largest
    measured one are explored one at a time (`explore_cap`)."""

    __slots__ = ("rows", "seconds")

    def __init__(self) -> None:
        # bucket (rows rounded up to a power of 2) -> moving averages of rows and seconds
        self.rows: dict[int, float] = {}
        self.seconds: dict[int, float] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def record(self, rows: int, seconds: float) -> None:
        if rows <= 0:
            return
        b = self.bucket(rows)
        if b not in self.seconds:
            self.rows[b], self.seconds[b] = float(rows), seconds
            return
        self.rows[b] = 0.8 * self.rows[b] + 0.2 * rows
        self.seconds[b] = 0.8 * self.seconds[b] + 0.2 * seconds

    def threshold(self, rows: int) -> float:
        """The least chance of being kept that makes a draft row worth adding to a step of
        `rows` rows: (seconds one more row adds) / (seconds per row of the step as it is),
        from this bucket and the next measured one above it. While this bucket is not measured
        yet, no draft (inf: a step of this size without drafts is measured first); while none
        above it is, 0 (try, within `explore_cap`)."""
        b = self.bucket(rows)
        if b not in self.seconds:
            return math.inf
        above = [c for c in self.seconds if c > b]
        if not above:
            return 0.0
        c = min(above)
        r0, t0, r1, t1 = self.rows[b], self.seconds[b], self.rows[c], self.seconds[c]
        if t0 <= 0 or r1 <= r0:
            return 0.0
        marginal = max(0.0, t1 - t0) / (r1 - r0)
        return marginal / (t0 / r0)

    def explore_cap(self, rows: int) -> int | None:
        """The most rows a step of `rows` rows may grow to by drafts while nothing above its
        bucket is measured (one bucket up), else None (no cap but the thresholds)."""
        b = self.bucket(rows)
        if any(c > b for c in self.seconds):
            return None
        return 2 * b

    def predict(self, rows: int) -> float | None:
        """Seconds a decode step of `rows` rows takes, at the time per row of its bucket (the
        nearest measured below while its own is not: a larger step's rows cost no more); None
        while none is measured."""
        known = [c for c in self.seconds if c <= self.bucket(rows)]
        if not known:
            return None
        top = max(known)
        return rows * self.seconds[top] / self.rows[top]

    def row_cap(self, rows: int, target: float, min_efficiency: float) -> int | None:
        """The most rows a step should carry so that it takes about `target` seconds, when
        `rows` rows would take longer; None for no cap.

        The full step's time is predicted from its bucket's time per row (the nearest measured
        bucket below while its own is not). Caps are powers of two, tried downward from half of
        `rows`' bucket: a size not measured yet is returned as is (one step that size measures
        it); a size whose time per row is worse than `min_efficiency` of the full step's (the
        weights' read no longer shared by enough rows) ends the search at the last size that
        was not. So a step is split only where it is compute-bound, where splitting costs
        little."""
        b = self.bucket(rows)
        full = self.predict(rows)
        if full is None or full <= target:
            return None  # (nothing measured: the full step first)
        per_row = full / rows
        cap = None
        c = b // 2
        while c >= 1:
            if c not in self.seconds:
                return c
            per_row_c = self.seconds[c] / self.rows[c]
            if per_row < min_efficiency * per_row_c:
                return cap
            cap = c
            if per_row_c * c <= target:
                return c
            c //= 2
        return cap



class StepSizer:
    """How large the next step is (--step-target-ms, `target` seconds; 0: off), from the
    measured step costs: a decode step predicted longer than the target is cut to fewer rows
    where that costs little (`cap`), and newcomers beside such a step get a step of their own
    (`lane`)."""

    # A step is cut only while its time per row stays within 1 / this of the whole step's:
    # where it is compute-bound, not where every row reads the weights anew
    MIN_EFFICIENCY = 0.85
    # Below this many rows a CPU step is bound by reading the weights: never cut to fewer, and
    # no fast lane beside fewer (a newcomer's prompt costs them little more)
    MIN_ROWS = 16

    def __init__(self, target: float) -> None:
        self.costs = StepCosts()
        self.target = target
        self.last_lane = -1  # the last step that ran only prompt work

    def cap(self, num_running: int) -> int | None:
        """Tokens for the next step when a step of every running sequence is predicted longer
        than the target and a smaller one costs little more per row (`StepCosts.row_cap`);
        else None."""
        if self.target <= 0 or num_running <= self.MIN_ROWS:
            return None
        cap = self.costs.row_cap(num_running, self.target, self.MIN_EFFICIENCY)
        return None if cap is None else max(cap, self.MIN_ROWS)

    def lane(self, step: int, num_running: int, newcomers: bool) -> bool:
        """Does step number `step` run only prompt work? When interactive newcomers wait and a
        step of the running sequences is predicted longer than the target (never two such
        steps in a row, so decode rows are never starved)."""
        if self.target <= 0 or not newcomers or num_running < self.MIN_ROWS:
            return False
        if self.last_lane == step - 1:
            return False
        full = self.costs.predict(num_running)
        return full is not None and full > self.target
