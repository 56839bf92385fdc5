"""/v1/batches routes: thin, over the runner and store of `convoy.batch` (`app.state.batch_runner`).

Every database call runs in a worker thread: a commit fsyncs, and the database mutex may be held
by a batch committing its lines, so the event loop never waits on either.
"""

from __future__ import annotations

import asyncio
import sqlite3
from functools import partial
from typing import Annotated

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response

from convoy.api.errors import APIError, disk_full
from convoy.api.protocol_batch import (
    COMPLETION_WINDOWS,
    ENDPOINTS,
    Batch,
    BatchCreateRequest,
    BatchList,
)
from convoy.batch.db import is_disk_full
from convoy.batch.runner import BatchRunner
from convoy.batch.upload import expiry_seconds
from convoy.config import ServerConfig


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
        after = body.output_expires_after
        output_expires_s = (
            None
            if after is None
            else expiry_seconds(after.anchor, after.seconds, "output_expires_after")
        )
        create = partial(
            runner.store.create, body.endpoint, body.input_file_id, body.completion_window,
            body.metadata, settings.batch_window, output_expires_s,
        )  # fmt: skip
        try:
            batch = await asyncio.to_thread(create)
        except (OSError, sqlite3.OperationalError) as e:
            if not is_disk_full(e):
                raise
            raise disk_full("the batch was not created", e, None) from None
        if batch is None:
            file = await asyncio.to_thread(runner.db.get_file, body.input_file_id)
            if file is None:
                raise APIError(404, f"No such File object: {body.input_file_id}", "input_file_id")
            raise APIError(
                400, f"the input file's purpose is {file.purpose!r}, not 'batch'", "input_file_id"
            )
        runner.submit(batch.id)
        return _json(batch)

    @app.get("/v1/batches/{batch_id}", response_model=Batch)
    async def get_batch(batch_id: str, request: Request) -> Response:
        return _json(await _get(_runner(request), batch_id))

    @app.post("/v1/batches/{batch_id}/cancel", response_model=Batch)
    async def cancel_batch(batch_id: str, request: Request) -> Response:
        runner = _runner(request)
        batch = await _get(runner, batch_id)
        if batch.status not in ("cancelling", "cancelled") and not await runner.cancel(batch_id):
            raise APIError(
                409, f"batch {batch_id} is {batch.status} and cannot be cancelled", "batch_id"
            )
        return _json(await _get(runner, batch_id))

    @app.get("/v1/batches", response_model=BatchList)
    async def list_batches(
        request: Request,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
    ) -> Response:
        found = await asyncio.to_thread(_runner(request).store.page, after, limit)
        if found is None:
            raise APIError(404, f"No such Batch object: {after}", "after")
        batches, has_more = found
        first = batches[0].id if batches else None
        last = batches[-1].id if batches else None
        return _json(BatchList(data=batches, first_id=first, last_id=last, has_more=has_more))


async def _get(runner: BatchRunner, batch_id: str) -> Batch:
    batch = await asyncio.to_thread(runner.store.get, batch_id)
    if batch is None:
        raise APIError(404, f"No such Batch object: {batch_id}", "batch_id")
    return batch
