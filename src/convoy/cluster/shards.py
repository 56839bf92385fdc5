"""A `convoy batch --ray` job cut into shards, and the plain data that crosses to the actors.

    IN.jsonl --scan (driver: sees every line, so duplicates are caught across shards)-->
        every --shard-lines lines: Shard(id = input fingerprint + first and last line number)
    Shard.payload(): JSON text --Ray--> actor: decode_payload --> ScannedLines --> its engine
    actor: answer(shard id, LineResults) --Ray--> driver: ShardAnswer (the part file's text)

A shard's id names what it answers: the same input bytes and --shard-lines give the same ids, so
a rerun finds the part files of the shards an earlier run finished. Only strings and numbers
cross the boundary: the shard's lines in, its output lines' text (in line order) out.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convoy.batch.executor import LineResult
from convoy.batch.lines import LineError
from convoy.batch.offline_lines import ScannedLine, scan

_FINGERPRINT_CHARS = 16  # of the input's SHA-256, in every shard id


@dataclass(slots=True)
class Shard:
    id: str
    items: list[ScannedLine]  # in line order

    @property
    def custom_ids(self) -> list[str | None]:
        """What its part file's lines name, in order (None: a line with no key of its own)."""
        return [item.custom_id for item in self.items]

    def payload(self) -> str:
        """Its lines as JSON text: what the actor is sent."""
        return json.dumps([_to_wire(item) for item in self.items])


@dataclass(slots=True)
class ShardAnswer:
    """What an actor sends back for a shard: its output lines and their counts."""

    shard: str
    text: str  # every output and error line, in line order
    completed: int
    failed: int
    output_tokens: int

    @classmethod
    def of(cls, shard: str, results: list[LineResult]) -> ShardAnswer:
        results = sorted(results, key=lambda r: r.index)  # the index is the line number
        return cls(
            shard, "".join(r.text for r in results), sum(r.ok for r in results),
            sum(not r.ok for r in results), sum(r.output_tokens for r in results),
        )  # fmt: skip

    def row(self) -> dict[str, list[Any]]:
        """As a Ray Data batch of one row."""
        return {
            "shard": [self.shard], "text": [self.text], "completed": [self.completed],
            "failed": [self.failed], "output_tokens": [self.output_tokens],
        }  # fmt: skip

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> ShardAnswer:
        return cls(
            str(row["shard"]), str(row["text"]), int(row["completed"]), int(row["failed"]),
            int(row["output_tokens"]),
        )  # fmt: skip


def _to_wire(item: ScannedLine) -> dict[str, Any]:
    if isinstance(item.line, LineError):
        error = [item.line.code, item.line.message, item.line.param]
        return {"number": item.number, "custom_id": item.custom_id, "error": error}
    return {"number": item.number, "custom_id": item.custom_id, "line": item.line}


def decode_payload(text: str) -> list[ScannedLine]:
    """The ScannedLines of `Shard.payload()`'s text."""
    items = []
    for wire in json.loads(text):
        line = LineError(*wire["error"]) if "error" in wire else wire["line"]
        items.append(ScannedLine(wire["number"], wire["custom_id"], line))
    return items


def fingerprint(path: Path) -> str:
    """The input's SHA-256 (hex): a changed input is another job, with other shard ids."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def plan_shards(path: Path, max_line_bytes: int, shard_lines: int) -> list[Shard]:
    """The input's lines in shards of `shard_lines` request lines each, in file order."""
    prefix = fingerprint(path)[:_FINGERPRINT_CHARS]
    items = list(scan(path, max_line_bytes))
    shards = []
    for start in range(0, len(items), shard_lines):
        chunk = items[start : start + shard_lines]
        shard_id = f"{prefix}-{chunk[0].number:09d}-{chunk[-1].number:09d}"
        shards.append(Shard(shard_id, chunk))
    return shards
