"""Running batch lines: each line calls the same serving code as an HTTP request, in the engine's
batch priority class, at most `window` lines at a time; finished lines go to a ledger in groups.

    lines --(window)--> serving.create(body, priority=BATCH) --> LineResult --(groups)--> ledger

Shared by the server's Batch API (`runner.py`) and `convoy batch` (`offline.py`). A line never
fails the run: a bad body or a failed step is that line's error result. Only an engine that is
gone (dead, shutting down) stops the run, leaving its lines uncommitted to run again later, and
so does a ledger that cannot commit (LedgerError: a full disk, a database error), which ends the
lines in flight at once: nothing is computed that could not be kept.

Off the event loop: the lines are pulled from their iterator (file reads, JSON parsing) in a
worker thread, a few at a time, and a large body is validated in one (`off_loop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from convoy.api.errors import from_exception, validation_error
from convoy.api.serving_base import off_loop
from convoy.batch.lines import InputLine, LineError
from convoy.engine.errors import EngineUnavailableError
from convoy.engine.request import Priority

logger = logging.getLogger(__name__)

FLUSH_LINES = 64  # a commit (one fsync per part file + one transaction) every this many lines
FLUSH_S = 0.25  # or this often, when lines finish slowly
# Finished lines not yet committed, at most (plus the window): a ledger slower than the lines
# (a slow disk, a busy machine) holds the next lines back instead of letting results pile up.
PENDING_LINES = 2 * FLUSH_LINES
PULL_LINES = 64  # lines pulled from the input in one worker-thread hop...
PULL_BYTES = 1 << 20  # ...or fewer, once their bodies hold this many bytes


class LedgerError(Exception):
    """The ledger cannot make results durable (or its files are not what it committed): the
    run stops, and what was committed before stays."""


@dataclass(slots=True)
class LineResult:
    index: int
    custom_id: str | None
    ok: bool  # 200: the output file; else the error file
    text: str  # the whole output line, newline included
    input_tokens: int = 0
    output_tokens: int = 0


Ledger = Callable[[list[LineResult]], Awaitable[None]]  # make a group of results durable
# A line run elsewhere (`convoy serve --replicas`: on an engine replica); EngineUnavailableError
# stops the run as a local route's would.
LineRunner = Callable[[InputLine], Awaitable[LineResult]]


class Serving(Protocol):
    """What a batch line runs on: a serving object's `create` (ServingBase, ResponsesServing)."""

    async def create(self, request: Any, *, priority: Priority) -> Any: ...


@dataclass(slots=True)
class Route:
    """One endpoint a batch may name: its request model and serving object."""

    request_type: type[BaseModel]
    serving: Serving


def response_line(custom_id: str | None, status: int, body_json: str) -> str:
    """OpenAI's batch output line around an HTTP answer (`body_json`: what the route returns)."""
    return (
        f'{{"id": "batch_req_{uuid.uuid4().hex}", "custom_id": {json.dumps(custom_id)},'
        f' "response": {{"status_code": {status}, "request_id": "req_{uuid.uuid4().hex}",'
        f' "body": {body_json}}}, "error": null}}\n'
    )


def error_line(custom_id: str | None, code: str, message: str) -> str:
    """A line that got no HTTP answer (unparsable, expired): `response` null, `error` set."""
    error = json.dumps({"code": code, "message": message})
    return (
        f'{{"id": "batch_req_{uuid.uuid4().hex}", "custom_id": {json.dumps(custom_id)},'
        f' "response": null, "error": {error}}}\n'
    )


def line_error_result(index: int, err: LineError, custom_id: str | None = None) -> LineResult:
    return LineResult(index, custom_id, False, error_line(custom_id, err.code, err.message))


