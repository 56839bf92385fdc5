"""The HTTP layer under hostile clients, against a real server with short limits.

- A large body is parsed and tokenized off the event loop: /health answers meanwhile.
- A body that stalls gets 408 and its connection closed; other clients are served meanwhile.
- A chunked body (no Content-Length) past the size limit gets 413.
- The API key comes from a file (not on the command line), `bearer` in any case, never logged.
- `cache_salt`: a prompt sent twice with the same salt is served from the prefix cache; with a
  different salt, or none, it is not.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server, start_server, stop_server
from tests.e2e.helpers import API_KEY, MODEL

BODY_TIMEOUT_S = 1
MAX_BODY = 10 << 20
LARGE_PROMPT_BYTES = 8 << 20  # seconds of tokenizing on 2 cores
HIT_METRIC = "convoy_prefix_cache_hit_tokens_total"
MAX_LOGPROBS = 8_000  # logprob entries of whole responses in flight, all together


@pytest.fixture(scope="module")
def hardened(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("hardened")
    key_file = folder / "api-key"
    key_file.write_text(API_KEY + "\n")
    args = [
        MODEL, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "128MiB",
        "--api-key-file", str(key_file), "--request-body-timeout", str(BODY_TIMEOUT_S),
        "--max-request-bytes", str(MAX_BODY),
        "--max-logprobs-in-flight", str(MAX_LOGPROBS),
    ]  # fmt: skip
    server = start_server(args, folder)
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def openai_client(hardened: Server) -> OpenAI:
    return OpenAI(base_url=f"{hardened.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _error(status: int, body: bytes | str, expected: int) -> dict[str, Any]:
    assert status == expected, body
    payload = json.loads(body)
    assert list(payload) == ["error"] and list(payload["error"]) == [
        "message", "type", "param", "code",
    ]  # fmt: skip
    error: dict[str, Any] = payload["error"]
    return error


def _connect(server: Server) -> socket.socket:
    url = urlsplit(server.base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    return sock


def _head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {API_KEY}"]
    lines += [f"{k}: {v}" for k, v in {"Content-Type": "application/json", **headers}.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _response(sock: socket.socket) -> tuple[http.client.HTTPResponse, bytes]:
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response, response.read()


def _complete(client: OpenAI, prompt: str, **extra: Any) -> str:
    completion = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra or None
    )
    return completion.choices[0].text


# -- the event loop stays free ------------------------------------------------------------------


def test_health_answers_while_a_large_body_is_processed(hardened: Server) -> None:
    """8 MiB of prompts take seconds to parse and tokenize (then each is too long: 400); /health
    is polled meanwhile and answers each time within 2 s (on the event loop it waited for it all).
    64 prompts of 128 KiB: each under the characters that certainly exceed the context
    (one text of 8 MiB would be rejected before tokenizing), so every one is tokenized."""
    piece = "The quick brown fox jumps over the lazy dog. " * (LARGE_PROMPT_BYTES // 64 // 45)
    body = json.dumps({"model": MODEL, "prompt": [piece] * 64, "max_tokens": 1}).encode()
    done = threading.Event()
    result: dict[str, httpx.Response] = {}

    def send() -> None:
        try:
            with httpx.Client(headers=hardened.headers, timeout=300) as c:
                result["response"] = c.post(f"{hardened.base_url}/v1/completions", content=body)
        finally:
            done.set()

    sender = threading.Thread(target=send)
    sender.start()
    latencies: list[float] = []
    with httpx.Client(timeout=30) as c:
        while not done.is_set():
            start = time.monotonic()
            assert c.get(f"{hardened.base_url}/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)  # polling interval, not synchronisation
    sender.join()
    response = result["response"]
    assert _error(response.status_code, response.content, 400)["param"] == "prompt"
    assert len(latencies) >= 3, latencies  # the request was in flight for several polls
    assert max(latencies) < 2.0, latencies


# -- slow and oversized bodies ----------------------------------------------------------------


def test_a_stalled_body_gets_408_while_others_are_served(
    hardened: Server, openai_client: OpenAI
) -> None:
    with _connect(hardened) as slow:
        slow.sendall(_head("/v1/completions", {"Content-Length": "100"}) + b'{"prompt": "a')
        # The stalled upload holds its connection, not the server.
        _complete(openai_client, "Hello")
        response, payload = _response(slow)
        error = _error(response.status, payload, 408)
        assert "sent nothing" in error["message"]
        assert response.getheader("connection") == "close"
        assert slow.recv(1) == b""  # the server closed the connection
    _complete(openai_client, "Hello again")


def test_a_stalled_upload_gets_408_and_leaves_no_temp_file(hardened: Server) -> None:
    """Uploads have their own size limit, not their own patience: 2 MiB of a file, then nothing."""
    head = _head("/v1/files", {"Content-Type": "multipart/form-data; boundary=B",
                               "Content-Length": str(8 << 20)})  # fmt: skip
    part = b'--B\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'
    with _connect(hardened) as slow:
        slow.sendall(head + part + b"x" * (2 << 20))
        response, payload = _response(slow)
    assert "sent nothing" in _error(response.status, payload, 408)["message"]
    assert list((hardened.log_path.parent / "data" / "tmp").iterdir()) == []


def test_a_chunked_body_past_the_limit_gets_413(hardened: Server) -> None:
    chunk = b"x" * (64 << 10)
    frame = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    with _connect(hardened) as sock:
        sock.sendall(_head("/v1/completions", {"Transfer-Encoding": "chunked"}))
        try:
            for _ in range(MAX_BODY // len(chunk) + 2):
                sock.sendall(frame)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and stopped reading: its answer is waiting
        response, payload = _response(sock)
    assert _error(response.status, payload, 413)["code"] == "request_too_large"


# -- API key ----------------------------------------------------------------------------------


def test_the_key_from_a_file_any_case_bearer_and_never_logged(hardened: Server) -> None:
    url = f"{hardened.base_url}/v1/models"
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert httpx.get(url, headers={"Authorization": f"{scheme} {API_KEY}"}).status_code == 200
    wrong = f"sk-wrong-{uuid.uuid4().hex}"
    for header in (f"Bearer {wrong}", f"Basic {API_KEY}", API_KEY, "Bearer"):
        response = httpx.get(url, headers={"Authorization": header})
        assert _error(response.status_code, response.content, 401)["code"] == "invalid_api_key"
    cmdline = Path(f"/proc/{hardened.proc.pid}/cmdline").read_bytes()
    assert API_KEY.encode() not in cmdline
    log = hardened.log()
    assert API_KEY not in log and wrong not in log


# -- cache_salt -------------------------------------------------------------------------------


def _hits(server: Server, send: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """Prefix-cache hit tokens of `send(*args, **kwargs)`, and its result."""
    before = server.metric(HIT_METRIC)
    out = send(*args, **kwargs)
    return server.metric(HIT_METRIC) - before, out


def test_cache_salt_shares_prefixes_only_within_a_salt(
    hardened: Server, openai_client: OpenAI
) -> None:
    # A fresh prompt of several KV blocks, so only this test's requests can share its blocks.
    prompt = f"[{uuid.uuid4().hex}] " + "Once upon a time, a fox lived by the river. " * 6
    hits, first = _hits(hardened, _complete, openai_client, prompt, cache_salt="a")
    assert hits == 0
    hits, same = _hits(hardened, _complete, openai_client, prompt, cache_salt="a")
    assert hits > 0 and same == first
    for other in ({"cache_salt": "b"}, {}):
        hits, text = _hits(hardened, _complete, openai_client, prompt, **other)
        assert hits == 0 and text == first, other


def test_cache_salt_in_chat(hardened: Server, openai_client: OpenAI) -> None:
    messages = [{"role": "user", "content": f"[{uuid.uuid4().hex}] Name three rivers."}]

    def chat(salt: str) -> Any:
        return openai_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, temperature=0,  # type: ignore[arg-type]
            extra_body={"cache_salt": salt},
        )  # fmt: skip

    assert _hits(hardened, chat, "c")[0] == 0
    assert _hits(hardened, chat, "c")[0] > 0
    assert _hits(hardened, chat, "d")[0] == 0


def test_cache_salt_is_bounded(hardened: Server) -> None:
    for salt in ("", "s" * 257, 5):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "cache_salt": salt}
        response = httpx.post(
            f"{hardened.base_url}/v1/completions", json=body, headers=hardened.headers
        )
        assert _error(response.status_code, response.content, 400)["param"] == "cache_salt"


def test_whole_responses_logprobs_in_flight_are_bounded(hardened: Server) -> None:
    """--max-logprobs-in-flight: whole responses that could hold more logprob entries than it
    together wait (429 with Retry-After) while one holds them; one that alone could hold more
    is a 400; a stream is not counted; once the first is sent, the next is admitted."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "logprobs": 20,
            "ignore_eos": True}  # fmt: skip  # 300 x 21 = 6,300 entries a response
    results: list[httpx.Response] = []
    first = threading.Thread(target=lambda: results.append(
        httpx.post(f"{hardened.base_url}/v1/completions", json=body, headers=headers, timeout=120)
    ))  # fmt: skip
    first.start()
    with httpx.Client(base_url=hardened.base_url, headers=headers, timeout=60) as http:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "convoy_num_requests_running 1" not in http.get(
            "/metrics"
        ).text:
            time.sleep(0.02)
        second = http.post("/v1/completions", json=body)
        assert second.status_code == 429 and int(second.headers["Retry-After"]) >= 1
        assert second.json()["error"]["code"] == "queue_full"
        streamed = http.post("/v1/completions", json={**body, "max_tokens": 2, "stream": True})
        assert streamed.status_code == 200
        alone = http.post("/v1/completions", json={**body, "max_tokens": 400})  # 8,400
        assert alone.status_code == 400 and alone.json()["error"]["param"] == "logprobs"
        first.join()
        assert results[0].status_code == 200
        assert len(results[0].json()["choices"][0]["logprobs"]["tokens"]) == 300
        assert http.post("/v1/completions", json={**body, "max_tokens": 5}).status_code == 200
