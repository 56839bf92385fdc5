"""AsyncEngine: one background step loop shared by every request; asyncio front end for the server.

    server coroutine --generate()--> input queue --> [step thread: EngineCore.step() in a loop]
          ^                                                        |
          +------------- per-request asyncio.Queue <--- outputs ---+

The step loop runs in a thread (torch releases the GIL while it computes), so the event loop keeps
serving HTTP. `n > 1` is expanded here: child sequences `{req_id}#{j}` share one output queue and
come back as one RequestOutput whose CompletionOutputs carry their choice index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from convoy.config import EngineConfig
from convoy.engine.core import EngineCore
from convoy.engine.fanout import FanOut
from convoy.outputs import RequestOutput
from convoy.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    num_running: int  # sequences
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_prompt_tokens: int  # totals since start
    num_generation_tokens: int
    num_preemptions: int


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        """Load the model and tokenizer (slow); the step thread starts with `start()`."""
        self.core = EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self.model_name = self.core.model_name
        self.max_model_len = self.core.max_model_len
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._pending: list[tuple[str, FanOut]] = []
        self._aborts: list[str] = []
        self._fanouts: dict[str, FanOut] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="convoy-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the step loop after the current step; running requests end with `abort`."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise SamplingParamsError (with the offending `param`) before any work is queued."""
        self.core.validate(prompt_token_ids, params)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        group_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs for one prompt until it finishes (per `params.output_kind`).

        `group_id` ties together the prompts of one API request for fair scheduling. Closing the
        iterator early (client gone, task cancelled) aborts every child sequence at once.
        """
        self.validate(prompt_token_ids, params)
        assert self._loop is not None, "AsyncEngine.start() was not called"
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        fanout = FanOut(
            request_id, prompt, prompt_token_ids, params, group_id or request_id, time.monotonic(),
            emit=lambda out: self._loop.call_soon_threadsafe(queue.put_nowait, out),  # type: ignore[union-attr]
        )  # fmt: skip
        with self._wakeup:
            if self._stopping:
                raise RuntimeError("engine is shutting down")
            self._pending.append((request_id, fanout))
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
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request: its sequences leave the batch and free their KV blocks at the next step."""
        with self._wakeup:
            self._aborts.append(request_id)
            self._wakeup.notify()

    @property
    def is_running(self) -> bool:
        """Is the step loop alive (for health checks)?"""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def stats(self) -> EngineStats:
        return self.core.stats()

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not (self._pending or self._aborts or self._stopping or self.core.has_work()):
                    self._wakeup.wait()
                pending, self._pending = self._pending, []
                aborts, self._aborts = self._aborts, []
                stopping = self._stopping
            for req_id, fanout in pending:
                self._fanouts[req_id] = fanout
                self.core.add_fanout(fanout)
            for req_id in aborts:
                aborted = self._fanouts.pop(req_id, None)
                if aborted is not None:
                    self.core.abort_fanout(aborted)
            if stopping:
                for fanout in list(self._fanouts.values()):
                    self.core.abort_fanout(fanout)
                self._fanouts.clear()
                return
            try:
                finished = self.core.step()
            except Exception as e:  # noqa: BLE001 - hand the error to every waiting request
                logger.exception("engine step failed")
                for fanout in list(self._fanouts.values()):
                    with contextlib.suppress(Exception):
                        self.core.abort_fanout(fanout, emit=False)
                    fanout.emit(e)  # type: ignore[arg-type]
                self._fanouts.clear()
                continue
            for req_id in finished:
                self._fanouts.pop(req_id, None)
