"""Plain ASGI middleware: request log + metrics, API key, body size limit and read timeout.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which buffers streaming responses through
an extra task and hides client disconnects from the route.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from convoy.api.errors import APIError, BodyTooLarge, error_body_bytes
from convoy.api.metrics import RequestRecord, ServerMetrics

logger = logging.getLogger("convoy.api.access")

# Served without the key: the health check, and the playground page's static files (it asks
# for the key and sends it on every API call: api/routes/page.py).
PUBLIC_PATHS = frozenset({"/health", "/"})
PUBLIC_FOLDERS = frozenset({"/page"})  # the files directly inside, no deeper


async def send_error(send: Send, err: APIError) -> None:
    body = error_body_bytes(err)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestLogMiddleware:
    """Give each request an id and a RequestRecord; log one line and count it when it ends.

    `headers` go on every response (a Serve replica names itself: x-convoy-replica).
    """

    def __init__(
        self, app: ASGIApp, metrics: ServerMetrics, headers: dict[str, str] | None = None
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.headers = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(request_id=uuid.uuid4().hex[:16])
        state: dict[str, Any] = scope.setdefault("state", {})
        state["request_id"], state["record"] = record.request_id, record
        status = 500  # what the client sees if the app raises before answering

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers += [(b"x-request-id", record.request_id.encode()), *self.headers]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.observe(route, scope["method"], status, record)
            latency = time.monotonic() - record.start
            logger.info(
                "%s %s %d %.3fs req=%s%s",
                scope["method"],
                scope["path"],
                status,
                latency,
                record.request_id,
                record.describe(),
            )


class BodyReadTimeout(StarletteHTTPException):
    """A request body sent no bytes for the read timeout: 408, and the connection is closed.

    NOTE: an HTTPException, as BodyTooLarge, so the route that was reading the body lets it
    through to the error handlers.
    """

    def __init__(self, timeout_s: float) -> None:
        message = f"the request body sent nothing for {timeout_s:g} s"
        super().__init__(408, message, headers={"Connection": "close"})


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every route except the health check and the page.

    The scheme is case-insensitive (RFC 9110: `bearer KEY` too); the key itself is never logged.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] != "http" or path in PUBLIC_PATHS or _is_public_file(path):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        # NOTE: constant-time comparison, so the key cannot be guessed byte by byte from timing.
        is_valid = hmac.compare_digest(token.strip(b" "), self.expected)
        if not (is_valid and scheme.lower() == b"bearer"):
            message = "missing API key" if not given else "incorrect API key provided"
            await send_error(send, APIError(401, message))
            return
        await self.app(scope, receive, send)


def _is_public_file(path: str) -> bool:
    folder, _, name = path.rpartition("/")
    return bool(name) and folder in PUBLIC_FOLDERS


class BodyLimitMiddleware:
    """413 for bodies over the limit: by Content-Length up front, else while reading (chunked
    bodies too); 408 for a body that sends nothing for `read_timeout` seconds (a slow client
    must not hold a connection and its request forever). The `self_limited` (method, path)
    routes hold their bodies to their own limit as they stream (uploads: --max-file-bytes):
    they get the 408 but not this limit."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, read_timeout: float | None = None,
        self_limited: frozenset[tuple[str, str]] = frozenset(),
    ) -> None:  # fmt: skip
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout
        self.self_limited = self_limited

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_limited = (scope["method"], scope["path"]) not in self.self_limited
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if is_limited and declared.isdigit() and int(declared) > self.max_bytes:
            await send_error(send, APIError(413, BodyTooLarge(self.max_bytes).detail))
            return
        num_bytes = 0
        is_body_read = False

        async def limited_receive() -> Message:
            nonlocal num_bytes, is_body_read
            if is_body_read:  # the app now waits for a disconnect, however long that takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout)
            except TimeoutError:
                raise BodyReadTimeout(self.read_timeout or 0) from None
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if is_limited and num_bytes > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            is_body_read = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)
