"""The file store's queries behind /v1/files (no HTTP): a cursor page of files, a delete that a
batch in progress holds back. Blocking (SQLite, unlink): the routes run them in a worker thread.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from convoy.batch.db import BatchDB

_COLUMNS = "id, bytes, created_at, filename, purpose, expires_at"


def page(
    conn: sqlite3.Connection, purpose: str | None, limit: int, order: str, after: str | None
) -> list[Any] | None:
    """Up to limit + 1 rows after the cursor (one more tells `has_more`); None: unknown cursor."""
    where: list[str] = []
    args: list[Any] = []
    if after is not None:
        cursor = conn.execute("SELECT seq FROM files WHERE id = ?", (after,)).fetchone()
        if cursor is None:
            return None
        where.append("seq < ?" if order == "desc" else "seq > ?")
        args.append(cursor[0])
    if purpose is not None:
        where.append("purpose = ?")
        args.append(purpose)
    sql = f"SELECT {_COLUMNS} FROM files"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += f" ORDER BY seq {'DESC' if order == 'desc' else 'ASC'} LIMIT ?"
    return conn.execute(sql, (*args, limit + 1)).fetchall()


def delete(db: BatchDB, file_id: str) -> bool | None:
    """Delete the row, then the bytes (a crash in between leaves only an orphan file).

    None (nothing deleted) when a batch in progress uses the file: checked in the same
    transaction, so a batch created meanwhile cannot lose its input.

    On a full disk the delete itself needs room (SQLite's log): the data dir's reserve is given
    up for it, and made again once the file's bytes are freed.
    """
    num_deleted = db.with_reserve(lambda: _delete_row(db, file_id))
    if num_deleted:
        db.file_path(file_id).unlink(missing_ok=True)
        db.keep_reserve()
    return None if num_deleted is None else num_deleted > 0


def _delete_row(db: BatchDB, file_id: str) -> int | None:
    with db.transaction() as conn:
        if db.file_in_use(file_id, conn):
            return None
        return int(conn.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount)


def expired(db: BatchDB, now: float) -> list[str]:
    """Files whose expires_at has passed, oldest first."""
    rows = db.read(
        lambda c: c.execute(
            "SELECT id FROM files WHERE expires_at IS NOT NULL AND expires_at <= ? ORDER BY seq",
            (int(now),),
        ).fetchall()
    )
    return [r[0] for r in rows]


def sweep_expired(db: BatchDB, now: float) -> list[str]:
    """Delete the files past their expiry (those a batch in progress uses wait: it holds them);
    returns the ids deleted."""
    return [file_id for file_id in expired(db, now) if delete(db, file_id)]
