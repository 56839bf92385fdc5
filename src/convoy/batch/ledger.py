"""Making results durable: append to the output / error part files, fsync, then record.

    results --append--> output.part / error.part --fsync--> ledger.record(lines, new lengths)

NOTE: the order is the whole guarantee. A line is recorded done (with the part files' new
lengths) only after its bytes are on disk; a crash in between leaves bytes past the recorded
length, which `PartFiles` truncates when it opens the files again, and the line runs again. So
after any crash each recorded line is in the files once and no unrecorded line is. A part file
shorter than its recorded length (changed or damaged since) is a LedgerError, never padded.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from pathlib import Path

from convoy.batch.db import fsync_dir
from convoy.batch.executor import LedgerError, LineResult
from convoy.batch.store import BatchStore, Progress


def cut_back(path: Path, size: int, create: bool = False) -> bool:
    """Truncate `path` to its committed length `size` (fsynced); True when it was created.

    A file shorter than `size` lost committed lines: LedgerError (truncate would pad it with
    NUL bytes that would then be served as output).
    """
    if not create and not path.exists():
        raise LedgerError(f"{path}: missing, with {size} bytes committed")
    created = not path.exists()
    with open(path, "ab") as f:  # creates it
        length = f.tell()
        if length < size:
            raise LedgerError(
                f"{path} holds {length} bytes but {size} were committed: the file was changed"
                " or damaged outside Convoy"
            )
        if length > size:  # bytes appended, then a crash before they were recorded
            f.truncate(size)
            os.fsync(f.fileno())
    return created


class PartFiles:
    """Two append-only files (successes, errors), each cut back to its committed length; with
    `error` None, one file takes both (`convoy batch` without --error-file)."""

    def __init__(
        self, output: Path, error: Path | None, output_bytes: int, error_bytes: int = 0
    ) -> None:
        self.paths = (output,) if error is None else (output, error)
        self.sizes = [output_bytes, error_bytes][: len(self.paths)]
        created = False
        for path, size in zip(self.paths, self.sizes, strict=True):
            created |= cut_back(path, size, create=size == 0)
        if created:  # the new names themselves must survive a power loss
            for folder in {path.parent for path in self.paths}:
                fsync_dir(folder)
        self._lock = threading.Lock()

    def append(self, results: list[LineResult], record: Callable[[int, int], None]) -> None:
        """Append `results` (each to its file), fsync, then `record(output_bytes, error_bytes)`.

        Thread-safe: groups are appended and recorded one at a time, in order.
        """
        with self._lock:
            for k, path in enumerate(self.paths):
                mine = [r for r in results if len(self.paths) == 1 or r.ok == (k == 0)]
                data = "".join(r.text for r in mine).encode()
                if not data:
                    continue
                with open(path, "ab") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                    self.sizes[k] = f.tell()
            record(self.sizes[0], self.sizes[1] if len(self.sizes) > 1 else 0)


class StoreLedger:
    """The server's ledger: part files under the batch's folder, progress in the database."""

    def __init__(self, store: BatchStore, batch_id: str) -> None:
        row = store.row(batch_id)
        assert row is not None
        folder = store.db.batch_dir(batch_id)
        if not folder.exists():
            folder.mkdir(parents=True)
            fsync_dir(folder.parent)
        self.store, self.batch_id = store, batch_id
        self.parts = PartFiles(
            folder / "output.part", folder / "error.part", row["output_bytes"], row["error_bytes"]
        )

    async def __call__(self, results: list[LineResult]) -> None:
        await asyncio.to_thread(self._commit, results)

    def _commit(self, results: list[LineResult]) -> None:
        progress = Progress(
            lines=[r.index for r in results],
            completed=sum(r.ok for r in results),
            failed=sum(not r.ok for r in results),
            input_tokens=sum(r.input_tokens for r in results),
            output_tokens=sum(r.output_tokens for r in results),
        )

        def record(output_bytes: int, error_bytes: int) -> None:
            progress.output_bytes, progress.error_bytes = output_bytes, error_bytes
            self.store.commit(self.batch_id, progress)

        self.parts.append(results, record)
