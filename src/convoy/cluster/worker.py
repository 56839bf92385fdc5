"""The Ray Data map function of `convoy batch --ray`: one engine per actor, one shard per call.

    {"shard": id, "payload": JSON lines} --ShardWorker.__call__ (async: several calls share the
        actor's event loop and engine)--> ShardEngine.run_shard --> ShardAnswer.row()

The engine is built on the first call, on the actor's event loop (where its requests are made),
with torch's threads set to the actor's CPU share. A fatal engine error (the engine is gone) ends
the actor's process: Ray restarts the actor and retries the shard on it (a Python exception
would fail the job instead, as Ray Data does not retry those). A bad line is an error line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from convoy.batch.inprocess import EngineStopped, open_serving
from convoy.batch.offline_state import JobError
from convoy.cluster.engines import FakeShardEngine, ServingShardEngine, ShardEngine
from convoy.cluster.shards import ShardAnswer, decode_payload
from convoy.config import ServerConfig

logger = logging.getLogger(__name__)

CRASH_EXIT_CODE = 70  # the actor's exit status when its engine is gone (EX_SOFTWARE)


@dataclass(slots=True)
class FaultHooks:
    """Test hooks, off unless the driver's environment names them (it passes them to actors):

    CONVOY_TEST_EXIT_MARKER=PATH   the actor that answers a line while PATH does not exist
                                   creates it and exits at once (mid-shard, once per job)
    CONVOY_TEST_SHARD_CALLS=DIR    each shard run appends a line to DIR/<shard id>: the count
                                   of times the engine was given that shard
    """

    exit_marker: str | None = None
    shard_calls: str | None = None

    @classmethod
    def from_env(cls) -> FaultHooks:
        env = os.environ.get
        return cls(env("CONVOY_TEST_EXIT_MARKER"), env("CONVOY_TEST_SHARD_CALLS"))

    def as_kwargs(self) -> dict[str, str | None]:
        return asdict(self)

    def on_result(self, *_: object) -> None:
        if self.exit_marker is None:
            return
        try:
            os.close(os.open(self.exit_marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        logger.warning("test hook: exiting mid-shard (%s)", self.exit_marker)
        os._exit(1)

    def count_call(self, shard: str) -> None:
        if self.shard_calls is not None:
            with open(Path(self.shard_calls) / shard, "a") as f:
                f.write(f"{os.getpid()}\n")


class ShardWorker:
    """A Ray Data callable class: Ray builds one per actor, then calls it with one-row batches."""

    def __init__(
        self, settings: dict[str, Any], fake_engine: str | None, threads: int,
        hooks: dict[str, str | None],
    ) -> None:  # fmt: skip
        self.settings = ServerConfig.from_kwargs(**settings)
        self.fake_engine = fake_engine
        self.threads = threads
        self.hooks = FaultHooks(**hooks)
        self._engine: ShardEngine | None = None
        self._stack = contextlib.AsyncExitStack()  # the engine's; open for the actor's life
        self._lock: asyncio.Lock | None = None

    async def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        (shard,), (payload,) = batch["shard"], batch["payload"]
        engine = await self._ready()
        self.hooks.count_call(str(shard))
        try:
            results = await engine.run_shard(decode_payload(str(payload)))
        except EngineStopped as e:
            logger.error("%s: ending this actor, so that Ray retries its shards", e)
            os._exit(CRASH_EXIT_CODE)
        return ShardAnswer.of(str(shard), results).row()

    async def _ready(self) -> ShardEngine:
        """The actor's engine, built by the first call (the others wait for it)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._engine is None:
                self._engine = await self._build()
        return self._engine

    async def _build(self) -> ShardEngine:
        settings = self.settings
        if self.fake_engine is not None:
            model = settings.served_model_name or settings.engine.model or "fake"
            return FakeShardEngine(self.fake_engine, model, self.hooks.on_result)
        import torch

        torch.set_num_threads(self.threads)  # its CPU share (OMP_NUM_THREADS is set too)
        try:
            serving = await self._stack.enter_async_context(open_serving(settings))
        except JobError as e:  # the model cannot load: no retry makes it load
            raise RuntimeError(str(e)) from None
        return ServingShardEngine(serving, self.hooks.on_result)
