"""The Batch API's durable state: one SQLite database (WAL) plus a folder of files.

    DATA_DIR/
      convoy.db        files, batches and the lines of each batch that are done (this module)
      lock             held (flock) by the one server that owns the folder
      files/<file-id>  uploaded files and finished batch outputs, immutable once written
      tmp/             uploads in progress (emptied at start: a crash leaves only garbage here)
      batches/<id>/    output.part, error.part: a running batch's results, appended and fsynced
      reserve          RESERVE_BYTES held back: when the disk fills, it is given up so that a
                       batch's failure can still be recorded (then made again when space frees)

NOTE: the database is the ledger. A file under files/ exists for every row in `files` (written,
fsynced and renamed before its row is committed); a part file may hold bytes past the batch's
committed offset (appended, not yet committed: a crash in between), which a resume truncates.
Every transaction commits with synchronous=FULL, so a committed line survives power loss.

One connection, used from any thread under a lock; the statements are short (the event loop may
run reads; writes that commit go through `asyncio.to_thread` where they are on a hot path).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)

RESERVE_BYTES = 1 << 20  # room for a few SQLite commits (WAL pages) on an otherwise full disk
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def is_disk_full(e: BaseException) -> bool:
    """Whether `e` (or what caused it) says the data disk has no room left."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return True
        if isinstance(e, sqlite3.OperationalError) and "full" in str(e):
            return True
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- listing order
    id TEXT UNIQUE NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    expires_at INTEGER                       -- NULL: kept until deleted
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT,
    errors TEXT,                               -- JSON list of {code, message, line, param}
    metadata TEXT,                             -- JSON object or NULL
    model TEXT,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    output_bytes INTEGER NOT NULL DEFAULT 0,   -- committed length of batches/<id>/output.part
    error_bytes INTEGER NOT NULL DEFAULT 0,    -- committed length of batches/<id>/error.part
    output_expires_s INTEGER                   -- its output files expire this long after made
);
CREATE TABLE IF NOT EXISTS batch_lines (      -- the input lines (0-based) whose result is committed
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    PRIMARY KEY (batch_id, line)
) WITHOUT ROWID;
"""

# Columns added since the first schema: (table, column, type), added to older databases at open.
_ADDED_COLUMNS = (("files", "expires_at", "INTEGER"), ("batches", "output_expires_s", "INTEGER"))

# Statuses whose batch still uses its input file (its DELETE answers 409).
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


class DataDirBusy(RuntimeError):
    """Another process holds the data folder."""


@dataclass(slots=True)
class FileRow:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int | None = None


class BatchDB:
    """The database and the folder layout of one data dir, held by this process alone."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in ("files", "tmp", "batches"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self._lock_file = open(root / "lock", "a+")  # noqa: SIM115 - held for the process' life
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise DataDirBusy(
                f"{root} is used by another Convoy process; give this one its own --data-dir"
            ) from None
        shutil.rmtree(root / "tmp", ignore_errors=True)
        (root / "tmp").mkdir()
        self._conn = sqlite3.connect(
            root / "convoy.db", check_same_thread=False, isolation_level=None
        )
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.executescript(_SCHEMA)
        for table, column, kind in _ADDED_COLUMNS:
            have = {r[1] for r in self._conn.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        self._mutex = threading.Lock()
        self.keep_reserve()

    # -- the reserve ----------------------------------------------------------------------------

    def keep_reserve(self) -> bool:
        """Make the reserve file if it is missing (best effort: False when there is no room)."""
        path = self.root / "reserve"
        if path.exists() and path.stat().st_size == RESERVE_BYTES:
            return True
        tmp = self.tmp_path("reserve")
        try:
            with open(tmp, "wb") as f:
                f.write(bytes(RESERVE_BYTES))  # written, not sparse: the blocks are taken
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if not is_disk_full(e):
                raise
            return False
        return True

    def with_reserve(self, fn: Callable[[], T]) -> T:
        """`fn()`; if it fails for want of room, once more with the reserve given up (for the
        writes that must get through on a full disk: a failure recorded, a delete)."""
        try:
            return fn()
        except (OSError, sqlite3.OperationalError) as e:
            if not (is_disk_full(e) and self.release_reserve()):
                raise
        return fn()

    def release_reserve(self) -> bool:
        """Give the reserve's space back to the disk (True if there was one)."""
        path = self.root / "reserve"
        if not path.exists():
            return False
        path.unlink()
        logger.warning("the data disk is full: its %d-byte reserve was released", RESERVE_BYTES)
        return True

    def close(self) -> None:
        with self._mutex:
            self._conn.close()
        self._lock_file.close()

    # -- paths --------------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    def tmp_path(self, name: str) -> Path:
        return self.root / "tmp" / name

    def batch_dir(self, batch_id: str) -> Path:
        return self.root / "batches" / batch_id

    # -- access -------------------------------------------------------------------------------

    def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn(conn)` under the lock, outside any transaction (a consistent read of one query)."""
        with self._mutex:
            return fn(self._conn)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed (and fsynced) on exit, rolled back on an error."""
        with self._mutex:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    # -- files --------------------------------------------------------------------------------

    def insert_file(self, conn: sqlite3.Connection, row: FileRow) -> None:
        """Register a file whose bytes are already at `file_path(row.id)` (inside a transaction)."""
        conn.execute(
            "INSERT INTO files (id, bytes, created_at, filename, purpose, expires_at)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (row.id, row.bytes, row.created_at, row.filename, row.purpose, row.expires_at),
        )

    def get_file(self, file_id: str) -> FileRow | None:
        row = self.read(
            lambda c: c.execute(
                "SELECT id, bytes, created_at, filename, purpose, expires_at FROM files"
                " WHERE id = ?",
                (file_id,),
            ).fetchone()
        )
        return None if row is None else FileRow(*row)

    def file_in_use(self, file_id: str, conn: sqlite3.Connection | None = None) -> bool:
        """Is the file the input of a batch that is not finished? Pass `conn` inside a
        transaction (the check and what depends on it then happen atomically)."""
        marks = ",".join("?" * len(ACTIVE_STATUSES))

        def query(c: sqlite3.Connection) -> bool:
            sql = f"SELECT 1 FROM batches WHERE input_file_id = ? AND status IN ({marks}) LIMIT 1"
            return c.execute(sql, (file_id, *ACTIVE_STATUSES)).fetchone() is not None

        return query(conn) if conn is not None else self.read(query)


def fsync_dir(path: Path) -> None:
    """Make a rename or create inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def default_data_dir() -> Path:
    """$CONVOY_DATA_DIR, else $XDG_DATA_HOME/convoy, else ~/.local/share/convoy."""
    if env := os.environ.get("CONVOY_DATA_DIR"):
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "convoy"
