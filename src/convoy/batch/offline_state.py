"""The ledger of `convoy batch`: a state file next to the output, `OUT.jsonl.convoy-state`.

One JSON object a line, each appended and fsynced: a header naming the job's files, then one
record per commit, written only after the output files were fsynced (see ledger.PartFiles):

    {"convoy_batch": 1, "input": "/abs/IN.jsonl", "error": "/abs/ERR.jsonl"}
    {"custom_ids": ["a", "b"], "lines": [7], "output_bytes": 2817, "error_bytes": 0}

`custom_ids` are the committed lines' keys; a line without a custom_id of its own (unreadable, or
a duplicate) is keyed by its line number in `lines` (LineResult.index is the line number). The last complete record's lengths are the
committed lengths of the output files; a record torn by a crash is cut off when the file is read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from convoy.batch.executor import LineResult

STATE_SUFFIX = ".convoy-state"
STATE_VERSION = 1


class JobError(Exception):
    """The job cannot run: `exit_code` 2 when it was refused (files that do not go together),
    1 when it failed (input unreadable, output unwritable, the engine)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StateFile:
    """The lines already answered and the output files' committed lengths; appends commits."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.header = header
        self.custom_ids: set[str] = set()
        self.lines: set[int] = set()
        self.output_bytes = self.error_bytes = 0

    @classmethod
    def open(cls, path: Path, input: Path, output: Path, error: Path | None) -> StateFile:
        """The job's state: read back (torn tail cut off), or new when there is none.

        Refuses (JobError, 2) a state file of another job, and output files that have no state
        or are shorter than it records (so nothing that convoy did not write is truncated).
        """
        header = {
            "convoy_batch": STATE_VERSION, "input": os.path.realpath(input),
            "error": None if error is None else os.path.realpath(error),
        }  # fmt: skip
        state = cls(path, header)
        records = state._read() if path.exists() else []
        files = [output] if error is None else [output, error]
        if not records:  # a new job (or one that crashed before its header was on disk)
            for f in files:
                if f.exists() and f.stat().st_size > 0:
                    raise JobError(
                        f"{f} exists and has no {path.name}, so it was not written by"
                        " `convoy batch`; remove it or choose another file", 2
                    )  # fmt: skip
            state._append(header)
            return state
        state._replay(records)
        for f, size in zip(files, (state.output_bytes, state.error_bytes), strict=False):
            if (f.stat().st_size if f.exists() else 0) < size:
                raise JobError(
                    f"{f} is shorter than {path.name} records: it was changed outside"
                    f" `convoy batch`; remove it and {path.name} to start over", 2
                )  # fmt: skip
        return state

    def is_done(self, custom_id: str | None, number: int) -> bool:
        return custom_id in self.custom_ids if custom_id is not None else number in self.lines

    def commit(self, results: Sequence[LineResult], output_bytes: int, error_bytes: int) -> None:
        """Record `results` as answered, the output files now `output_bytes` / `error_bytes`."""
        self._append({
            "custom_ids": [r.custom_id for r in results if r.custom_id is not None],
            "lines": [r.index for r in results if r.custom_id is None],
            "output_bytes": output_bytes, "error_bytes": error_bytes,
        })  # fmt: skip

    def _append(self, record: dict[str, Any]) -> None:
        with open(self.path, "ab") as f:
            f.write(json.dumps(record).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())

    def _read(self) -> list[Any]:
        """Every complete record, header first; a torn tail is cut off the file."""
        data = self.path.read_bytes()
        good = 0  # bytes of complete, valid lines
        records = []
        for raw in data.splitlines(keepends=True):
            if not raw.endswith(b"\n"):
                break
            try:
                records.append(json.loads(raw))
            except ValueError:
                break
            good += len(raw)
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        return records

    def _replay(self, records: list[Any]) -> None:
        """Check the header is this job's, then take in every commit."""
        if records[0] != self.header:
            theirs = records[0] if isinstance(records[0], dict) else {}
            raise JobError(
                f"{self.path} records another job (input {theirs.get('input')}, error file"
                f" {theirs.get('error')}); give the same files to resume it, or remove the"
                " output files and the state file to start over", 2
            )  # fmt: skip
        for record in records[1:]:
            self.custom_ids.update(record["custom_ids"])
            self.lines.update(record["lines"])
            self.output_bytes, self.error_bytes = record["output_bytes"], record["error_bytes"]
