"""Batch rows in the ledger: create, read as the wire `Batch`, move between statuses, commit lines.

Status moves are compare-and-set (`move(..., only_from=...)`) so a cancel and the runner cannot
both win; every move stamps its `<status>_at` column.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from convoy.api.protocol_batch import (
    Batch,
    BatchError,
    BatchErrors,
    BatchRequestCounts,
    BatchUsage,
    InputTokensDetails,
)
from convoy.batch.db import BatchDB, FileRow

_STAMPS = {
    "in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
    "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}  # fmt: skip
# Columns a caller may set with a move (never anything built from request input).
_SETTABLE = {"total", "errors", "output_file_id", "error_file_id", "model"}


@dataclass(slots=True)
class Progress:
    """What one commit adds to a batch: results appended to its part files."""

    lines: list[int]  # 0-based request lines now done
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    output_bytes: int = 0  # the part files' lengths after the append (fsynced)
    error_bytes: int = 0


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


class BatchStore:
    def __init__(self, db: BatchDB) -> None:
        self.db = db
        # Request lines of running batches not yet answered, as of the last commit or move:
        # what /metrics shows, read without a query (the loop never waits on the database).
        self.num_pending_lines = 0

    def create(
        self, endpoint: str, input_file_id: str, window: str, metadata: dict[str, str] | None,
        lifetime_s: int, output_expires_s: int | None = None,
    ) -> Batch | None:  # fmt: skip
        """A validating batch over `input_file_id`; None when no such file with purpose batch
        exists (checked in the same transaction, so a concurrent delete cannot slip between)."""
        batch_id, now = new_batch_id(), int(time.time())
        with self.db.transaction() as conn:
            found = conn.execute(
                "SELECT 1 FROM files WHERE id = ? AND purpose = 'batch'", (input_file_id,)
            ).fetchone()
            if found is None:
                return None
            conn.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status,"
                " created_at, expires_at, metadata, output_expires_s)"
                " VALUES (?, ?, ?, ?, 'validating', ?, ?, ?, ?)",
                (batch_id, endpoint, input_file_id, window, now, now + lifetime_s,
                 None if metadata is None else json.dumps(metadata), output_expires_s),
            )  # fmt: skip
        batch = self.get(batch_id)
        assert batch is not None
        return batch

    def get(self, batch_id: str) -> Batch | None:
        row = self.db.read(
            lambda c: c.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        )
        return None if row is None else _to_batch(row)

    def row(self, batch_id: str) -> sqlite3.Row | None:
        return self.db.read(
            lambda c: c.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        )

    def page(self, after: str | None, limit: int) -> tuple[list[Batch], bool] | None:
        """Newest first; None when `after` names no batch."""

        def query(c: sqlite3.Connection) -> list[sqlite3.Row] | None:
            start = 1 << 62
            if after is not None:
                found = c.execute("SELECT seq FROM batches WHERE id = ?", (after,)).fetchone()
                if found is None:
                    return None
                start = found[0]
            return c.execute(
                "SELECT * FROM batches WHERE seq < ? ORDER BY seq DESC LIMIT ?", (start, limit + 1)
            ).fetchall()

        rows = self.db.read(query)
        if rows is None:
            return None
        return [_to_batch(r) for r in rows[:limit]], len(rows) > limit

    def ids_in(self, statuses: Iterable[str]) -> list[str]:
        """Batches in these statuses, oldest first (what a restart must pick up)."""
        wanted = list(statuses)
        marks = ",".join("?" * len(wanted))
        rows = self.db.read(
            lambda c: c.execute(
                f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq", wanted
            ).fetchall()
        )
        return [r[0] for r in rows]

    def move(
        self, batch_id: str, status: str, only_from: Iterable[str], files: Iterable[FileRow] = (),
        **columns: object,
    ) -> bool:  # fmt: skip
        """Set the status (and stamp it) if the batch is in one of `only_from`; register `files`
        (already on disk) in the same transaction. Returns whether it moved."""
        assert set(columns) <= _SETTABLE, columns
        sources = list(only_from)
        sets = [("status", status)] + list(columns.items())
        if status in _STAMPS:
            sets.append((_STAMPS[status], int(time.time())))
        assignments = ", ".join(f"{name} = ?" for name, _ in sets)
        marks = ",".join("?" * len(sources))
        with self.db.transaction() as conn:
            cur = conn.execute(
                f"UPDATE batches SET {assignments} WHERE id = ? AND status IN ({marks})",
                [value for _, value in sets] + [batch_id] + sources,
            )
            if cur.rowcount:
                for row in files:
                    conn.execute("DELETE FROM files WHERE id = ?", (row.id,))  # a retried move
                    self.db.insert_file(conn, row)
        self.refresh_pending()
        return bool(cur.rowcount)

    def commit(self, batch_id: str, p: Progress) -> None:
        """Mark lines done with the counts they add and the part files' new committed lengths.

        NOTE: called only after the appended bytes are fsynced; one transaction, so a crash
        leaves either all of this commit or none of it.
        """
        with self.db.transaction() as conn:
            conn.executemany(
                "INSERT OR IGNORE INTO batch_lines (batch_id, line) VALUES (?, ?)",
                [(batch_id, line) for line in p.lines],
            )
            conn.execute(
                "UPDATE batches SET completed = completed + ?, failed = failed + ?,"
                " input_tokens = input_tokens + ?, cached_tokens = cached_tokens + ?,"
                " output_tokens = output_tokens + ?, output_bytes = ?, error_bytes = ?"
                " WHERE id = ?",
                (p.completed, p.failed, p.input_tokens, p.cached_tokens, p.output_tokens,
                 p.output_bytes, p.error_bytes, batch_id),
            )  # fmt: skip
        self.refresh_pending()

    def done_lines(self, batch_id: str) -> set[int]:
        rows = self.db.read(
            lambda c: c.execute(
                "SELECT line FROM batch_lines WHERE batch_id = ?", (batch_id,)
            ).fetchall()
        )
        return {r[0] for r in rows}

    def refresh_pending(self) -> int:
        """Request lines of running batches not yet answered (the batch queue depth), counted
        again into `num_pending_lines`; blocking."""
        row = self.db.read(
            lambda c: c.execute(
                "SELECT COALESCE(SUM(total - completed - failed), 0) FROM batches"
                " WHERE status = 'in_progress'"
            ).fetchone()
        )
        self.num_pending_lines = int(row[0])
        return self.num_pending_lines


def _to_batch(row: sqlite3.Row) -> Batch:
    errors = json.loads(row["errors"]) if row["errors"] else None
    final = row["status"] in ("completed", "expired", "cancelled")
    input_tokens, output_tokens = row["input_tokens"], row["output_tokens"]
    return Batch(
        id=row["id"],
        endpoint=row["endpoint"],
        errors=None if errors is None else BatchErrors(data=[BatchError(**e) for e in errors]),
        input_file_id=row["input_file_id"],
        completion_window=row["completion_window"],
        status=row["status"],
        # NOTE: the ids are chosen when finalizing starts; the files exist once it has ended.
        output_file_id=row["output_file_id"] if final else None,
        error_file_id=row["error_file_id"] if final else None,
        created_at=row["created_at"],
        in_progress_at=row["in_progress_at"],
        expires_at=row["expires_at"],
        finalizing_at=row["finalizing_at"],
        completed_at=row["completed_at"],
        failed_at=row["failed_at"],
        expired_at=row["expired_at"],
        cancelling_at=row["cancelling_at"],
        cancelled_at=row["cancelled_at"],
        request_counts=BatchRequestCounts(
            total=row["total"], completed=row["completed"], failed=row["failed"]
        ),
        usage=BatchUsage(
            input_tokens=input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=row["cached_tokens"]),
            output_tokens=output_tokens,
            total_tokens=input_tokens + output_tokens,
        ),
        model=row["model"],
        metadata=json.loads(row["metadata"]) if row["metadata"] else None,
    )
