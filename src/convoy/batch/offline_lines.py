"""How `convoy batch` reads its input: forgiving, one line at a time, the model known late.

    IN.jsonl --scan--> ScannedLine (loaded, keyed) --prepare(model)--> InputLine | LineResult

`scan` sees the whole file (so a custom_id used twice is caught however far apart the two
lines are) but needs no engine; `prepare` needs the served model name, so it runs where the
engine is: in `offline.py`'s process, or in a cluster actor after a shard crossed to it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from convoy.api.protocol_batch import ENDPOINTS
from convoy.batch.executor import LineResult, line_error_result
from convoy.batch.lines import (
    InputLine,
    LineError,
    LineObject,
    check_line,
    load_line,
    raw_lines,
)


@dataclass(slots=True)
class ScannedLine:
    """One line of the input as the scan sees it, before the model is known."""

    number: int  # 1-based line of the file
    custom_id: str | None  # a string seen first here: the line's key; else the number is
    line: LineObject | dict[str, object] | LineError  # a plain dict once it crossed to Ray

    @property
    def endpoint(self) -> str:
        """The endpoint whose run answers this line: its url, else the first endpoint (which
        answers the lines that name no endpoint or cannot be read)."""
        url = self.line.get("url") if isinstance(self.line, dict) else None
        return url if isinstance(url, str) and url in ENDPOINTS else ENDPOINTS[0]


def scan(path: Path, max_line_bytes: int) -> Iterator[ScannedLine]:
    """Every non-blank line, loaded. A custom_id used before is a duplicate: that line gets no
    key of its own, so each custom_id names one answer."""
    seen: set[str] = set()
    for number, raw in raw_lines(path, max_line_bytes):
        try:
            line = load_line(raw)
        except LineError as e:
            yield ScannedLine(number, None, e)
            continue
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            yield ScannedLine(number, None, line)  # check_line says what is wrong
        elif custom_id in seen:
            message = f"custom_id {custom_id!r} is used by an earlier line"
            yield ScannedLine(number, None, LineError("duplicate_custom_id", message, "custom_id"))
        else:
            seen.add(custom_id)
            yield ScannedLine(number, custom_id, line)


def prepare(item: ScannedLine, model: str) -> InputLine | LineResult:
    """The line to run (its index is its line number), or its error result when it cannot run:
    unreadable, a duplicate, an unknown url, or what `check_line` refuses."""
    try:
        if isinstance(item.line, LineError):
            raise item.line
        if item.line.get("url") not in ENDPOINTS:
            raise LineError("invalid_url", f"url must be one of {', '.join(ENDPOINTS)}")
        custom_id, body = check_line(item.line, item.endpoint, model)
    except LineError as e:
        located = LineError(e.code, f"line {item.number}: {e.message}", e.param)
        return line_error_result(item.number, located, item.custom_id)
    return InputLine(item.number, item.number, custom_id, body)
