"""Reasoning models: the `<think>...</think>` block of a reply, split from its content.

A template that mentions `<think>` (Qwen3's, DeepSeek-R1's) has a thinking model behind it, and
`--reasoning-parser auto` (the default) splits its replies: `qwen3` and `deepseek_r1` force the
split on, `none` turns it off. Where the block starts is read from the end of the rendered
prompt (`think_start`):

    prompt ends with an open `<think>`            -> the reply starts inside the block (OPEN)
    prompt ends with a closed `<think>...</think>` -> thinking is off (enable_thinking: false):
                                                     the whole reply is content (OFF)
    otherwise                                     -> the reply may open one itself (MAYBE;
                                                     deepseek_r1: OPEN, as vLLM's parser)

The split (`ReasoningStream`, fed as the reply streams or all at once, the same result): in a
block, the text before `</think>` is reasoning (a leading `<think>` dropped) and the rest,
leading newlines stripped, is content; a reply that does not open a block is all content; a
block never closed (cut by max_tokens) is all reasoning. A tail that may be the start of a
marker is held back until the next piece tells, so a marker split across deltas is found.
No wire types here: serving_chat and serving_responses map this onto theirs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from convoy.api.tool_format import marker_prefix_len
from convoy.sampling_params import SamplingParamsError

if TYPE_CHECKING:
    from convoy.engine.tokenizer import Tokenizer

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# OpenAI's reasoning effort (chat's `reasoning_effort`, Responses' `reasoning.effort`) as a
# thinking template's enable_thinking: `none` and `minimal` answer without thinking
EFFORT_THINKS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True,
                 "xhigh": True, "max": True}  # fmt: skip


def check_reasons(template: str | None, param: str) -> None:
    """A reasoning effort (chat's reasoning_effort, Responses' reasoning.effort) for a model
    whose template does not think: a 400 naming `param`."""
    if not is_thinking_template(template):
        raise SamplingParamsError("this model does not reason", param)


def effort_thinks(effort: object, param: str) -> bool:
    """enable_thinking for an effort; a 400 naming `param` for an unknown one."""
    if not isinstance(effort, str) or effort not in EFFORT_THINKS:
        raise SamplingParamsError(f"{param} must be one of {', '.join(EFFORT_THINKS)}", param)
    return EFFORT_THINKS[effort]


class ThinkStart(enum.Enum):
    """Where a reply starts relative to the think block."""

    OFF = "off"  # no split: all content
    MAYBE = "maybe"  # the reply may open a block itself
    OPEN = "open"  # the prompt opened the block: the reply starts in it


def is_thinking_template(template: str | None) -> bool:
    return template is not None and THINK_OPEN in template


def think_start(parser: str, template: str | None, prompt: str) -> ThinkStart:
    """The reply's start state, from the server's parser setting, the template and the
    rendered prompt."""
    if parser == "none" or (parser == "auto" and not is_thinking_template(template)):
        return ThinkStart.OFF
    tail = prompt.rstrip()
    if tail.endswith(THINK_CLOSE):
        return ThinkStart.OFF
    if tail.endswith(THINK_OPEN) or parser == "deepseek_r1":
        return ThinkStart.OPEN
    return ThinkStart.MAYBE


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """Splits one choice's text, fed as it streams, into reasoning and content.

        maybe --leading `<think>`--> think --`</think>`--> after (newlines dropped) --> content
        maybe --anything else--> content;  open prompt: starts in think

    `close_end`: where `</think>` ends in the text fed (None until it is seen).
    """

    __slots__ = ("_state", "_held", "num_chars", "close_end")

    def __init__(self, start: ThinkStart) -> None:
        self._state = {ThinkStart.OFF: "content", ThinkStart.MAYBE: "maybe"}.get(start, "think")
        self._held = ""  # text not yet assigned
        self.num_chars = 0  # characters fed
        self.close_end: int | None = None  # where `</think>` ends in the text fed

    @property
    def is_reasoning(self) -> bool:
        """Was any text read as reasoning (a block opened)?"""
        return self._state in ("think", "after") or self.close_end is not None

    def feed(self, piece: str, is_last: bool = False) -> ReasoningDelta:
        """The reasoning and content `piece` completes; `is_last`: the choice ends with it, so
        nothing is held back."""
        self.num_chars += len(piece)
        self._held += piece
        out = ReasoningDelta()
        while self._step(out):
            pass
        if is_last:
            held, self._held = self._held, ""
            if self._state == "think":
                out.reasoning += held
            elif self._state != "after":
                out.content += held
        return out

    def _step(self, out: ReasoningDelta) -> bool:
        """Consume what the held text decides; True when the state changed (step again)."""
        held = self._held
        if self._state == "content":
            out.content += held
            self._held = ""
            return False
        if self._state == "maybe":
            stripped = held.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._held = stripped[len(THINK_OPEN) :]
                self._state = "think"
                return True
            if THINK_OPEN.startswith(stripped):  # empty, or a prefix of the marker: wait
                return False
            self._state = "content"
            return True
        if self._state == "think":
            end = held.find(THINK_CLOSE)
            if end < 0:
                keep = marker_prefix_len(held, THINK_CLOSE)
                out.reasoning += held[: len(held) - keep]
                self._held = held[len(held) - keep :]
                return False
            out.reasoning += held[:end]
            self._held = held[end + len(THINK_CLOSE) :]
            self.close_end = self.num_chars - len(self._held)
            self._state = "after"
            return True
        # after `</think>`: newlines dropped until the content's first other character
        self._held = held.lstrip("\r\n")
        if self._held:
            self._state = "content"
            return True
        return False


def split_reasoning(start: ThinkStart, text: str) -> tuple[str | None, str, ReasoningStream]:
    """(reasoning or None when no block was read, content, the stream that split them) of a
    whole reply."""
    stream = ReasoningStream(start)
    part = stream.feed(text, is_last=True)
    return (part.reasoning if stream.is_reasoning else None), part.content, stream


def num_reasoning_tokens(
    tokenizer: Tokenizer,
    token_ids: list[int],
    stream: ReasoningStream,
    skip_special_tokens: bool = True,
) -> int:
    """The reply's reasoning tokens: up to and including the one that completes `</think>`
    (the shortest prefix of the ids whose decoded text holds the marker, by bisection: its
    first `</think>` is the one that closed the block), all of them for a block never closed,
    0 without a block."""
    if not stream.is_reasoning:
        return 0
    if stream.close_end is None:
        return len(token_ids)
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        text = tokenizer.decode(token_ids[:mid], skip_special_tokens=skip_special_tokens)
        if THINK_CLOSE in text:
            hi = mid
        else:
            lo = mid + 1
    return lo
