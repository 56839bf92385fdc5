"""StructuredOutputsParams: what one request constrains its output to, checked and bounded.

Field names are vLLM's (`json`, `regex`, `choice`, `grammar`, `json_object`; exactly one set).
The bounds below keep one request from making the server compile or match something huge: a
compiled grammar is cached and every constrained sequence matches it once per step, so they
bound memory and step time for everyone. They are the first line; llguidance's own limits
(compiler.GRAMMAR_LIMITS) bound what gets past them.
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, field
from typing import Any, NoReturn

MAX_SCHEMA_BYTES = 64 << 10  # a JSON schema, serialized compactly (UTF-8)
MAX_SCHEMA_DEPTH = 64  # nested JSON objects / arrays in the schema document
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 1024  # llguidance's parser refuses a rule of more than 2,000 alternatives
MAX_CHOICE_CHARS = 1024  # per choice
MAX_GRAMMAR_CHARS = 64 << 10

KINDS = ("json", "regex", "choice", "grammar", "json_object")
THINK_MODES = ("maybe", "open")  # see StructuredOutputsParams.think


class StructuredOutputsError(ValueError):
    """A constraint is malformed, too large or does not compile; `param` names the request field
    it came from (`response_format`, `structured_outputs`, `guided_json`, ...)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class StructuredOutputsParams:
    """One constraint on the generated text. Validated on construction.

    json: a JSON schema (an object, or its JSON text); regex: the whole output matches it (Rust
    regex syntax); choice: the output is one of these strings; grammar: llguidance's Lark
    dialect, or a GBNF grammar (llama.cpp's, converted); json_object: any JSON object.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    param: str = "structured_outputs"  # the request field it came from: what errors name
    # A reasoning model's think block before the constrained text: None (none), "maybe" (the
    # output may open `<think>` ... `</think>` first), "open" (it starts inside one, which
    # `</think>` closes). The block's text is free; newlines may follow it.
    think: str | None = None
    # (kind, canonical text): equal keys compile to the same grammar
    cache_key: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.think is not None and self.think not in THINK_MODES:
            self._fail(f"think must be one of {', '.join(THINK_MODES)}, got {self.think!r}")
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            got = ", ".join(kinds) or "none"
            self._fail(f"set exactly one of {', '.join(KINDS)} (got {got})")
        kind = kinds[0]
        if kind == "json":
            self.json = self._schema(self.json)
            text = _canonical(self.json)
        elif kind == "regex":
            text = self._text(self.regex, "regex", MAX_REGEX_CHARS)
        elif kind == "choice":
            text = _canonical(self._choices(self.choice))
        elif kind == "grammar":
            text = self._text(self.grammar, "grammar", MAX_GRAMMAR_CHARS)
        else:
            text = ""
        self.cache_key = (kind, text)

    @property
    def kind(self) -> str:
        return self.cache_key[0]

    def _schema(self, value: object) -> dict[str, Any]:
        if isinstance(value, str):
            if len(value.encode()) > MAX_SCHEMA_BYTES:
                self._fail(f"the JSON schema is larger than {MAX_SCHEMA_BYTES} bytes")
            try:
                value = jsonlib.loads(value)
            except ValueError as e:
                self._fail(f"the JSON schema is not valid JSON: {e}")
        if not isinstance(value, dict):
            self._fail("the JSON schema must be a JSON object")
        if not _depth_at_most(value, MAX_SCHEMA_DEPTH):
            self._fail(f"the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
        try:
            size = len(_canonical(value).encode())
        except (TypeError, ValueError) as e:  # NaN / Infinity, or not JSON data at all
            self._fail(f"the JSON schema is not JSON data: {e}")
        if size > MAX_SCHEMA_BYTES:
            self._fail(f"the JSON schema is larger than {MAX_SCHEMA_BYTES} bytes")
        return value

    def _text(self, value: object, what: str, limit: int) -> str:
        if not isinstance(value, str) or not value:
            self._fail(f"the {what} must be a non-empty string")
        if len(value) > limit:
            self._fail(f"the {what} is longer than {limit} characters")
        return value

    def _choices(self, value: object) -> list[str]:
        if not isinstance(value, list) or not value:
            self._fail("choice must be a non-empty list of strings")
        if len(value) > MAX_CHOICES:
            self._fail(f"choice may hold at most {MAX_CHOICES} strings")
        for c in value:
            if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
                self._fail(f"each choice must be a string of 1 to {MAX_CHOICE_CHARS} characters")
        return value

    def _fail(self, message: str) -> NoReturn:
        raise StructuredOutputsError(message, self.param)


def _canonical(value: object) -> str:
    """Compact JSON, key order kept: a schema's properties are generated in its order, so two
    schemas that differ only in key order are different constraints."""
    return jsonlib.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _depth_at_most(value: object, limit: int) -> bool:
    """Is `value` nested at most `limit` containers deep? Iterative: a hostile document is
    deeper than Python's recursion limit."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > limit:
                return False
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return True
