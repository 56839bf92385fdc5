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

from convoy.api.batch.db import fsync_dir
from convoy.api.batch.executor import BatchExecutor, LineResult, Route, line_error_result
from convoy.api.batch.ledger import PartFiles
from convoy.api.batch.lines import InputLine, LineError, check_line, load_line, raw_lines
from convoy.api.batch.offline_state import STATE_SUFFIX, JobError, StateFile
from convoy.api.batch.protocol import ENDPOINTS
from convoy.api.batch.routes import WINDOW_PER_SEQ
from convoy.api.engine_client import EngineClient, ServingLimits
from convoy.api.protocol import ChatCompletionRequest, CompletionRequest
from convoy.api.serving_chat import ChatServing
from convoy.api.serving_completion import CompletionServing
from convoy.config import ServerConfig
from convoy.engine.errors import EngineUnavailableError

__all__ = ["STATE_SUFFIX", "BatchSummary", "JobError", "OfflineJob", "run_batch"]


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


@dataclass(slots=True)
class _Scanned:
    """One line of the input as the scan sees it, before the model is known."""

    number: int  # 1-based line of the file
    custom_id: str | None  # a string seen first here: the line's key; else the number is
    line: dict[str, object] | LineError

    @property
    def url(self) -> object:
        return self.line.get("url") if isinstance(self.line, dict) else None


def _scan(path: Path, max_line_bytes: int) -> Iterator[_Scanned]:
    """Every non-blank line, loaded. A custom_id used before is a duplicate: that line gets no
    key of its own, so each custom_id names one answer."""
    seen: set[str] = set()
    for number, raw in raw_lines(path, max_line_bytes):
        try:
            line = load_line(raw)
        except LineError as e:
            yield _Scanned(number, None, e)
            continue
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            yield _Scanned(number, None, line)  # check_line says what is wrong
        elif custom_id in seen:
            message = f"custom_id {custom_id!r} is used by an earlier line"
            yield _Scanned(number, None, LineError("duplicate_custom_id", message, "custom_id"))
        else:
            seen.add(custom_id)
            yield _Scanned(number, custom_id, line)


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
        """The uncommitted lines for `endpoint`; the first endpoint's stream also answers the
        lines that name no endpoint or cannot be read."""
        is_first = endpoint == ENDPOINTS[0]
        for item in _scan(self.job.input, self.job.settings.max_request_bytes):
            if self.state.is_done(item.custom_id, item.number):
                continue
            if item.url != endpoint and (item.url in ENDPOINTS or not is_first):
                continue
            try:
                if isinstance(item.line, LineError):
                    raise item.line
                if item.url not in ENDPOINTS:
                    raise LineError("invalid_url", f"url must be one of {', '.join(ENDPOINTS)}")
                custom_id, body = check_line(item.line, endpoint, self.model)
            except LineError as e:
                located = LineError(e.code, f"line {item.number}: {e.message}", e.param)
                yield line_error_result(item.number, located, item.custom_id)
                continue
            yield InputLine(item.number, item.number, custom_id, body)

    async def ledger(self, results: list[LineResult]) -> None:
        """Append + fsync the results, then record them in the state file (+ fsync)."""

        def record(output_bytes: int, error_bytes: int) -> None:
            self.state.commit(results, output_bytes, error_bytes)

        await asyncio.to_thread(self.parts.append, results, record)


def run_batch(job: OfflineJob) -> BatchSummary:
    """Run every line of `job.input` not yet answered; raises JobError when the job cannot run."""
    _check_paths(job)
    try:
        with open(job.input, "rb"):  # unreadable: fail before anything is written
            pass
        state = StateFile.open(job.state, job.input, job.output, job.error)
        total = skipped = 0
        for item in _scan(job.input, job.settings.max_request_bytes):
            total += 1
            skipped += state.is_done(item.custom_id, item.number)
        parts = PartFiles(job.output, job.error, state.output_bytes, state.error_bytes)
        for folder in {job.output.parent, (job.error or job.output).parent}:
            fsync_dir(folder)  # the files just created survive a power loss
    except OSError as e:
        raise JobError(f"{e.filename}: {e.strerror}" if e.filename else str(e), 1) from None
    plan = _Plan(job, state, parts, BatchSummary(total, skipped))
    if skipped < total:
        asyncio.run(_run_lines(plan))
    return plan.summary


def _check_paths(job: OfflineJob) -> None:
    """Refuse (exit 2) a job whose files overlap: an output must never overwrite the input."""
    named = {"input": job.input, "output": job.output, "state file": job.state}
    if job.error is not None:
        named["error file"] = job.error
    seen: dict[str, str] = {}
    for what, path in named.items():
        key = os.path.realpath(path)
        if key in seen:
            raise JobError(f"the {what} is the same file as the {seen[key]}: {path}", 2)
        seen[key] = what


async def _run_lines(plan: _Plan) -> None:
    """Load the engine, run both endpoints' lines, shut the engine down."""
    from convoy.engine.async_engine import AsyncEngine

    settings = plan.job.settings
    scheduler = settings.engine.scheduler
    scheduler.batch_max_seqs = scheduler.max_num_seqs  # no interactive traffic to make room for
    try:
        # Loading is slow and synchronous; the engine's own thread steps it afterwards.
        engine = await asyncio.to_thread(AsyncEngine, settings.engine)
    except Exception as e:  # noqa: BLE001 - any load failure ends the job with its message
        raise JobError(f"could not load the model: {e}", 1) from e
    try:
        await engine.start()
        client = EngineClient(
            engine, settings.served_model_name or engine.model_name, ServingLimits.of(settings)
        )
        plan.model = client.served_model_name
        routes = {
            "/v1/completions": Route(CompletionRequest, CompletionServing(client)),
            "/v1/chat/completions": Route(ChatCompletionRequest, ChatServing(client)),
        }
        progress = _Progress(plan.summary, plan.job.progress)
        window = WINDOW_PER_SEQ * settings.engine.scheduler.max_num_seqs
        executor = BatchExecutor(routes, window, progress.on_result)
        try:
            async with asyncio.TaskGroup() as group:
                for endpoint in ENDPOINTS:
                    group.create_task(executor.run(endpoint, plan.lines(endpoint), plan.ledger))
        except* EngineUnavailableError as failed:
            message = f"the engine stopped: {failed.exceptions[0]}; run again to resume"
            raise JobError(message, 1) from None
        except* OSError as failed:  # the output files or the state file (disk full, ...)
            raise JobError(f"could not record results: {failed.exceptions[0]}", 1) from None
        finally:
            progress.bar.close()
    finally:
        await engine.shutdown()
