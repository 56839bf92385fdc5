"""The tool-call text format (Hermes / Qwen 2.5's): how tools are described to a model, the
grammar that keeps its calls well formed, and how its text is split back into calls.

A model answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

after any text of its own, with more calls on the following lines when parallel calls are
allowed. Tool results come back to it in a user turn as `<tool_response>...</tool_response>`.
The grammar (llguidance's Lark) writes the name first and embeds each function's parameters
schema with `%json`, one per function (a schema's `$ref`s resolve against its own root); with
`auto` the text is free until the opening marker, a lazy lexeme, after which the call is
constrained. No wire types here: the serving code maps requests and responses onto this.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from convoy.structured.compiler import JSON_OPTIONS

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
CALL_SEPARATOR = "\n"  # between two calls

# The grammar: `start` is chosen by the mode; one `fnI` / `argsI` pair per function.
_GRAMMAR_HEAD = """%llguidance {}
calls: call ("\\n" call)*
call: "<tool_call>" body
body: "\\n{\\"name\\": " (NAMES) "}\\n</tool_call>"
prefix[lazy]: TEXT "<tool_call>"
TEXT: /(.|\\n)*/
"""
_START = {
    # (mode, parallel) -> the start rule
    ("required", True): "start: calls",
    ("required", False): "start: call",
    ("auto", True): 'start: TEXT | prefix body ("\\n" call)*',
    ("auto", False): "start: TEXT | prefix body",
}

# What parsing expects around a call's JSON (whitespace-tolerant; the grammar writes it exactly).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*')
_ARGS_KEY = re.compile(r'\s*,\s*"arguments"\s*:\s*')
_TAIL = re.compile(r"\s*\}\s*" + re.escape(CLOSE))
_DECODER = json.JSONDecoder()


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The system-message section that lists the functions (one JSON object a line) and teaches
    the call format; appended to the first system message, or the system message itself."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to answer the user. The functions are listed"
        " within <tools></tools>, one JSON object a line:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "To call a function, answer with a JSON object holding its name and its arguments,"
        " within <tool_call></tool_call>:\n"
        f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}'
    )


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (`arguments`: the JSON text, inserted as is)."""
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CLOSE}'


def tool_response_text(contents: list[str]) -> str:
    """Consecutive tool results, as the user turn that hands them back to the model."""
    return "\n".join(f"<tool_response>\n{c}\n</tool_response>" for c in contents)


def tools_grammar(functions: list[tuple[str, dict[str, Any]]], mode: str, parallel: bool) -> str:
    """The Lark grammar of a reply to `functions` ((name, parameters schema) pairs).

    mode `required`: the whole reply is one call (or several, with `parallel`); `auto`: free
    text, or text then `<tool_call>` and the call(s). Names must be JSON-safe identifiers
    (the wire model checks `^[a-zA-Z0-9_-]{1,64}$`)."""
    names = " | ".join(f"fn{i}" for i in range(len(functions)))
    lines = [_GRAMMAR_HEAD.replace("NAMES", names) + _START[(mode, parallel)]]
    for i, (name, schema) in enumerate(functions):
        head = json.dumps(f'"{name}", "arguments": ')
        lines.append(f"fn{i}: {head} args{i}")
        lines.append(f"args{i}: %json {json.dumps(_with_json_options(schema), ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def _with_json_options(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with the JSON layout structured outputs use (its own x-guidance wins)."""
    own = schema.get("x-guidance")
    options = {**JSON_OPTIONS, **own} if isinstance(own, dict) else JSON_OPTIONS
    return {**schema, "x-guidance": options}


# -- parsing -----------------------------------------------------------------------------------


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # the JSON text as generated


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedCall]] | None:
    """(content before the calls, or None if only whitespace; the calls), or None when the text
    is not text-then-complete-calls (no marker, or a call cut short or malformed)."""
    start = text.find(OPEN)
    if start < 0:
        return None
    calls: list[ParsedCall] = []
    pos = start
    while pos < len(text):
        if not text.startswith(OPEN, pos):
            return None
        parsed = _parse_call(text, pos + len(OPEN))
        if parsed is None:
            return None
        call, pos = parsed
        calls.append(call)
        pos = _skip_space(text, pos)
    return text[:start].rstrip() or None, calls


def split_reply(text: str) -> tuple[str | None, list[ParsedCall]]:
    """A whole reply as its stream sends it: (the content, or None if empty; the calls
    started, the last one's arguments as far as they were generated). Where the text parses as
    complete calls this is parse_tool_calls' answer; a call cut short (max_tokens, a stop
    string) keeps the calls before it and its own truncated arguments, as OpenAI's API does."""
    stream = ToolCallStream()
    content, deltas = stream.feed(text)
    content += stream.finish()
    calls: list[ParsedCall] = []
    for d in deltas:
        if d.name is not None:
            calls.append(ParsedCall(d.name, d.arguments))
        else:
            calls[d.index].arguments += d.arguments
    return content or None, calls


def is_complete(arguments: str) -> bool:
    """Whether a call's arguments were generated to their end (a JSON value)."""
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


def _parse_call(text: str, pos: int) -> tuple[ParsedCall, int] | None:
    """The call whose JSON starts at `pos` (after the marker) and the index after its CLOSE."""
    head = _call_head(text, pos)
    if head is None:
        return None
    name, pos = head
    end = _json_value_end(text, pos)
    if end is None or text[pos] != "{":
        return None
    tail = _TAIL.match(text, end)
    if tail is None:
        return None
    return ParsedCall(name, text[pos:end]), tail.end()


