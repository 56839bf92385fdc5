"""Reading a batch input file: one streaming pass, a line at a time, never the whole file.

A request line is `{"custom_id": str, "method": "POST", "url": <endpoint>, "body": {...}}`;
blank lines are skipped. `index` counts request lines (0-based: the ledger's key), `number` is
the 1-based line of the file (what errors name).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convoy.api.protocol_batch import BatchError

MAX_BATCH_LINES = 50_000  # OpenAI's limit of requests per batch
MAX_REPORTED_ERRORS = 100  # a failed batch lists at most this many


@dataclass(slots=True)
class InputLine:
    index: int
    number: int
    custom_id: str
    body: str  # the request body as JSON text, parsed like an HTTP body


class LineError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param

    def at(self, number: int) -> BatchError:
        return BatchError(code=self.code, line=number, message=self.message, param=self.param)


def raw_lines(path: Path, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(1-based line number, bytes) of each non-blank line; None for a line over the limit."""
    with open(path, "rb") as f:
        number = 0
        while True:
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                return
            number += 1
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # skip the rest of the long line
                    raw = f.readline(1 << 20)
                yield number, None
                continue
            if raw.strip():
                yield number, raw


def parse_line(raw: bytes | None, endpoint: str, model: str) -> tuple[str, str]:
    """(custom_id, body JSON) of one line, or LineError saying what is wrong with it."""
    return check_line(load_line(raw), endpoint, model)


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


class LineObject(dict[str, Any]):
    """A loaded line (its members); `body_text` is its `body` member's JSON text as the line
    holds it (None without one)."""

    body_text: str | None = None


def load_line(raw: bytes | None) -> LineObject:
    """The line as a JSON object, or LineError (too long, not JSON, not an object).

    Parsed member by member so that the body's own text is kept (`body_text`): the body is
    validated from the client's text later, never serialized again (json.dumps of a 32 MiB
    prompt held the GIL, and so the event loop, for 0.1-0.2 s).
    """
    if raw is None:
        raise LineError("line_too_long", "the line is longer than the request size limit")
    try:
        line = _load_object(raw.decode("utf-8").removeprefix("\ufeff"))  # a BOM, as json.loads
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LineError("invalid_json_line", f"the line is not valid JSON: {e}") from None
    if line is None:
        raise LineError("invalid_json_line", "the line is not a JSON object")
    return line


def _skip(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()  # type: ignore[union-attr]  # matches the empty string


def _expect(text: str, pos: int, char: str, what: str) -> int:
    if not text.startswith(char, pos):
        raise json.JSONDecodeError(f"Expecting {what}", text, pos)
    return _skip(text, pos + 1)


def _load_object(text: str) -> LineObject | None:
    """json.loads(text) when it is an object (None: valid JSON of another kind); a duplicated
    key keeps its last value, as json.loads does."""
    pos = _skip(text, 0)
    if not text.startswith("{", pos):
        _, end = _DECODER.raw_decode(text, pos)  # raises for invalid JSON
        _expect_end(text, end)
        return None
    line = LineObject()
    pos = _skip(text, pos + 1)
    is_closed = text.startswith("}", pos)
    pos += is_closed
    while not is_closed:
        if not text.startswith('"', pos):
            raise json.JSONDecodeError(
                "Expecting property name enclosed in double quotes", text, pos
            )
        key, pos = _DECODER.raw_decode(text, pos)
        start = _expect(text, _skip(text, pos), ":", "':' delimiter")
        line[key], pos = _DECODER.raw_decode(text, start)
        if key == "body":
            line.body_text = text[start:pos]
        pos = _skip(text, pos)
        is_closed = text.startswith("}", pos)
        pos = pos + 1 if is_closed else _expect(text, pos, ",", "',' delimiter")
    _expect_end(text, pos)
    return line


def _expect_end(text: str, pos: int) -> None:
    if _skip(text, pos) != len(text):
        raise json.JSONDecodeError("Extra data", text, pos)


def check_line(line: dict[str, Any], endpoint: str, model: str) -> tuple[str, str]:
    """(custom_id, body JSON) of a loaded line meant for `endpoint`, or LineError."""
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_required_parameter", "custom_id must be a string", "custom_id")
    if line.get("method") != "POST":
        raise LineError("invalid_method", "method must be POST", "method")
    if line.get("url") != endpoint:
        raise LineError(
            "mismatched_endpoint", f"url must be the batch's endpoint {endpoint}", "url"
        )
    body = line.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "body must be a JSON object", "body")
    if body.get("model", model) != model:
        raise LineError(
            "model_not_found", f"the model {body['model']!r} is not served here", "body.model"
        )
    if body.get("stream") is True:
        raise LineError("invalid_request", "stream is not supported in a batch", "body.stream")
    # A plain dict (a line that crossed to a Ray actor as JSON data) has no body text kept.
    body_text = line.body_text if isinstance(line, LineObject) else None
    return custom_id, body_text if body_text is not None else json.dumps(body)


def request_lines(
    path: Path, endpoint: str, model: str, max_line_bytes: int
) -> Iterator[InputLine | tuple[int, LineError]]:
    """Every request line, parsed; a bad one as (line number, LineError). Duplicated custom_ids
    and lines past MAX_BATCH_LINES are errors too."""
    seen: set[str] = set()
    index = 0
    for number, raw in raw_lines(path, max_line_bytes):
        try:
            if index >= MAX_BATCH_LINES:
                raise LineError("too_many_requests", f"more than {MAX_BATCH_LINES} requests")
            custom_id, body = parse_line(raw, endpoint, model)
            if custom_id in seen:
                raise LineError(
                    "duplicate_custom_id", f"custom_id {custom_id!r} is used twice", "custom_id"
                )
        except LineError as e:
            yield number, e
            index += 1
            continue
        seen.add(custom_id)
        yield InputLine(index, number, custom_id, body)
        index += 1


def validate(
    path: Path, endpoint: str, model: str, max_line_bytes: int
) -> tuple[int, list[BatchError]]:
    """The number of request lines and the first errors (none: the file can run)."""
    total, errors = 0, list[BatchError]()
    for item in request_lines(path, endpoint, model, max_line_bytes):
        total += 1
        if isinstance(item, tuple) and len(errors) < MAX_REPORTED_ERRORS:
            errors.append(item[1].at(item[0]))
    if total == 0:
        errors.append(BatchError(code="empty_file", message="the input file has no requests"))
    return total, errors
