"""One constrained sequence's matcher, and a step's bitmask rows.

Bitmask layout (llguidance's): one int32 row per constrained sequence, ceil(V / 32) words; bit
`t % 32` of word `t // 32` allows token t. The engine fills a step's rows before the model runs
and hands each row to the worker as plain data; the sampler turns it into a logits mask.

    word 0                          word 1
    | bit 0 ... bit 31 |            | bit 0 ... bit 31 |  ...
      token 0 .. 31                   token 32 .. 63
"""

from __future__ import annotations

import llguidance
import numpy as np
import numpy.typing as npt
from llguidance.numpy import fill_next_token_bitmask

from convoy.structured.params import StructuredOutputsError

Bitmask = npt.NDArray[np.int32]
MAX_ERROR_CHARS = 400


class GrammarMatcher:
    """Where one sequence stands in its grammar. Advanced with every token the sequence gains
    (preemption keeps output tokens, so it keeps the matcher as is). Not thread-safe: the
    engine thread alone uses it."""

    __slots__ = ("_matcher", "param")

    def __init__(self, matcher: llguidance.LLMatcher, param: str) -> None:
        self._matcher = matcher
        self.param = param  # the request field the constraint came from

    def fill(self, bitmask: Bitmask, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (EOS only where it may end)."""
        fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the matcher failed (a limit, or a token the
        grammar does not allow), which it then stays."""
        return self._matcher.consume_token(token_id)

    def validate(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar allows from here (nothing consumed)."""
        n: int = self._matcher.validate_tokens(token_ids)
        return n

    def draft_masks(self, token_ids: list[int], bitmask: Bitmask) -> None:
        """Row i of `bitmask`: the tokens allowed after `token_ids[: i + 1]` (a draft's
        positions), from a copy: this matcher is not advanced. Past a token the grammar does
        not take, the rows repeat the last mask (those positions are never kept)."""
        copy = self._matcher.deep_copy()
        for i, token_id in enumerate(token_ids):
            if copy.is_error() or not copy.consume_token(token_id):
                bitmask[i:] = bitmask[i - 1] if i else 0
                return
            fill_next_token_bitmask(copy, bitmask, i)

    @property
    def is_finished(self) -> bool:
        """The grammar has fully matched: nothing may follow (EOS at most)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def is_failed(self) -> bool:
        return self._matcher.is_error()

    def error(self) -> StructuredOutputsError:
        """Why the matcher failed, for the client."""
        reason = error_text(self._matcher.get_error())
        return StructuredOutputsError(
            f"the output could not be kept to the constraint: {reason}", self.param
        )


def fill_bitmasks(matchers: list[GrammarMatcher], num_words: int) -> Bitmask:
    """One step's rows: row i holds what matchers[i] allows next. Sequential on purpose: a row
    takes ~0.01-0.2 ms for typical schemas, less than a thread pool's hand-off."""
    bitmask = np.zeros((len(matchers), num_words), dtype=np.int32)
    for i, m in enumerate(matchers):
        m.fill(bitmask, i)
    return bitmask


def allowed_token_ids(row: Bitmask) -> list[int]:
    """The token ids a bitmask row allows, ascending."""
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).tolist()


def error_text(error: str) -> str:
    """An llguidance error as a client reads it: without the marker of its omitted parser state,
    bounded in length."""
    error = error.replace("<non-verbose/>", "").strip() or "unknown error"
    if len(error) > MAX_ERROR_CHARS:
        error = error[:MAX_ERROR_CHARS] + "..."
    return error
