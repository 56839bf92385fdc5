"""The /v1/batches relay of `convoy serve --replicas` without Ray: the forwarder's app hands a
request to another app as plain data (here in the same process) and streams its answer back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.types import Message

from convoy.batch.relay import (
    CHUNK_BYTES,
    RelayedRequest,
    relay_app,
    root_path_free,
    run_relayed,
)


def _target() -> FastAPI:
    """The coordinator's side: routes on full paths, a body read as it streams."""
    app = FastAPI()

    @app.post("/v1/batches/{rest:path}")
    async def echo(rest: str, request: Request) -> dict[str, Any]:
        sizes = [len(chunk) async for chunk in request.stream() if chunk]
        return {"rest": rest, "query": str(request.query_params), "sizes": sizes}

    @app.get("/v1/batches")
    async def stream() -> StreamingResponse:
        async def parts() -> AsyncIterator[bytes]:
            for i in range(3):
                yield f"part{i};".encode()

        return StreamingResponse(parts(), media_type="text/plain")

    return app


def test_run_relayed_feeds_the_body_in_chunks_and_yields_the_answer() -> None:
    body = b"x" * (2 * CHUNK_BYTES + 5)
    request = RelayedRequest("POST", "/v1/batches/b1/cancel", b"a=1", [], body)

    async def collect() -> list[Message]:
        return [m async for m in run_relayed(_target(), request)]

    messages = asyncio.run(collect())
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    answer = b"".join(m.get("body", b"") for m in messages[1:])
    assert answer == b'{"rest":"b1/cancel","query":"a=1","sizes":[1048576,1048576,5]}'


async def _through_forwarder(method: str, path: str, **kwargs: Any) -> httpx.Response:
    target = _target()

    async def forward(request: RelayedRequest) -> AsyncIterator[Message]:
        if request.path.endswith("/down"):
            raise ConnectionError("coordinator gone")
        async for message in run_relayed(target, request):
            yield message

    # Serve's proxy puts the route prefix in root_path; the forwarder keeps full paths.
    app = root_path_free(relay_app(forward, max_body_bytes=1000, read_timeout=5))
    transport = httpx.ASGITransport(app=app, root_path="/v1/batches")
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.request(method, path, **kwargs)


def test_the_forwarder_relays_paths_queries_and_streamed_answers() -> None:
    response = asyncio.run(_through_forwarder("POST", "/v1/batches/b2?limit=3", content=b"{}"))
    assert response.status_code == 200
    assert response.json() == {"rest": "b2", "query": "limit=3", "sizes": [2]}
    streamed = asyncio.run(_through_forwarder("GET", "/v1/batches"))
    assert streamed.status_code == 200 and streamed.text == "part0;part1;part2;"
    assert streamed.headers["content-type"].startswith("text/plain")


def test_the_forwarder_answers_413_and_503_as_openai_errors() -> None:
    big = asyncio.run(_through_forwarder("POST", "/v1/batches/b3", content=b"x" * 1001))
    assert big.status_code == 413 and "error" in big.json()
    down = asyncio.run(_through_forwarder("GET", "/v1/batches/down"))
    assert down.status_code == 503
    assert down.json()["error"]["code"] == "batches_unavailable"
