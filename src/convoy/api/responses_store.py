"""Stored responses (`store: true`): one SQLite file, responses.db, in the server's data folder.

A row keeps the response object and the conversation's input items (the previous response's
items and output, then the request's own input), so `previous_response_id` continues a
conversation after a restart too. A background response's row also keeps its status and the
request that runs it, written (synchronous=FULL) before its client hears of it, so a restart
finds every background response still queued or in progress (`unfinished`). Calls are
blocking: callers run them with asyncio.to_thread.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    status TEXT,
    request TEXT
);
CREATE TABLE IF NOT EXISTS items (
    id TEXT PRIMARY KEY,
    response_id TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS items_by_response ON items (response_id);
"""
_UNFINISHED = ("queued", "in_progress")


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a follow-up continues: the input items, then the output items."""
        return self.input_items + list(self.response.get("output") or [])


class ResponseStore:
    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(
            root / "responses.db", check_same_thread=False, isolation_level=None
        )
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.executescript(_SCHEMA)
        columns = {row[1] for row in self._conn.execute("PRAGMA table_info(responses)")}
        for name in ("status", "request"):  # a store written before background responses
            if name not in columns:
                self._conn.execute(f"ALTER TABLE responses ADD COLUMN {name} TEXT")
        self._mutex = threading.Lock()

    def close(self) -> None:
        with self._mutex:
            self._conn.close()

    def put(
        self, response: dict[str, Any], input_items: list[dict[str, Any]],
        request: str | None = None,
    ) -> None:  # fmt: skip
        """Write a response; `request`: a background one's request JSON (kept while it runs)."""
        row = (response["id"], int(response["created_at"]), json.dumps(response),
               json.dumps(input_items), response.get("status"), request)  # fmt: skip
        # each item id -> the first response that held it (item_reference inputs find it there)
        ids = [(i["id"], response["id"]) for i in input_items + list(response.get("output") or [])
               if isinstance(i.get("id"), str)]  # fmt: skip
        with self._mutex, self._conn:
            self._conn.execute("BEGIN")
            self._conn.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)", row)
            self._conn.executemany("INSERT OR IGNORE INTO items VALUES (?, ?)", ids)

    def unfinished(self) -> list[tuple[StoredResponse, str]]:
        """Background responses still queued or in progress, oldest first, with their requests."""
        with self._mutex:
            rows = self._conn.execute(
                "SELECT response, input_items, request FROM responses WHERE request IS NOT NULL"
                " AND status IN (?, ?) ORDER BY created_at",
                _UNFINISHED,
            ).fetchall()
        return [(StoredResponse(json.loads(r[0]), json.loads(r[1])), r[2]) for r in rows]

    def get(self, response_id: str) -> StoredResponse | None:
        with self._mutex:
            row = self._conn.execute(
                "SELECT response, input_items FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def items(self, item_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Stored conversations' items by id (inputs or outputs of responses), those found;
        each response holding them read once."""
        wanted = set(item_ids)
        with self._mutex:
            where: dict[str, list[str]] = {}
            for item_id in wanted:
                row = self._conn.execute(
                    "SELECT response_id FROM items WHERE id = ?", (item_id,)
                ).fetchone()
                if row is not None:
                    where.setdefault(row[0], []).append(item_id)
        found: dict[str, dict[str, Any]] = {}
        for response_id in where:
            stored = self.get(response_id)
            for item in stored.conversation if stored is not None else []:
                if item.get("id") in wanted:
                    found.setdefault(item["id"], item)
        return found

    def delete(self, response_id: str) -> bool:
        with self._mutex, self._conn:
            self._conn.execute("BEGIN")
            cur = self._conn.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            self._conn.execute("DELETE FROM items WHERE response_id = ?", (response_id,))
        return cur.rowcount > 0
