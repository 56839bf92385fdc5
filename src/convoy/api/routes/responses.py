"""/v1/responses routes: create (JSON, or typed SSE events), count input tokens, retrieve,
cancel (a background response), delete, input_items.

The store's calls run in worker threads (asyncio.to_thread), as the Batch API's do.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Annotated, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from convoy.api.errors import APIError
from convoy.api.protocol_responses import InputTokenCount, ResponseBody, ResponsesRequest
from convoy.api.routes.common import STREAMS, docs, parse_body, record, until_disconnect
from convoy.api.serving_responses import ResponsesServing, not_found


async def _frames(events: AsyncGenerator[ResponseBody, None]) -> AsyncGenerator[bytes, None]:
    """`event: <type>` and `data: {...}` per event (Responses' framing: no `[DONE]`)."""
    async for ev in events:
        data = ev.model_dump_json()
        yield f"event: {json.loads(data)['type']}\ndata: {data}\n\n".encode()


class _EventResponse(StreamingResponse):
    """Closes its events once the response ends, however it ended: also when the client left
    before the body was read (Starlette never closes a body iterator), as sse.py's does."""

    def __init__(self, events: AsyncGenerator[ResponseBody, None]) -> None:
        self.events, self.frames = events, _frames(events)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(self.frames, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.frames.aclose()
            finally:
                await self.events.aclose()


def add_response_routes(app: FastAPI) -> None:
    def serving() -> ResponsesServing:
        s: ResponsesServing = app.state.responses
        return s

    @app.post("/v1/responses", **docs(ResponseBody, ResponsesRequest, STREAMS))
    async def create_response(request: Request) -> Response:
        body, size = await parse_body(request, ResponsesRequest)
        if body.stream:
            events = await serving().create(body, record(request), size)
            assert not isinstance(events, ResponseBody)
            return _EventResponse(events)
        return await until_disconnect(request, serving().create(body, record(request), size))

    @app.post("/v1/responses/input_tokens", **docs(InputTokenCount, ResponsesRequest))
    async def count_input_tokens(request: Request) -> InputTokenCount:
        body, _ = await parse_body(request, ResponsesRequest)
        return await serving().count_input_tokens(body)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        stored = await serving().load(response_id)
        return Response(json.dumps(stored.response), media_type="application/json")

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        response = await serving().background.cancel(response_id)
        return Response(json.dumps(response), media_type="application/json")

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, object]:
        store = serving().store
        await serving().background.stop_one(response_id)  # a running one stops first
        if store is None or not await asyncio.to_thread(store.delete, response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str,
        order: Literal["asc", "desc"] = "desc",
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        after: str | None = None,
    ) -> dict[str, object]:
        items = list((await serving().load(response_id)).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(404, f"no input item with id {after!r}", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list", "data": page, "has_more": len(items) > limit,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
        }  # fmt: skip
