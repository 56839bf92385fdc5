"""The server's batches, driven from the ledger: one task per batch that is not finished.

    validating --one pass over the file--> in_progress | failed (errors name the lines)
    in_progress --every line committed--> finalizing --output files registered--> completed
    in_progress --expires_at passed--> (unfinished lines: batch_expired errors) --> expired
    validating | in_progress --cancel--> cancelling --> cancelled (what was committed is kept)

Every step reads its state from the database, so a restart (after `kill -9` too) continues each
batch from its status: `start()` spawns a task for every batch not yet finished. Finalizing is
idempotent: a batch's output file ids are derived from its id, each part file is cut to its
committed length and renamed to its file id, then one transaction registers the files and ends
the batch. A ledger that cannot commit (a full disk, a database error, a part file damaged) ends
the batch as failed, with the error, and what was committed becomes its output files.

Off the event loop: every database call and file operation of a batch runs in a worker thread
(`asyncio.to_thread`); the loop only starts, cancels and awaits them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
import uuid
from collections.abc import Iterator
from functools import partial

from convoy.api.protocol_batch import BatchError
from convoy.batch import files
from convoy.batch.db import BatchDB, FileRow, fsync_dir
from convoy.batch.executor import BatchExecutor, LedgerError, LineResult, line_error_result
from convoy.batch.ledger import StoreLedger, cut_back
from convoy.batch.lines import InputLine, LineError, request_lines, validate
from convoy.batch.store import BatchStore
from convoy.engine.errors import EngineUnavailableError

logger = logging.getLogger(__name__)

EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
SWEEP_INTERVAL_S = 60  # how often expired files are looked for
_UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")


def derived_file_id(batch_id: str, kind: str) -> str:
    """The id a batch's output (`kind` output / error) file gets, the same on every retry."""
    return f"file-{uuid.uuid5(uuid.NAMESPACE_URL, f'{batch_id}/{kind}').hex}"


