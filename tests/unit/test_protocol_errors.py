"""Error objects, middleware and SSE framing on a tiny app: no model, no engine."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from convoy.api.errors import APIError, install_error_handlers
from convoy.api.metrics import ServerMetrics
from convoy.api.middleware import APIKeyMiddleware, BodyLimitMiddleware, RequestLogMiddleware
from convoy.api.protocol_common import UsageInfo
from convoy.api.protocol_completions import CompletionRequest
from convoy.api.sse import DONE, sse_events
from convoy.sampling_params import SamplingParamsError

KEY = "sk-test"


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=1000)
    app.add_middleware(APIKeyMiddleware, api_key=KEY)
    app.add_middleware(RequestLogMiddleware, metrics=ServerMetrics())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict[str, str]:
        if body.prompt == "boom":
            raise RuntimeError("unexpected")
        if body.prompt == "params":
            raise SamplingParamsError("bad seed", "seed")
        if body.prompt == "busy":
            raise APIError(429, "queue full", code="queue_full")
        return {"ok": "yes"}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    return app


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(
        _app(), raise_server_exceptions=False, headers={"Authorization": f"Bearer {KEY}"}
    )


def _error(response: object, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text  # type: ignore[attr-defined]
    body = response.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    error: dict[str, object] = body["error"]
    return error


def test_schema_errors_are_400_with_the_param(client: TestClient) -> None:
    err = _error(client.post("/v1/completions", json={"prompt": "x", "temperature": 9}), 400)
    assert err["param"] == "temperature" and err["type"] == "invalid_request_error"
    err = _error(client.post("/v1/completions", json={"temperature": 1}), 400)
    assert err["param"] == "prompt"


def test_malformed_json_and_missing_body_are_400(client: TestClient) -> None:
    headers = {"Content-Type": "application/json"}
    err = _error(client.post("/v1/completions", content=b'{"prompt": ', headers=headers), 400)
    assert "JSON" in str(err["message"])
    _error(client.post("/v1/completions"), 400)
    _error(client.post("/v1/completions", json=[1, 2]), 400)


def test_domain_errors_keep_status_param_and_code(client: TestClient) -> None:
    assert _error(client.post("/v1/completions", json={"prompt": "params"}), 400)["param"] == "seed"
    err = _error(client.post("/v1/completions", json={"prompt": "busy"}), 429)
    assert err["code"] == "queue_full"


def test_unexpected_errors_are_500_with_the_request_id(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "boom"})
    err = _error(response, 500)
    assert err["type"] == "server_error"
    assert response.headers["x-request-id"] in str(err["message"])


def test_unknown_route_and_method(client: TestClient) -> None:
    assert _error(client.get("/v1/nothing"), 404)["code"] == "not_found"
    assert _error(client.get("/v1/completions"), 405)["code"] == "method_not_allowed"


def test_api_key_is_required_except_for_health() -> None:
    bare = TestClient(_app())
    assert _error(bare.post("/v1/completions", json={"prompt": "x"}), 401)["code"] == (
        "invalid_api_key"
    )
    wrong = {"Authorization": "Bearer nope"}
    _error(bare.post("/v1/completions", json={"prompt": "x"}, headers=wrong), 401)
    assert bare.get("/health").status_code == 200


def test_oversized_bodies_are_413(client: TestClient) -> None:
    big = {"prompt": "x" * 2000}
    assert _error(client.post("/v1/completions", json=big), 413)["code"] == "request_too_large"

    def chunks() -> object:  # no Content-Length: the limit is enforced while reading
        yield json.dumps(big).encode()

    headers = {"Content-Type": "application/json"}
    _error(client.post("/v1/completions", content=chunks(), headers=headers), 413)  # type: ignore[arg-type]
    assert client.post("/v1/completions", json={"prompt": "ok"}).status_code == 200


async def test_sse_error_after_start_is_a_frame_then_done() -> None:
    async def chunks() -> AsyncIterator[BaseModel]:
        yield UsageInfo.of(1, 2)
        raise SamplingParamsError("went wrong", "n")

    frames = [frame async for frame in sse_events(chunks(), "req1")]
    assert frames[0].startswith(b"data: {")
    error = json.loads(frames[1][len(b"data: ") :])
    assert error["error"]["param"] == "n" and error["error"]["message"] == "went wrong"
    assert frames[2:] == [DONE]
