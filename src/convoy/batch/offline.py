"""`convoy batch`: a batch input file run in-process, no HTTP, resumable after any interruption.

    IN.jsonl --scan--> one line stream per endpoint --BatchExecutor (shared window)-->
        OUT.jsonl [+ ERR.jsonl] (PartFiles: append + fsync) --> OUT.jsonl.convoy-state (+ fsync)

The same line format, serving objects and executor as the Batch API, but forgiving: a line that
cannot be run (not JSON, no custom_id, a duplicate one, an unknown url, `stream: true`, too long)
is answered with an error line and the rest run. Each line's `url` picks its endpoint; the two
endpoints' lines run as two concurrent executor runs that share one window of lines in flight.

The ledger is the state file next to the output (`offline_state.py`); each run skips the lines it
records and the part files are cut back to its lengths, so every line is answered exactly once
whatever stopped an earlier run (kill -9 included). It is kept when the job completes: a rerun
then has nothing to do, and lines appended to the input later run on the next one.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from convoy.batch.executor import LedgerError, LineResult
from convoy.batch.inprocess import EngineStopped, open_serving, run_endpoints
from convoy.batch.ledger import PartFiles
from convoy.batch.lines import InputLine
from convoy.batch.offline_lines import prepare, scan
from convoy.batch.offline_state import STATE_SUFFIX, JobError, StateFile
from convoy.config import ServerConfig

__all__ = ["STATE_SUFFIX", "BatchSummary", "JobError", "OfflineJob", "check_paths", "run_batch"]


@dataclass(slots=True)
class OfflineJob:
    """What `convoy batch` was asked to do."""

    input: Path
    output: Path
    error: Path | None  # None: error lines go to the output file too
    settings: ServerConfig  # .engine, served_model_name, max_request_bytes (the line limit)
    progress: bool = True  # a progress bar on stderr (only when it is a terminal)

    @property
    def state(self) -> Path:
        return self.output.with_name(self.output.name + STATE_SUFFIX)


@dataclass(slots=True)
class BatchSummary:
    total: int  # request lines in the input file
    skipped: int  # answered by an earlier run
    completed: int = 0  # answered now with a 200
    failed: int = 0  # answered now with an error
    output_tokens: int = 0
    seconds: float = 0.0

    def describe(self, job: OfflineJob) -> str:
        if self.completed + self.failed == 0:
            return f"nothing to do: all {self.total} lines of {job.input} are answered"
        files = str(job.output) + ("" if job.error is None else f" (errors: {job.error})")
        rate = self.output_tokens / self.seconds if self.seconds else 0.0
        return (
            f"{self.completed + self.failed} lines answered ({self.completed} ok, {self.failed}"
            f" errors; {self.skipped} answered before) in {self.seconds:.1f} s,"
            f" {self.output_tokens} tokens ({rate:.1f} tok/s) -> {files}"
        )


class _Progress:
    """Counts for the summary, and the tqdm bar: lines done / total, tokens/s, ETA."""

    def __init__(self, summary: BatchSummary, enabled: bool) -> None:
        self.summary = summary
        self.start = time.perf_counter()
        self.bar = tqdm(
            total=summary.total, initial=summary.skipped, unit="line", dynamic_ncols=True,
            disable=None if enabled else True,  # None: only on a terminal
        )  # fmt: skip

    def on_result(self, result: LineResult) -> None:
        s = self.summary
        s.completed += result.ok
        s.failed += not result.ok
        s.output_tokens += result.output_tokens
        s.seconds = time.perf_counter() - self.start
        self.bar.update(1)
        self.bar.set_postfix_str(f"{s.output_tokens / max(s.seconds, 1e-9):.1f} tok/s", False)


@dataclass(slots=True)
class _Plan:
    job: OfflineJob
    state: StateFile
    parts: PartFiles
    summary: BatchSummary
    model: str = ""  # the served model name, once the engine is loaded

    def lines(self, endpoint: str) -> Iterator[InputLine | LineResult]:
        """The uncommitted lines `endpoint`'s run answers (see ScannedLine.endpoint)."""
        for item in scan(self.job.input, self.job.settings.max_request_bytes):
            if item.endpoint == endpoint and not self.state.is_done(item.custom_id, item.number):
                yield prepare(item, self.model)

    async def ledger(self, results: list[LineResult]) -> None:
        """Append + fsync the results, then record them in the state file (+ fsync)."""

        def record(output_bytes: int, error_bytes: int) -> None:
            self.state.commit(results, output_bytes, error_bytes)

        await asyncio.to_thread(self.parts.append, results, record)


def run_batch(job: OfflineJob) -> BatchSummary:
    """Run every line of `job.input` not yet answered; raises JobError when the job cannot run."""
    check_paths(job, "state file", job.state)
    try:
        with open(job.input, "rb"):  # unreadable: fail before anything is written
            pass
        state = StateFile.open(job.state, job.input, job.output, job.error)
        total = skipped = 0
        for item in scan(job.input, job.settings.max_request_bytes):
            total += 1
            skipped += state.is_done(item.custom_id, item.number)
        # NOTE: PartFiles fsyncs the folders of the files it creates (they survive a power loss)
        parts = PartFiles(job.output, job.error, state.output_bytes, state.error_bytes)
    except OSError as e:
        raise JobError(f"{e.filename}: {e.strerror}" if e.filename else str(e), 1) from None
    except LedgerError as e:  # an output file shorter than the state file records
        raise JobError(f"{e}; remove the output files and {job.state} to start afresh", 1) from None
    plan = _Plan(job, state, parts, BatchSummary(total, skipped))
    if skipped < total:
        asyncio.run(_run_lines(plan))
    return plan.summary


def check_paths(job: OfflineJob, what: str, sidecar: Path) -> None:
    """Refuse (exit 2) a job whose files overlap (the input, the outputs and the job's own
    `sidecar`, its state file or folder): an output must never overwrite the input."""
    named = {"input": job.input, "output": job.output, what: sidecar}
    if job.error is not None:
        named["error file"] = job.error
    seen: dict[str, str] = {}
    for name, path in named.items():
        key = os.path.realpath(path)
        if key in seen:
            raise JobError(f"the {name} is the same file as the {seen[key]}: {path}", 2)
        seen[key] = name


async def _run_lines(plan: _Plan) -> None:
    """Load the engine, run both endpoints' lines, shut the engine down."""
    async with open_serving(plan.job.settings) as serving:
        plan.model = serving.model
        progress = _Progress(plan.summary, plan.job.progress)
        try:
            await run_endpoints(serving.executor(progress.on_result), plan.lines, plan.ledger)
        except* EngineStopped as stopped:
            raise stopped.exceptions[0] from None
        except* (OSError, LedgerError) as failed:  # the output or state file (disk full, ...)
            raise JobError(f"could not record results: {failed.exceptions[0]}", 1) from None
        finally:
            progress.bar.close()
