"""Server-sent events: `data: {json}` frames, an error frame if the stream fails, one `[DONE]`."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from convoy.api.errors import from_exception

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def sse_frame(payload: BaseModel) -> bytes:
    return b"data: " + payload.model_dump_json().encode() + b"\n\n"


async def sse_events(
    chunks: AsyncGenerator[BaseModel, None], request_id: str
) -> AsyncGenerator[bytes, None]:
    """Frame every chunk; an error after the stream started becomes an error frame (an engine
    failure too: 500 `internal_error`, or 503 `engine_unavailable` at shutdown).

    NOTE: exactly one `[DONE]` ends every stream that was not cut by the client. A client
    disconnect cancels this generator (CancelledError is not an Exception), and `aclosing`
    closes `chunks` so the engine requests under it are aborted.
    """
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                yield sse_frame(chunk)
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
            err = from_exception(e)
            if err.status >= 500:
                if err.status == 503:  # shutdown or a dead engine: logged once by the engine
                    logger.warning("stream %s ended: %s", request_id, err.message)
                else:
                    logger.exception("stream %s failed", request_id)
                err.message = f"{err.message} (request id {request_id})"
            yield sse_frame(err.to_response())
    yield DONE


def sse_response(chunks: AsyncGenerator[BaseModel, None], request_id: str) -> StreamingResponse:
    return _EventStream(chunks, request_id)


class _EventStream(StreamingResponse):
    """Closes its chunks once the response ends, however it ended: also when the client left
    before the body was read (Starlette never closes a body iterator), which gives the request's
    admission back and aborts its engine requests."""

    def __init__(self, chunks: AsyncGenerator[BaseModel, None], request_id: str) -> None:
        self.chunks, self.events = chunks, sse_events(chunks, request_id)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(self.events, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.events.aclose()
            finally:
                await self.chunks.aclose()