class BatchExecutor:
    """Runs batches' lines; `window` bounds the lines in flight over all runs together."""

    def __init__(
        self, routes: Mapping[str, Route | LineRunner], window: int,
        on_result: Callable[[LineResult], None] | None = None,  # metrics, progress bars
    ) -> None:  # fmt: skip
        self.routes = routes
        self.window = window
        self.on_result = on_result
        self._slots = asyncio.Semaphore(window)

    async def run(
        self, endpoint: str, lines: Iterable[InputLine | LineResult], ledger: Ledger
    ) -> None:
        """Run every line (a LineResult is already answered: only committed), in the window.

        Cancelling the run cancels the lines in flight (their engine requests are aborted) and
        commits what had finished before returning. An EngineUnavailableError (engine dead or
        shutting down) stops the run the same way and is raised.
        """
        run = _Run(self.routes[endpoint], ledger, self.on_result)
        flusher = asyncio.create_task(run.flush_every())
        try:
            async with contextlib.aclosing(pulled(iter(lines))) as feed:
                async for line in feed:
                    while len(run.pending) >= PENDING_LINES and not run.failure:
                        run.drained.clear()
                        await run.drained.wait()
                    await self._slots.acquire()
                    if run.failure:
                        self._slots.release()
                        break
                    task = asyncio.create_task(run.one(line))
                    run.tasks.add(task)
                    task.add_done_callback(run.tasks.discard)
                    # NOTE: a done callback, not a `finally` in the task: a task cancelled
                    # before it first ran never enters its body, and its slot would be lost
                    # (the loop above then waited for a slot for ever).
                    task.add_done_callback(lambda _: self._slots.release())
            while run.tasks and not run.failure:
                await asyncio.wait(set(run.tasks), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in run.tasks:
                task.cancel()
            await asyncio.gather(*run.tasks, return_exceptions=True)
            run.stop.set()
            # NOTE: shielded: a commit in progress must end before anyone moves the part files.
            await asyncio.shield(flusher)
        if run.failure:
            raise run.failure[0]


class _Run:
    """One run's lines in flight and finished results not yet committed."""

    def __init__(
        self, route: Route | LineRunner, ledger: Ledger,
        on_result: Callable[[LineResult], None] | None,
    ) -> None:  # fmt: skip
        self.run_line = partial(run_line, route) if isinstance(route, Route) else route
        self.ledger, self.on_result = ledger, on_result
        self.tasks: set[asyncio.Task[None]] = set()
        self.failure: list[BaseException] = []
        self.pending: list[LineResult] = []
        self.drained = asyncio.Event()  # set whenever `pending` was taken for a commit
        self.stop = asyncio.Event()

    async def one(self, line: InputLine | LineResult) -> None:
        try:
            result = line if isinstance(line, LineResult) else await self.run_line(line)
        except EngineUnavailableError as e:
            self.failure.append(e)
            return
        self.pending.append(result)
        if self.on_result is not None:
            self.on_result(result)

    async def flush_every(self) -> None:
        """Commit finished lines in groups until the run stops, then the rest.

        A commit that fails stops the run: the lines in flight are cancelled (their engine
        requests aborted), and the run raises LedgerError; nothing more is committed.
        """
        try:
            while not self.stop.is_set():
                if len(self.pending) < FLUSH_LINES:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stop.wait(), FLUSH_S)
                await self._commit()
            await self._commit()
        except Exception as e:  # noqa: BLE001 - disk full, a database error: the run's failure
            logger.error("batch results could not be committed: %s", e)
            self.failure.append(e if isinstance(e, LedgerError) else LedgerError(str(e)))
            self.pending.clear()
            self.drained.set()
            for task in self.tasks:
                task.cancel()

    async def _commit(self) -> None:
        if self.pending:
            group, self.pending = self.pending, []
            self.drained.set()
            await self.ledger(group)


async def pulled(
    lines: Iterator[InputLine | LineResult],
) -> AsyncGenerator[InputLine | LineResult, None]:
    """`lines`, advanced in a worker thread a group at a time (at most PULL_LINES lines, or
    fewer holding PULL_BYTES of bodies): reading and parsing the input never runs on the loop."""

    def group() -> list[InputLine | LineResult]:
        taken: list[InputLine | LineResult] = []
        num_bytes = 0
        for line in itertools.islice(lines, PULL_LINES):
            taken.append(line)
            num_bytes += len(line.body) if isinstance(line, InputLine) else len(line.text)
            if num_bytes >= PULL_BYTES:
                break
        return taken

    while taken := await asyncio.to_thread(group):
        for line in taken:
            yield line


async def run_line(route: Route, line: InputLine) -> LineResult:
    """One line through the serving code, as its HTTP request would run (greedy output equal)."""
    try:
        try:
            request = await off_loop(
                len(line.body), route.request_type.model_validate_json, line.body
            )
        except ValidationError as e:
            located = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
            raise validation_error(RequestValidationError(located)) from None
        response = await route.serving.create(request, priority=Priority.BATCH)
        assert isinstance(response, BaseModel)  # stream: true was refused when the line was read
    except EngineUnavailableError:
        raise
    except Exception as e:  # noqa: BLE001 - the line's own error, as HTTP would answer it
        return failed_result(line, e)
    tokens_in, tokens_out = _usage(getattr(response, "usage", None))
    return LineResult(
        line.index, line.custom_id, True,
        response_line(line.custom_id, 200, response.model_dump_json()),
        tokens_in, tokens_out,
    )  # fmt: skip


def _usage(usage: Any) -> tuple[int, int]:
    """(input, output) tokens of a response's usage: chat's and completions' model, embeddings'
    (no output), or a Responses object's dict."""
    if isinstance(usage, dict):
        return int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)
    return getattr(usage, "prompt_tokens", 0), getattr(usage, "completion_tokens", 0)


def unavailable_result(line: InputLine, message: str) -> LineResult:
    """The line's 503, when no engine could run it (`message` says why)."""
    return failed_result(line, EngineUnavailableError(message))


def failed_result(line: InputLine, e: Exception) -> LineResult:
    """The line's error response, as its HTTP request would get it (a 500 for a bug)."""
    err = from_exception(e)
    body = err.to_response().model_dump_json()
    return LineResult(
        line.index, line.custom_id, False, response_line(line.custom_id, err.status, body)
    )