def _call_head(text: str, pos: int) -> tuple[str, int] | None:
    """`{"name": "<name>", "arguments": ` at `pos`: the name and where the arguments start."""
    m = _HEAD.match(text, pos)
    if m is None:
        return None
    try:
        name, end = _DECODER.raw_decode(text, m.end())
    except ValueError:
        return None
    key = _ARGS_KEY.match(text, end)
    if key is None or not isinstance(name, str):
        return None
    return name, key.end()


def _json_value_end(text: str, pos: int) -> int | None:
    """Where the JSON object or array starting at `pos` ends (exclusive), None if it does not
    end within `text`. Only brackets outside strings count, so malformed insides pass: the
    grammar made them."""
    scanner = _JsonScanner()
    end = scanner.feed(text, pos)
    return end if scanner.is_done else None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class _JsonScanner:
    """Tracks bracket depth through a JSON value fed in pieces: when it is done."""

    __slots__ = ("depth", "in_string", "escaped", "is_done")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = self.is_done = False

    def feed(self, text: str, pos: int) -> int:
        """Scan text[pos:]; the index just past the value's end, or len(text) if not done."""
        for i in range(pos, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.is_done = True
                    return i + 1
        return len(text)


# -- streaming ---------------------------------------------------------------------------------


@dataclass(slots=True)
class CallDelta:
    index: int  # the call's position in the reply, from 0
    name: str | None  # set on a call's first delta only (its arguments then "")
    arguments: str  # the next piece of the arguments' JSON text


class ToolCallStream:
    """Splits one choice's text, fed as it streams, into content and call deltas.

        text --OPEN--> head --`{"name": "...", "arguments": `--> args --value ends--> tail
        --`}` CLOSE--> between --OPEN--> head ...

    Content stops before the marker, never shows any part of it (a tail that may be the start
    of the marker is held back) and loses the whitespace just before it, as parse_tool_calls'
    content does; a call's arguments stream as generated. Text that never becomes a call is
    handed back as content by `finish`.
    """

    __slots__ = ("text", "_pos", "_content_end", "_state", "_scanner", "num_calls")

    def __init__(self) -> None:
        self.text = ""  # everything fed so far
        self._pos = 0  # parsed up to here
        self._content_end = 0  # content sent up to here
        self._state = "text"
        self._scanner = _JsonScanner()
        self.num_calls = 0  # calls started

    def feed(self, piece: str) -> tuple[str, list[CallDelta]]:
        """The content and call deltas that `piece` completes."""
        self.text += piece
        content: list[str] = []
        deltas: list[CallDelta] = []
        while _STEPS[self._state](self, content, deltas):
            pass
        return "".join(content), deltas

    def finish(self) -> str:
        """The content still held back, at the end of the choice: the rest of the text when no
        call started (a marker that led nowhere is text after all), else nothing."""
        if self.num_calls:
            return ""
        rest = self.text[self._content_end :]
        self._content_end = len(self.text)
        return rest

    def _send(self, content: list[str], end: int) -> None:
        """Send the content up to `end`, less its trailing whitespace (held back)."""
        sent = self.text[self._content_end : end].rstrip()
        content.append(sent)
        self._content_end += len(sent)

    def _text(self, content: list[str], deltas: list[CallDelta]) -> bool:
        start = self.text.find(OPEN, self._content_end)
        if start < 0:
            self._send(content, len(self.text) - marker_prefix_len(self.text))
            return False
        self._send(content, start)
        self._pos, self._state = start + len(OPEN), "head"
        return True

    def _head(self, content: list[str], deltas: list[CallDelta]) -> bool:
        head = _call_head(self.text, self._pos)
        if head is None or head[1] == len(self.text):  # more whitespace may come: wait
            return False
        name, self._pos = head
        deltas.append(CallDelta(self.num_calls, name, ""))
        self.num_calls += 1
        self._scanner, self._state = _JsonScanner(), "args"
        return True

    def _args(self, content: list[str], deltas: list[CallDelta]) -> bool:
        end = self._scanner.feed(self.text, self._pos)
        if end > self._pos:
            piece = self.text[self._pos : end]
            last = deltas[-1] if deltas else None
            if last is not None and last.name is None and last.index == self.num_calls - 1:
                last.arguments += piece
            else:
                deltas.append(CallDelta(self.num_calls - 1, None, piece))
            self._pos = end
        if not self._scanner.is_done:
            return False
        self._state = "tail"
        return True

    def _tail(self, content: list[str], deltas: list[CallDelta]) -> bool:
        tail = _TAIL.match(self.text, self._pos)
        if tail is None:
            return False
        self._pos, self._state = tail.end(), "between"
        return True

    def _between(self, content: list[str], deltas: list[CallDelta]) -> bool:
        pos = _skip_space(self.text, self._pos)
        if not self.text.startswith(OPEN, pos):
            return False
        self._pos, self._state = pos + len(OPEN), "head"
        return True


_STEPS = {
    "text": ToolCallStream._text,
    "head": ToolCallStream._head,
    "args": ToolCallStream._args,
    "tail": ToolCallStream._tail,
    "between": ToolCallStream._between,
}


def marker_prefix_len(text: str, marker: str = OPEN) -> int:
    """The length of the longest proper prefix of `marker` that `text` ends with."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
