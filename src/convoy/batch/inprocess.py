"""Batch lines over an engine in this process: no HTTP, the same serving objects and executor as
the Batch API. `convoy batch` (offline.py) runs one; each cluster actor of `convoy batch --ray`
runs one and keeps it for every shard it is given.

    open_serving(settings) --> AsyncEngine + ChatServing / CompletionServing --.executor()-->
        BatchExecutor --run_endpoints(lines of each endpoint)--> LineResults to a ledger
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from convoy.api.engine_client import EngineClient, ServingLimits
from convoy.api.protocol_batch import ENDPOINTS
from convoy.api.protocol_chat import ChatCompletionRequest
from convoy.api.protocol_completions import CompletionRequest
from convoy.api.protocol_embeddings import EmbeddingRequest
from convoy.api.protocol_responses import ResponsesRequest
from convoy.api.serving_chat import ChatServing
from convoy.api.serving_completion import CompletionServing
from convoy.api.serving_embedding import EmbeddingServing
from convoy.api.serving_responses import ResponsesServing
from convoy.batch.executor import BatchExecutor, Ledger, LineResult, Route
from convoy.batch.lines import InputLine
from convoy.batch.offline_state import JobError
from convoy.batch.service import WINDOW_PER_SEQ
from convoy.config import ServerConfig
from convoy.engine.errors import EngineUnavailableError

LinesOf = Callable[[str], Iterable[InputLine | LineResult]]  # an endpoint's lines


@dataclass(slots=True)
class InProcessServing:
    model: str  # the served model name the lines' bodies must name
    routes: dict[str, Route]
    window: int  # lines in flight: 2 x --max-num-seqs

    def executor(self, on_result: Callable[[LineResult], None] | None = None) -> BatchExecutor:
        """An executor over these routes; runs that share it share its window of lines."""
        return BatchExecutor(self.routes, self.window, on_result)


class EngineStopped(JobError):
    """The engine is gone (dead or shut down): the run stopped, its unfinished lines unanswered."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 1)


async def run_endpoints(executor: BatchExecutor, lines_of: LinesOf, ledger: Ledger) -> None:
    """Both endpoints' lines as two concurrent executor runs sharing its window. Raises
    EngineStopped when the engine is gone, or an ExceptionGroup of the ledger's errors."""
    try:
        async with asyncio.TaskGroup() as group:
            for endpoint in ENDPOINTS:
                group.create_task(executor.run(endpoint, lines_of(endpoint), ledger))
    except* EngineUnavailableError as failed:
        message = f"the engine stopped: {failed.exceptions[0]}; run again to resume"
        raise EngineStopped(message) from None


@contextlib.asynccontextmanager
async def open_serving(settings: ServerConfig) -> AsyncIterator[InProcessServing]:
    """Load the engine (JobError, exit 1, when it cannot load), start it, and shut it down when
    the block ends. Batch lines are the only traffic, so they may fill the engine: the batch
    class's sequence cap is --max-num-seqs and the window 2 x that."""
    from convoy.engine.async_engine import AsyncEngine

    scheduler = settings.engine.scheduler
    scheduler.batch_max_seqs = scheduler.max_num_seqs
    try:
        # Loading is slow and synchronous; the engine's own thread steps it afterwards.
        engine = await asyncio.to_thread(AsyncEngine, settings.engine)
    except Exception as e:  # noqa: BLE001 - any load failure ends the job with its message
        raise JobError(f"could not load the model: {e}", 1) from e
    try:
        await engine.start()
        client = EngineClient(
            engine,
            settings.served_model_name or engine.model_name,
            ServingLimits.of(settings),
            settings.reasoning_parser,
        )
        chat = ChatServing(client)
        routes = {
            "/v1/completions": Route(CompletionRequest, CompletionServing(client)),
            "/v1/chat/completions": Route(ChatCompletionRequest, chat),
            "/v1/embeddings": Route(EmbeddingRequest, EmbeddingServing(client)),
            "/v1/responses": Route(ResponsesRequest, ResponsesServing(chat, None)),
        }
        yield InProcessServing(
            client.served_model_name, routes, WINDOW_PER_SEQ * scheduler.max_num_seqs
        )
    finally:
        await engine.shutdown()
