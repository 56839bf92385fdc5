"""AsyncEngine: one background step loop shared by every request; asyncio front end for the server.

    server coroutine --generate()--> input queue --> [step thread: EngineFrontend.step() in a loop]
          ^                                                        |
          +------------- per-request asyncio.Queue <--- outputs ---+

The step loop runs in a thread (torch releases the GIL while it computes), so the event loop keeps
serving HTTP. Every call into the frontend and the core happens on that thread: `generate` and
`abort` only hand work over under a lock. Inside a long step the same thread may take new
interactive requests over and run them in a side step between two layers (EngineCore,
`--side-step-ms`); aborts wait for the step's end.

Failures end requests, never hang them: a failed step ends the requests it ran with
EngineStepError and the loop goes on; if the thread dies (anything escaping the loop) every
waiting request ends with EngineDeadError, and so does every later `generate`. At shutdown the
requests still in flight end with EngineShutdownError (not with a finish reason `abort`, which
OpenAI clients do not know).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable

from convoy.config import EngineConfig
from convoy.engine.core import EngineCore, SideSteps
from convoy.engine.errors import (
    EngineDeadError,
    EngineError,
    EngineShutdownError,
    EngineStepError,
)
from convoy.engine.frontend import EngineFrontend
from convoy.engine.request import EngineRequest, Priority
from convoy.engine.stats import EngineStats
from convoy.outputs import RequestOutput

logger = logging.getLogger(__name__)

_Queue = asyncio.Queue[RequestOutput | BaseException]  # a request's outputs, or what ended it
_FAILED = "the engine failed while running this request"
_DEAD = "the engine stopped after an internal error; this server cannot serve requests"
_SHUTDOWN = "the server is shutting down"


def _step_failed() -> EngineError:
    return EngineStepError(_FAILED)


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        """Load the model and tokenizer (slow) on the engine thread; steps begin with `start()`.

        NOTE: the thread that loads the model is the thread that steps it. Every thread that runs
        torch's parallel ops gets its own OpenMP pool; with a second pool alive (the loading
        thread's) on a 2-core machine libgomp stops spinning at barriers, and one-stream decode
        ran at half speed (measured: 35 vs 75 tok/s, SmolLM2 with --keep-gguf-quantized).
        """
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._pending: list[tuple[EngineRequest, _Queue]] = []
        self._aborts: list[str] = []
        # Every request whose generate() is still open, by id: what to tell when things fail.
        self._queues: dict[str, _Queue] = {}
        self._stopping = False
        self._dead = False
        self._loop: asyncio.AbstractEventLoop | None = None
        loaded = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._main, args=(config, loaded, failure), name="convoy-engine", daemon=True
        )
        self._thread.start()
        loaded.wait()
        if failure:
            raise failure[0]
        self.tokenizer = self.core.tokenizer
        self.model_name = self.core.model_name
        self.max_model_len = self.core.max_model_len
        self.pooling = self.core.pooling
        self.hidden_size = self.core.worker.model_config.hidden_size  # an embedding's length

    async def start(self) -> None:
        with self._wakeup:
            self._loop = asyncio.get_running_loop()
            self._wakeup.notify()

    async def shutdown(self) -> None:
        """Stop the step loop after the current step; requests in flight end with
        EngineShutdownError."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        await asyncio.to_thread(self._thread.join)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs for one prompt until it finishes (per `params.output_kind`).

        `request` comes from the front door, `self.frontend.inputs.process(...)`. Raises an
        EngineError subclass when the engine fails the request (see the module docstring).
        Closing the iterator early (client gone, task cancelled) aborts every sequence of it.
        """
        assert self._loop is not None, "AsyncEngine.start() was not called"
        queue: _Queue = asyncio.Queue()
        with self._wakeup:
            self._check_available()
            self._pending.append((request, queue))
            self._queues[request.request_id] = queue
            self._wakeup.notify()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._wakeup:
                self._queues.pop(request.request_id, None)
            if not finished:
                await self.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request: its sequences leave the batch and free their KV blocks at the next step."""
        with self._wakeup:
            if self._dead or self._stopping:
                return  # no step will run again: nothing to free
            self._aborts.append(request_id)
            self._wakeup.notify()

    def check_available(self) -> None:
        """Raise EngineDeadError / EngineShutdownError if new requests cannot be served (before a stream starts,
        so that the client gets a status rather than an error inside a 200 stream)."""
        with self._wakeup:
            self._check_available()

    @property
    def is_running(self) -> bool:
        """Is the step loop alive (for health checks)?"""
        return (
            self._loop is not None
            and self._thread.is_alive()
            and not self._stopping
            and not self._dead
        )

    def stats(self) -> EngineStats:
        """The counters as of the engine's last step or abort (safe from any thread)."""
        return self.core.last_stats

    def _check_available(self) -> None:
        """Under the lock."""
        if self._dead:
            raise EngineDeadError(_DEAD)
        if self._stopping:
            raise EngineShutdownError(_SHUTDOWN)

    def _put(self, queue: _Queue, item: RequestOutput | BaseException) -> None:
        """Hand an output (or an error ending the request) to its coroutine's queue."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(queue.put_nowait, item)

    def _fail(self, request_ids: Iterable[str], make_error: Callable[[], Exception]) -> None:
        """End these requests with an error (a fresh one each: an exception raised in several
        coroutines would chain their tracebacks together)."""
        with self._wakeup:
            queues = [q for rid in request_ids if (q := self._queues.get(rid)) is not None]
        for queue in queues:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody waits
                self._put(queue, make_error())

    def _main(
        self, config: EngineConfig, loaded: threading.Event, failure: list[BaseException]
    ) -> None:
        try:
            self.core = EngineCore(config)
            self.frontend = EngineFrontend(self.core)
            self.core.grammars.load()  # now, not in a request: building it holds the GIL
            self.core.side_steps = SideSteps(self._newcomers_waiting, self._side_step)
        except BaseException as e:  # noqa: BLE001 - re-raised in the constructing thread
            failure.append(e)
            return
        finally:
            loaded.set()
        with self._wakeup:  # steps begin once start() has given us the event loop
            while self._loop is None and not self._stopping:
                self._wakeup.wait()
        try:
            while self._run_once():
                pass
        except BaseException as e:  # noqa: BLE001 - the thread ends here; nobody may hang
            logger.critical("the engine thread died; failing every request", exc_info=e)
            with self._wakeup:
                self._dead = True
                self._pending, self._aborts = [], []
                everyone = list(self._queues)
            self._fail(everyone, lambda: EngineDeadError(_DEAD))

    def _run_once(self) -> bool:
        """One turn of the loop: take new requests and aborts, run a step. False at shutdown."""
        with self._wakeup:
            while not (self._pending or self._aborts or self._stopping or self.core.has_work()):
                self._wakeup.wait()
            pending, self._pending = self._pending, []
            aborts, self._aborts = self._aborts, []
            stopping = self._stopping
            everyone = list(self._queues) if stopping else []
        if stopping:
            self.frontend.abort_all(emit=False)  # frees their blocks
            self._fail(everyone, lambda: EngineShutdownError(_SHUTDOWN))
            return False
        for request, queue in pending:
            self._add(request, queue)
        for request_id in aborts:
            self.frontend.abort(request_id)
        if self.frontend.has_work():
            self._step()
        return True

    def _add(self, request: EngineRequest, queue: _Queue) -> None:
        try:
            self.frontend.add(request, functools.partial(self._put, queue))
        except Exception:  # noqa: BLE001 - this request fails; the others go on
            logger.exception("queueing request %s failed", request.request_id)
            self.frontend.abort(request.request_id, emit=False)  # what of it was queued
            self._fail([request.request_id], _step_failed)

    def _newcomers_waiting(self) -> bool:
        """Between two layers of a step: has an interactive request arrived? (Called every
        layer: an empty list, the usual answer, is read without the lock.)"""
        if not self._pending:
            return False
        with self._lock:
            return any(r.priority == Priority.INTERACTIVE for r, _ in self._pending)

    def _side_step(self) -> None:
        """Between two layers of a step: take the new requests over and run a side step for
        them (EngineCore). Its failures end its requests only; the step in flight goes on."""
        with self._wakeup:
            pending, self._pending = self._pending, []
        for request, queue in pending:
            self._add(request, queue)
        try:
            self.frontend.side_step()
        except EngineStepError as e:  # the frontend has ended those requests already
            self._end_failed(e)
        except Exception:  # noqa: BLE001 - outside the model run: end the newcomers only
            logger.exception("side step failed; ending its new request(s)")
            request_ids = [request.request_id for request, _ in pending]
            for request_id in request_ids:
                self.frontend.abort(request_id, emit=False)
            self._fail(request_ids, _step_failed)

    def _end_failed(self, e: EngineStepError) -> None:
        """Tell the requests a failed step named (the frontend has ended them already)."""
        if e.errors:  # constraints that failed: the clients' errors, not the engine's
            logger.warning("ending %d request(s): %s", len(e.request_ids), e)
        else:
            logger.error(
                "engine step failed; ending its %d request(s)", len(e.request_ids), exc_info=e
            )
        for request_id in e.request_ids:
            make_error: Callable[[], Exception] = _step_failed
            if request_id in e.errors:  # one request, one coroutine: the error itself
                make_error = functools.partial(e.errors.__getitem__, request_id)
            self._fail([request_id], make_error)

    def _step(self) -> None:
        try:
            self.frontend.step()
        except EngineStepError as e:
            self._end_failed(e)
        except Exception:  # noqa: BLE001 - outside the model run: end everything in flight
            logger.exception("engine step failed; ending every request in flight")
            request_ids = list(self.frontend.parents)
            self.frontend.abort_all(emit=False)
            self._fail(request_ids, _step_failed)
