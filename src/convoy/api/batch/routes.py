"""/v1/batches routes, the runner's place in the server's lifespan, and the batch metrics."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from convoy.api.batch.db import BatchDB
from convoy.api.batch.executor import BatchExecutor, LineResult, LineRunner, Route, run_line
from convoy.api.batch.lines import InputLine
from convoy.api.batch.protocol import (
    COMPLETION_WINDOWS,
    ENDPOINTS,
    Batch,
    BatchCreateRequest,
    BatchList,
)
from convoy.api.batch.runner import BatchRunner
from convoy.api.batch.store import BatchStore
from convoy.api.errors import APIError
from convoy.api.protocol import ChatCompletionRequest, CompletionRequest
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
        depth = 0 if self.store is None else self.store.pending_lines()
        doc = "Request lines of running batches not yet answered."
        return [GaugeMetricFamily("convoy_batch_queue_lines", doc, value=depth)]


def local_routes(state: Any) -> dict[str, Route]:
    """The endpoints a batch may name, over this app's serving objects (`app.state`)."""
    return {
        "/v1/completions": Route(CompletionRequest, state.completions),
        "/v1/chat/completions": Route(ChatCompletionRequest, state.chat),
    }


def batch_window(settings: ServerConfig, num_engines: int = 1) -> int:
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
    runner = BatchRunner(db, executor, model, settings.max_request_bytes)
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


def _runner(request: Request) -> BatchRunner:
    runner: BatchRunner | None = request.app.state.batch_runner
    if runner is None:
        raise APIError(
            503,
            "batches are disabled: the data folder is held by another Convoy process",
            code="batches_unavailable",
        )
    return runner


def _json(model: Batch | BatchList) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def add_batch_routes(app: FastAPI, settings: ServerConfig) -> None:
    @app.post("/v1/batches", response_model=Batch)
    async def create_batch(body: BatchCreateRequest, request: Request) -> Response:
        runner = _runner(request)
        if body.endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
        if body.completion_window not in COMPLETION_WINDOWS:
            raise APIError(400, "completion_window must be '24h'", "completion_window")
        batch = runner.store.create(
            body.endpoint, body.input_file_id, body.completion_window, body.metadata,
            settings.batch_window,
        )  # fmt: skip
        if batch is None:
            file = runner.db.get_file(body.input_file_id)
            if file is None:
                raise APIError(404, f"No such File object: {body.input_file_id}", "input_file_id")
            raise APIError(
                400, f"the input file's purpose is {file.purpose!r}, not 'batch'", "input_file_id"
            )
        runner.submit(batch.id)
        return _json(batch)

    @app.get("/v1/batches/{batch_id}", response_model=Batch)
    async def get_batch(batch_id: str, request: Request) -> Response:
        return _json(_get(_runner(request), batch_id))

    @app.post("/v1/batches/{batch_id}/cancel", response_model=Batch)
    async def cancel_batch(batch_id: str, request: Request) -> Response:
        runner = _runner(request)
        batch = _get(runner, batch_id)
        if batch.status not in ("cancelling", "cancelled") and not runner.cancel(batch_id):
            raise APIError(
                409, f"batch {batch_id} is {batch.status} and cannot be cancelled", "batch_id"
            )
        return _json(_get(runner, batch_id))

    @app.get("/v1/batches", response_model=BatchList)
    async def list_batches(
        request: Request,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
    ) -> Response:
        found = _runner(request).store.page(after, limit)
        if found is None:
            raise APIError(404, f"No such Batch object: {after}", "after")
        batches, has_more = found
        first = batches[0].id if batches else None
        last = batches[-1].id if batches else None
        return _json(BatchList(data=batches, first_id=first, last_id=last, has_more=has_more))


def _get(runner: BatchRunner, batch_id: str) -> Batch:
    batch = runner.store.get(batch_id)
    if batch is None:
        raise APIError(404, f"No such Batch object: {batch_id}", "batch_id")
    return batch