class BatchRunner:
    def __init__(
        self, db: BatchDB, executor: BatchExecutor, model: str, max_line_bytes: int,
        retention_s: int | None = None,
    ) -> None:  # fmt: skip
        self.db = db
        self.store = BatchStore(db)
        self.executor = executor
        self.model = model
        self.max_line_bytes = max_line_bytes
        self.retention_s = retention_s  # batch outputs' default lifetime (None: until deleted)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping = False
        self._sweeper: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Pick up every batch a previous run left unfinished, oldest first (at start-up), and
        start deleting files as they expire."""
        for batch_id in self.store.ids_in(_UNFINISHED):
            self.submit(batch_id)
        self.store.refresh_pending()
        self._sweeper = asyncio.create_task(self._sweep(), name="expired files")

    async def _sweep(self) -> None:
        """Delete expired files (uploads' expires_after, batch outputs' retention), every
        SWEEP_INTERVAL_S (or the retention, when shorter), in a worker thread."""
        interval = min(SWEEP_INTERVAL_S, self.retention_s or SWEEP_INTERVAL_S)
        while True:
            try:
                deleted = await asyncio.to_thread(files.sweep_expired, self.db, time.time())
                if deleted:
                    logger.info("deleted %d expired files: %s", len(deleted), ", ".join(deleted))
            except Exception:  # noqa: BLE001 - a bad sweep is retried at the next interval
                logger.exception("deleting expired files failed")
            await asyncio.sleep(interval)

    def submit(self, batch_id: str) -> None:
        task = asyncio.create_task(self._drive(batch_id), name=f"batch {batch_id}")
        self.tasks[batch_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(batch_id, None))

    async def cancel(self, batch_id: str) -> bool:
        """Start cancelling a batch that is validating or running; False if it is past that."""
        moved = await asyncio.to_thread(
            self.store.move, batch_id, "cancelling", ["validating", "in_progress"]
        )
        if not moved:
            return False
        task = self.tasks.get(batch_id)
        if task is not None:
            task.cancel()  # the task sees the status and ends the batch as cancelled
        else:
            self.submit(batch_id)
        return True

    async def stop(self) -> None:
        """Shutdown: stop every batch where it is (finished lines are committed first)."""
        self._stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _drive(self, batch_id: str) -> None:
        try:
            await self._advance(batch_id)
        except asyncio.CancelledError:
            if self._stopping:
                raise
            await self._advance(batch_id)  # a cancel: the status says cancelling now
        except EngineUnavailableError as e:
            logger.warning("batch %s paused: %s (it resumes when the server restarts)", batch_id, e)
        except LedgerError as e:
            await self._fail(batch_id, e)
        except Exception:
            logger.exception("batch %s stopped by an unexpected error", batch_id)

    async def _advance(self, batch_id: str) -> None:
        """Take the batch from its current status to a final one."""
        row = await asyncio.to_thread(self.store.row, batch_id)
        assert row is not None
        status = row["status"]
        if status == "validating":
            await self._validate(batch_id, row["endpoint"], row["input_file_id"])
        elif status == "in_progress":
            if time.time() >= row["expires_at"]:
                await self._expire(batch_id)
            else:
                await self._run(batch_id, row["expires_at"])
        elif status == "finalizing":
            await asyncio.to_thread(self._finalize, batch_id, "finalizing", "completed")
        elif status == "cancelling":
            await asyncio.to_thread(self._finalize, batch_id, "cancelling", "cancelled")
        else:
            return
        row = await asyncio.to_thread(self.store.row, batch_id)
        if row is not None and row["status"] in _UNFINISHED:
            await self._advance(batch_id)

    async def _validate(self, batch_id: str, endpoint: str, file_id: str) -> None:
        path = self.db.file_path(file_id)
        total, errors = await asyncio.to_thread(
            validate, path, endpoint, self.model, self.max_line_bytes
        )
        if errors:
            data = json.dumps([e.model_dump() for e in errors])
            move = partial(self.store.move, errors=data, total=total)
            await asyncio.to_thread(move, batch_id, "failed", ["validating"])
        else:
            move = partial(self.store.move, total=total, model=self.model)
            await asyncio.to_thread(move, batch_id, "in_progress", ["validating"])

    async def _run(self, batch_id: str, expires_at: int) -> None:
        row = await asyncio.to_thread(self.store.row, batch_id)
        assert row is not None
        ledger = await asyncio.to_thread(StoreLedger, self.store, batch_id)
        lines = self._lines(batch_id, row["endpoint"], row["input_file_id"])
        try:
            async with asyncio.timeout(max(0.0, expires_at - time.time())):
                await self.executor.run(row["endpoint"], lines, ledger)
        except TimeoutError:
            return  # still in_progress, past expires_at: _advance expires it
        await asyncio.to_thread(self.store.move, batch_id, "finalizing", ["in_progress"])

    async def _expire(self, batch_id: str) -> None:
        row = await asyncio.to_thread(self.store.row, batch_id)
        assert row is not None
        expired = (
            line_error_result(line.index, _expired(), line.custom_id)
            if isinstance(line, InputLine) else line
            for line in self._lines(batch_id, row["endpoint"], row["input_file_id"])
        )  # fmt: skip
        ledger = await asyncio.to_thread(StoreLedger, self.store, batch_id)
        await self.executor.run(row["endpoint"], expired, ledger)
        await asyncio.to_thread(self._finalize, batch_id, "in_progress", "expired")

    async def _fail(self, batch_id: str, e: LedgerError) -> None:
        """End a running batch whose results cannot be committed: failed, with the error; what
        was committed becomes its output files. If even that cannot be recorded, the batch stays
        as it is and resumes at the next start."""
        logger.error("batch %s failed: %s", batch_id, e)
        error = BatchError(code="ledger_failed", message=f"results could not be recorded: {e}")
        errors = json.dumps([error.model_dump()])
        record = partial(self._finalize_failed, batch_id, errors)
        try:  # on a full disk, in the reserve's room
            await asyncio.to_thread(self.db.with_reserve, record)
        except Exception:
            logger.exception("batch %s: its failure could not be recorded either", batch_id)

    def _lines(
        self, batch_id: str, endpoint: str, file_id: str
    ) -> Iterator[InputLine | LineResult]:
        """The request lines not yet committed, read from the input file as they are needed."""
        done = self.store.done_lines(batch_id)
        path = self.db.file_path(file_id)
        for item in request_lines(path, endpoint, self.model, self.max_line_bytes):
            if isinstance(item, InputLine):
                if item.index not in done:
                    yield item
            else:  # the file passed validation; only a changed model could make this
                number, err = item
                yield line_error_result(number - 1, err)

    def _finalize_failed(self, batch_id: str, errors: str) -> None:
        row = self.store.row(batch_id)
        if row is not None and row["status"] in ("in_progress", "finalizing", "cancelling"):
            self._finalize(batch_id, row["status"], "failed", errors)

    def _finalize(self, batch_id: str, current: str, final: str, errors: str | None = None) -> None:
        """Turn the part files into output files and end the batch (safe to repeat); blocking.

        A part file shorter than its committed length is left out (LedgerError when it is not
        the failure being recorded)."""
        row = self.store.row(batch_id)
        assert row is not None
        folder = self.db.batch_dir(batch_id)
        outputs, ids = [], {}
        sizes = {"output": row["output_bytes"], "error": row["error_bytes"]}
        for kind, size in sizes.items():
            file_id = derived_file_id(batch_id, kind)
            dest = self.db.file_path(file_id)
            part = folder / f"{kind}.part"
            if part.exists() and size > 0:
                try:
                    cut_back(part, size)
                except LedgerError:
                    if errors is None:
                        raise
                    continue  # failing already: keep what is whole
                part.rename(dest)
                fsync_dir(dest.parent)
            if dest.exists():
                name = f"{batch_id}_{kind}.jsonl"
                made = int(time.time())
                lifetime = row["output_expires_s"] or self.retention_s
                expires = None if lifetime is None else made + lifetime
                outputs.append(FileRow(file_id, size, made, name, "batch_output", expires))
                ids[f"{kind}_file_id"] = file_id
        if errors is not None:
            ids["errors"] = errors
        if self.store.move(batch_id, final, [current], outputs, **ids):
            shutil.rmtree(folder, ignore_errors=True)  # empty part files


def _expired() -> LineError:
    return LineError("batch_expired", EXPIRED_MESSAGE)
