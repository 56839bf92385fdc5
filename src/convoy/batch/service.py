"""The Batch API's service in a server: its executor and runner started in the lifespan, the lines
a coordinator sends to this engine (`convoy serve --replicas`), and the batch metrics.

No routes here (`api/routes/batches.py` and `api/routes/files.py` are the HTTP side).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from convoy.api.protocol_chat import ChatCompletionRequest
from convoy.api.protocol_completions import CompletionRequest
from convoy.api.protocol_embeddings import EmbeddingRequest
from convoy.api.protocol_responses import ResponsesRequest
from convoy.batch.db import BatchDB
from convoy.batch.executor import BatchExecutor, LineResult, LineRunner, Route, run_line
from convoy.batch.lines import InputLine
from convoy.batch.runner import BatchRunner
from convoy.batch.store import BatchStore
from convoy.config import ServerConfig
from convoy.engine.errors import EngineUnavailableError

logger = logging.getLogger(__name__)

WINDOW_PER_SEQ = 2  # batch lines in flight per batch sequence slot: keeps the batch full


class BatchMetrics(Collector):
    """Lines done and failed, batch generation tokens (rate() = batch tokens/s), queue depth."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.store: BatchStore | None = None
        self.lines = Counter(
            "convoy_batch_lines", "Batch API lines answered, by outcome.", ["outcome"],
            registry=registry,
        )  # fmt: skip
        self.tokens = Counter(
            "convoy_batch_generation_tokens", "Tokens generated for Batch API lines.",
            registry=registry,
        )  # fmt: skip
        registry.register(self)

    def on_result(self, result: LineResult) -> None:
        self.lines.labels("completed" if result.ok else "failed").inc()
        self.tokens.inc(result.output_tokens)

    def collect(self) -> list[Metric]:
        depth = 0 if self.store is None else self.store.num_pending_lines
        doc = "Request lines of running batches not yet answered."
        return [GaugeMetricFamily("convoy_batch_queue_lines", doc, value=depth)]


def local_routes(state: Any) -> dict[str, Route]:
    """The endpoints a batch may name, over this app's serving objects (`app.state`)."""
    return {
        "/v1/completions": Route(CompletionRequest, state.completions),
        "/v1/chat/completions": Route(ChatCompletionRequest, state.chat),
        "/v1/embeddings": Route(EmbeddingRequest, state.embeddings),
        "/v1/responses": Route(ResponsesRequest, state.responses),
    }


def lines_in_flight(settings: ServerConfig, num_engines: int = 1) -> int:
    """Lines in flight: enough to keep every engine's batch sequence slots full."""
    scheduler = settings.engine.scheduler
    return WINDOW_PER_SEQ * min(scheduler.max_num_seqs, scheduler.batch_max_seqs) * num_engines


def start_batches(
    app: FastAPI, settings: ServerConfig, metrics: BatchMetrics,
    routes: Mapping[str, Route | LineRunner], model: str, window: int,
) -> None:  # fmt: skip
    """In the lifespan, once the lines have somewhere to run: resume unfinished batches.

    `model`: the served model name the lines must name; `window`: lines in flight.
    """
    db: BatchDB | None = app.state.batch_db
    app.state.batch_runner = None
    if db is None:
        return
    executor = BatchExecutor(routes, window, metrics.on_result)
    runner = BatchRunner(db, executor, model, settings.max_request_bytes, settings.batch_retention)
    metrics.store = runner.store
    app.state.batch_runner = runner
    runner.start()


async def serve_line(
    state: Any, endpoint: str, index: int, custom_id: str, body: str
) -> LineResult | None:
    """One line a batch coordinator sent to this app's engine (`convoy serve --replicas`),
    counted in its batch metrics; None when the engine is unavailable (run it elsewhere)."""
    line = InputLine(index, index + 1, custom_id, body)
    try:
        result = await run_line(local_routes(state)[endpoint], line)
    except EngineUnavailableError:
        return None
    state.batch_metrics.on_result(result)
    return result
