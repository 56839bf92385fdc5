"""Exactly-once results of `convoy batch --ray` without trusting Ray's at-least-once retries.

    ShardAnswer --check (its lines name the shard's custom_ids, in order)--> temp file
        --fsync, rename--> OUT.jsonl.convoy-shards/<shard id>.jsonl   (one file per shard)
    every shard's part --check again--> OUT.jsonl (+ ERR.jsonl): temp files, fsync, rename

NOTE: a part file exists only whole (rename is atomic) and only when its lines answer exactly
its shard's lines, so a shard is done exactly when its part file exists: a retried shard
rewrites the same name with the same answers, a rerun skips the shards that have one, and the
merge (which checks every part again) lists every custom_id once, or fails loudly.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from convoy.batch.db import fsync_dir
from convoy.batch.offline_state import STATE_SUFFIX, JobError
from convoy.cluster.shards import Shard

PARTS_SUFFIX = ".convoy-shards"  # OUT.jsonl.convoy-shards/: the part files' folder


class PartError(JobError):
    """A shard's answer does not answer its lines (a missing, extra or duplicated custom_id):
    the job fails (exit 1) rather than write it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 1)


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[BinaryIO]:
    """A new file for `path`, written beside it and renamed over it (after an fsync) when the
    block ends without an error; either the old file or the whole new one, never a mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def split_part(shard: Shard, data: bytes) -> list[tuple[bool, bytes]]:
    """(is a 200 answer, the line) for each line of a shard's answer; PartError unless the lines
    name the shard's custom_ids in its order (so none is missing, extra or there twice)."""
    lines = data.split(b"\n")
    if lines.pop() != b"":
        raise PartError(f"shard {shard.id}: its last line is not complete")
    expected = shard.custom_ids
    if len(lines) != len(expected):
        raise PartError(f"shard {shard.id}: {len(lines)} answers for {len(expected)} lines")
    out = []
    for line, custom_id in zip(lines, expected, strict=True):
        try:
            answer = json.loads(line)
            named, response = answer["custom_id"], answer["response"]
        except (ValueError, KeyError, TypeError):
            raise PartError(f"shard {shard.id}: an answer is not an output line") from None
        if named != custom_id:
            raise PartError(f"shard {shard.id}: custom_id {named!r} where {custom_id!r} belongs")
        out.append((isinstance(response, dict) and response.get("status_code") == 200, line))
    return out


class PartFolder:
    """`OUT.jsonl.convoy-shards/`: the finished shards' part files."""

    def __init__(self, output: Path, error: Path | None) -> None:
        self.path = output.with_name(output.name + PARTS_SUFFIX)
        self.output, self.error = output, error

    def open(self) -> None:
        """Create the folder; refuse (exit 2) outputs that it did not write."""
        state = self.output.with_name(self.output.name + STATE_SUFFIX)
        if state.exists():
            raise JobError(
                f"{self.output} belongs to a `convoy batch` run without --ray ({state.name});"
                " resume it without --ray, or choose another output file", 2
            )  # fmt: skip
        if not self.path.is_dir():
            for f in (self.output, self.error):
                if f is not None and f.exists() and f.stat().st_size > 0:
                    raise JobError(
                        f"{f} exists and has no {self.path.name}, so it was not written by"
                        " `convoy batch --ray`; remove it or choose another file", 2
                    )  # fmt: skip
        self.path.mkdir(exist_ok=True)
        fsync_dir(self.path.parent)

    def part(self, shard: Shard) -> Path:
        return self.path / f"{shard.id}.jsonl"

    def is_done(self, shard: Shard) -> bool:
        return self.part(shard).exists()

    def write(self, shard: Shard, text: str) -> None:
        """Check a shard's answer, then make it its part file (temp file, fsync, rename)."""
        data = text.encode()
        split_part(shard, data)
        with replacing(self.part(shard)) as f:
            f.write(data)

    def merge(self, shards: list[Shard]) -> None:
        """Every shard's part, checked, into the output (and error) file, in input order, each
        through a temp file, fsync and rename. PartError when a part is missing or wrong."""
        with contextlib.ExitStack() as stack:
            out = stack.enter_context(replacing(self.output))
            err = out if self.error is None else stack.enter_context(replacing(self.error))
            for shard in shards:
                try:
                    data = self.part(shard).read_bytes()
                except FileNotFoundError:
                    raise PartError(f"shard {shard.id} has no part file") from None
                for ok, line in split_part(shard, data):
                    (out if ok else err).write(line + b"\n")
