"""AsyncEngine: one background step loop shared by every request; asyncio front end for the server.

    server coroutine --generate()--> input queue --> [step thread: EngineFrontend.step() in a loop]
          ^                                                        |
          +------------- per-request asyncio.Queue <--- outputs ---+

The step loop runs in a thread (torch releases the GIL while it computes), so the event loop keeps
serving HTTP. Every call into the frontend and the core happens on that thread: `generate` and
`abort` only hand work over under a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import AsyncIterator

from convoy.config import EngineConfig
from convoy.engine.core import EngineCore
from convoy.engine.frontend import EngineFrontend
from convoy.engine.request import EngineRequest
from convoy.engine.stats import EngineStats
from convoy.outputs import RequestOutput

logger = logging.getLogger(__name__)


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
        self._pending: list[tuple[EngineRequest, asyncio.Queue[RequestOutput | BaseException]]] = []
        self._aborts: list[str] = []
        self._stopping = False
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

    async def start(self) -> None:
        with self._wakeup:
            self._loop = asyncio.get_running_loop()
            self._wakeup.notify()

    async def shutdown(self) -> None:
        """Stop the step loop after the current step; running requests end with `abort`."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        await asyncio.to_thread(self._thread.join)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs for one prompt until it finishes (per `params.output_kind`).

        `request` comes from the front door, `self.frontend.inputs.process(...)`.
        Closing the iterator early (client gone, task cancelled) aborts every sequence of it.
        """
        assert self._loop is not None, "AsyncEngine.start() was not called"
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._wakeup:
            if self._stopping:
                raise RuntimeError("engine is shutting down")
            self._pending.append((request, queue))
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
            if not finished:
                await self.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request: its sequences leave the batch and free their KV blocks at the next step."""
        with self._wakeup:
            self._aborts.append(request_id)
            self._wakeup.notify()

    @property
    def is_running(self) -> bool:
        """Is the step loop alive (for health checks)?"""
        return self._loop is not None and self._thread.is_alive() and not self._stopping

    def stats(self) -> EngineStats:
        return self.core.stats()

    def _put(
        self, queue: asyncio.Queue[RequestOutput | BaseException], item: RequestOutput
    ) -> None:
        """Hand an output (or, on a failed step, an exception) to its coroutine's queue."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(queue.put_nowait, item)

    def _main(
        self, config: EngineConfig, loaded: threading.Event, failure: list[BaseException]
    ) -> None:
        try:
            self.core = EngineCore(config)
            self.frontend = EngineFrontend(self.core)
        except BaseException as e:  # noqa: BLE001 - re-raised in the constructing thread
            failure.append(e)
            return
        finally:
            loaded.set()
        with self._wakeup:  # steps begin once start() has given us the event loop
            while self._loop is None and not self._stopping:
                self._wakeup.wait()
        self._run()

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not (self._pending or self._aborts or self._stopping or self.core.has_work()):
                    self._wakeup.wait()
                pending, self._pending = self._pending, []
                aborts, self._aborts = self._aborts, []
                stopping = self._stopping
            for request, queue in pending:
                self.frontend.add(request, functools.partial(self._put, queue))
            for request_id in aborts:
                self.frontend.abort(request_id)
            if stopping:
                self.frontend.abort_all()
                return
            try:
                self.frontend.step()
            except Exception as e:  # noqa: BLE001 - hand the error to every waiting request
                logger.exception("engine step failed")
                parents = list(self.frontend.parents.values())
                with contextlib.suppress(Exception):
                    self.frontend.abort_all(emit=False)
                for parent in parents:
                    parent.emit(e)  # type: ignore[arg-type]
