"""HTTP requests relayed as plain data, for `convoy serve --replicas` (no Ray here).

Ray Serve gives each application one route prefix, and the Batch API's one store lives in one
coordinator (convoy.cluster.serve): it is the ingress of /v1/files, and a small forwarder app at
/v1/batches hands each request to it as plain data:

    client --> Serve proxy /v1/batches --> forwarder: relay_app (body read, bounded)
      --RelayedRequest (handle call, streamed answer)--> coordinator: run_relayed(its app)
      --ASGI messages (response start, body chunks)--> forwarder --> client
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from convoy.api.errors import APIError, install_error_handlers
from convoy.api.middleware import BodyLimitMiddleware
from convoy.api.protocol_batch import UPLOAD_ROUTES

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # a relayed body reaches the app a MiB at a time, as a socket's would
_METHODS = ["GET", "POST", "DELETE", "PUT", "PATCH"]


@dataclass(slots=True)
class RelayedRequest:
    """What the coordinator's app needs of an HTTP request: the full path (prefix included)."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None


Forward = Callable[[RelayedRequest], AsyncIterator[Message]]  # the coordinator's answer


def relay_app(forward: Forward, max_body_bytes: int, read_timeout: float | None) -> FastAPI:
    """The forwarder's app: every request, its body read (413 past `max_body_bytes`, 408 when
    it stalls), goes to `forward`; the answer's messages are sent back as they come."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=max_body_bytes, read_timeout=read_timeout,
        self_limited=UPLOAD_ROUTES,
    )  # fmt: skip

    @app.api_route("/{path:path}", methods=_METHODS, include_in_schema=False)
    async def relay(request: Request) -> Response:
        scope = request.scope
        relayed = RelayedRequest(
            scope["method"], scope["path"], scope.get("query_string", b""),
            list(scope["headers"]), await request.body(), scope.get("client"),
        )  # fmt: skip
        messages = forward(relayed)
        try:
            first = await anext(messages)
        except Exception as e:  # noqa: BLE001 - no answer: the coordinator is down or restarting
            logger.warning("batch coordinator unavailable: %s", e)
            raise APIError(
                503, "the batch coordinator is unavailable (restarting?): retry shortly",
                code="batches_unavailable",
            ) from None  # fmt: skip
        return _Relayed(first, messages)

    return app


class _Relayed(Response):
    """Sends the coordinator's ASGI messages as they arrive (a download streams)."""

    def __init__(self, first: Message, messages: AsyncIterator[Message]) -> None:
        self.first, self.messages = first, messages
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(self.first)
            async for message in self.messages:
                await send(message)
        finally:
            closing = getattr(self.messages, "aclose", None)
            if closing is not None:
                await closing()


def root_path_free(app: ASGIApp) -> ASGIApp:
    """`app` as the ingress of a route prefix: Serve puts the prefix in `root_path`, while the
    app's routes are full paths (the scope's `path` keeps the prefix)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope = {**scope, "root_path": ""}
        await app(scope, receive, send)

    return wrapped


async def run_relayed(app: ASGIApp, request: RelayedRequest) -> AsyncIterator[Message]:
    """Run `app` on a relayed request in this process; yield its response messages.

    The body goes in CHUNK_BYTES pieces; after it, `receive` waits for the caller to stop
    reading (closing this generator), which the app sees as a disconnect.
    """
    path = request.path
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": request.method, "scheme": "http", "path": path,
        "raw_path": path.encode(), "root_path": "", "query_string": request.query_string,
        "headers": request.headers, "client": request.client, "server": None,
    }  # fmt: skip
    body = request.body
    chunks = [body[i : i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
    gone = asyncio.Event()
    sent: asyncio.Queue[Message | None] = asyncio.Queue()

    async def receive() -> Message:
        if chunks:
            body = chunks.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(chunks)}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            yield message
        await task  # an error the app did not answer is raised here
    finally:
        gone.set()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(task, return_exceptions=True)
