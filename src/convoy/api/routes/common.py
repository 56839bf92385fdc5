"""Helpers the HTTP routes share: parsing a body off the loop, OpenAPI for self-parsed bodies,
the request's record, and running work that a client's disconnect cancels."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from convoy.api.metrics import RequestRecord
from convoy.api.protocol_common import ErrorResponse
from convoy.api.serving_base import off_loop
from convoy.api.sse import sse_response

BodyT = TypeVar("BodyT", bound=BaseModel)
SCHEMA_REF = "#/components/schemas/{model}"

STREAMS = "JSON, or `text/event-stream` when stream is true"


def docs(model: type[BaseModel], body: type[BaseModel], answer: str = "JSON") -> dict[str, Any]:
    """OpenAPI for a route that parses `body` itself and answers `model` or a 400."""
    ref = {"$ref": SCHEMA_REF.format(model=body.__name__)}
    return {
        "response_model": None,
        "responses": {
            200: {"model": model, "description": answer},
            400: {"model": ErrorResponse, "description": "invalid request"},
        },
        "openapi_extra": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}
        },
    }


async def parse_body(request: Request, model: type[BodyT]) -> tuple[BodyT, int]:
    """The body as `model` and its size in bytes; a large body is parsed in a worker thread.

    Invalid bodies raise RequestValidationError, as FastAPI's own body parameters do, so the same
    handler answers 400 naming the field.
    """
    raw = await request.body()
    if not raw:
        missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
        raise RequestValidationError([missing])
    try:
        body = await off_loop(len(raw), model.model_validate_json, raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        located = [{**err, "loc": ("body", *err["loc"])} for err in errors]
        raise RequestValidationError(located) from None
    return body, len(raw)


def record(request: Request) -> RequestRecord:
    rec: RequestRecord = request.state.record
    return rec


async def until_disconnect(
    request: Request, work: Awaitable[BaseModel | AsyncGenerator[BaseModel, None]]
) -> Response:
    """Run `work`, cancelling it if the client goes away first (which aborts its engine requests).

    Serving returns a response model (sent as JSON) or a chunk iterator (sent as SSE).
    NOTE: the body has been read by now, so the next `receive()` only returns on disconnect.
    A streaming route returns its iterator at once, so this only guards non-streaming work.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        watcher.cancel()
        result = task.result()
        if isinstance(result, BaseModel):  # skip FastAPI's slow jsonable_encoder pass
            return Response(result.model_dump_json(), media_type="application/json")
        return sse_response(result, record(request).api_id or "")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=499)  # nobody reads it; the status marks the log line


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
