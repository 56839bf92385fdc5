"""The one loop over a step's sampled tokens on the text side: detokenize, stop strings, deltas.

Text is decoded incrementally against a few tokens of context, and a delta is released only when
it does not end in a broken UTF-8 sequence (U+FFFD); at the end a partial character left over is
released as the tokenizer decodes it (U+FFFD, as a whole-sequence decode gives it). Stop strings are searched in the text and
cut off (with everything after them); while stop strings are set, the last
`max(len(stop)) - 1` characters are held back from streaming, since they may be the start of one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from convoy.engine.request import Request
from convoy.engine.tokenizer import Tokenizer
from convoy.outputs import FinishReason, PositionLogprobs

_CONTEXT_TOKENS = 6


@dataclass(slots=True)
class Detokenizer:
    """Incremental decoding of one sequence's output tokens."""

    tokenizer: Tokenizer
    skip_special_tokens: bool
    tokens: list[int] = field(default_factory=list)  # a little prompt context, then the output
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""

    @classmethod
    def for_prompt(cls, tokenizer: Tokenizer, prompt: list[int], skip_special: bool) -> Detokenizer:
        context = prompt[-_CONTEXT_TOKENS:]
        return cls(tokenizer, skip_special, list(context), 0, len(context))

    def add(self, token_id: int) -> str:
        self.tokens.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the sequence: release what `add` held back for a partial character."""
        return self._advance(final=True) if self.read_offset < len(self.tokens) else ""

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(
            self.tokens[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        full = decode(self.tokens[self.prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            self.text += delta
            return delta
        return ""


@dataclass(slots=True)
class SeqState:
    """Per-sequence output state kept beside the Request."""

    detok: Detokenizer
    hold: int  # characters held back for a possible stop string
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    num_emitted_logprobs: int = 0


@dataclass(slots=True)
class SeqDelta:
    """What one sequence gained this step (or its full state, for cumulative outputs)."""

    req: Request
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finished: bool


class OutputProcessor:
    """Text side of a step: detokenize new tokens, find stop strings, cut deltas.

    Token-level stops (EOS, stop token ids, lengths) are the scheduler's; a stop string found here
    sets the sequence's finish reason and the engine then frees it.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, SeqState] = {}

    def add(self, req: Request) -> None:
        p = req.params
        detok = Detokenizer.for_prompt(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens)
        hold = max((len(s) for s in p.stop), default=1) - 1
        self.states[req.req_id] = SeqState(detok, hold)

    def process(self, reqs: list[Request]) -> list[SeqDelta]:
        """Each sequence here gained `num_step_tokens` tokens this step (none when scoring or
        pooling): one, or several after a verified draft. They are taken one at a time, so a
        stop string ends the sequence at the token that completes it, as plain decoding would;
        the tokens after it are dropped."""
        for req in reqs:
            if req.params.max_tokens == 0:
                continue
            state = self.states[req.req_id]
            p = req.params
            num_new = max(1, req.num_step_tokens)
            new = req.token_ids[len(req.token_ids) - num_new :]
            for j, token_id in enumerate(new):
                state.detok.add(token_id)
                last = j == num_new - 1
                if (
                    p.stop
                    and (not last or req.finish_reason != FinishReason.STOP)
                    and req.num_output_tokens - (num_new - 1 - j) >= p.min_tokens
                ):
                    hit = self._find_stop(state, p.stop, p.include_stop_str_in_output)
                    if hit is not None:  # a stop string wins over a length limit in this token
                        req.finish_reason, req.stop_reason = FinishReason.STOP, hit
                        _drop_after(req, num_new - 1 - j)
                        break
        return [self.delta(req) for req in reqs]

    def delta(self, req: Request) -> SeqDelta:
        """What the sequence has not reported yet (all of it, once finished)."""
        state = self.states[req.req_id]
        finished = req.finish_reason is not None
        if finished and not isinstance(req.stop_reason, str):  # a stop string cut the text
            state.detok.flush()
        text = state.detok.text
        end = len(text) if finished else max(state.num_emitted_chars, len(text) - state.hold)
        out_ids = req.output_token_ids
        logprobs = (
            req.logprobs[state.num_emitted_logprobs :] if req.params.logprobs is not None else None
        )
        delta = SeqDelta(
            req,
            text[state.num_emitted_chars : end],
            out_ids[state.num_emitted_tokens :],
            logprobs,
            finished,
        )
        state.num_emitted_chars, state.num_emitted_tokens = end, len(out_ids)
        state.num_emitted_logprobs = len(req.logprobs)
        if finished:
            del self.states[req.req_id]
        return delta

    @staticmethod
    def _find_stop(state: SeqState, stops: list[str], include: bool) -> str | None:
        text = state.detok.text
        # Only the tail can hold a new match: the last delta plus a stop string's length.
        start = max(0, state.num_emitted_chars - max(len(s) for s in stops))
        best: tuple[int, str] | None = None
        for s in stops:
            pos = text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        pos, s = best
        state.detok.text = text[: pos + len(s)] if include else text[:pos]
        return s


def _drop_after(req: Request, num_tokens: int) -> None:
    """Remove the sequence's last `num_tokens` tokens (after a stop string) and their logprobs."""
    if num_tokens <= 0:
        return
    del req.token_ids[-num_tokens:]
    del req.logprobs[req.num_output_tokens :]
