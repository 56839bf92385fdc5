"""`convoy serve --replicas 2 --ray local:2`: the server's own app on two Ray Serve replicas
behind one endpoint, driven with the official openai client and httpx over loopback.

One server for the module (Ray and two engines start once, ~25 s). The last test kills one
replica's engine thread through the fault hook (convoy/engine/faults.py) under load: Serve's
health check notices, replaces the replica, and the endpoint keeps serving.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from convoy.api.server import REPLICA_HEADER
from convoy.engine.faults import ENV_VAR, request_fault
from tests.e2e.conftest import Server, start_server, stop_server
from tests.e2e.helpers import API_KEY, MODEL

pytest.importorskip("ray.serve", reason="the ray extra is missing")

TIMEOUT_S = 60  # per request: an error must come well before this; a hang fails the test
REPLACED_WITHIN_S = 120  # health checks every 2 s, then a fresh engine loads on a shared core
BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    log_dir = tmp_path_factory.mktemp("replicas")
    fault = log_dir / "fault"
    args = [
        MODEL, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "64MiB",
        "--replicas", "2", "--ray", "local:2",
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_VAR, str(fault))  # the server, Ray and its replicas inherit it
        server = start_server(args, log_dir)
    try:
        yield server, fault
        _terminate(server)
    finally:
        stop_server(server)


def _terminate(server: Server) -> None:
    """SIGTERM: Serve and the local Ray instance shut down, and the command exits 0."""
    server.proc.send_signal(signal.SIGTERM)
    try:
        returncode = server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"convoy serve --replicas did not exit on SIGTERM:\n{server.log()[-4000:]}")
    assert returncode == 0, server.log()[-4000:]


def _client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _replica_of(http: httpx.Client) -> str:
    response = http.post("/v1/completions", json=BODY)
    assert response.status_code == 200, response.text
    return response.headers[REPLICA_HEADER]


def _seen_replicas(server: Server, want: int, timeout_s: float = 60) -> set[str]:
    """Replica ids answering completions, until `want` distinct ones (Serve's router picks)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=TIMEOUT_S) as h:
        while len(seen) < want and time.monotonic() < deadline:
            seen.add(_replica_of(h))
    return seen


def test_openai_client_completes_and_streams_chat_through_serve(
    replicas: tuple[Server, Path],
) -> None:
    client = _client(replicas[0])
    completion = client.completions.create(**BODY)
    assert completion.choices[0].text and completion.usage is not None
    assert completion.usage.completion_tokens == 8
    messages = [{"role": "user", "content": "Name a colour."}]
    args: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    whole = client.chat.completions.create(**args)
    stream = client.chat.completions.create(**args, stream=True)
    chunks = list(stream)
    assert len(chunks) > 2  # SSE through Serve's proxy: chunk by chunk
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content  # greedy: same text on either replica


def test_requests_spread_over_both_replicas_and_metrics_name_them(
    replicas: tuple[Server, Path],
) -> None:
    server, _ = replicas
    seen = _seen_replicas(server, 2)
    assert len(seen) == 2, seen
    response = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10)
    replica = response.headers[REPLICA_HEADER]
    assert replica in seen
    labels = set(re.findall(r'replica="([^"]+)"', response.text))
    assert labels == {replica}  # every sample of this replica's metrics, and only its id
    assert re.search(rf'^convoy_kv_blocks_total{{replica="{replica}"}} \S+$', response.text, re.M)


def test_files_and_batches_answer_501_with_an_openai_error(replicas: tuple[Server, Path]) -> None:
    client = _client(replicas[0])
    for call in (client.files.list, lambda: client.batches.retrieve("batch_x")):
        with pytest.raises(openai.APIStatusError) as e:
            call()
        assert e.value.status_code == 501
        assert isinstance(e.value.body, dict) and e.value.body["code"] == "not_implemented"


async def _one(client: AsyncOpenAI) -> str:
    """'ok' or the error class: a hang past TIMEOUT_S raises (the client's timeout)."""
    try:
        await client.completions.create(**{**BODY, "max_tokens": 32})
    except openai.APIStatusError as e:
        return f"status {e.status_code}"
    except openai.APIConnectionError as e:  # includes timeouts: none may happen
        assert not isinstance(e, openai.APITimeoutError), "a request hung"
        return "connection"
    return "ok"


async def _load_while_killing(server: Server, fault: Path) -> list[str]:
    client = AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S
    )
    tasks = [asyncio.create_task(_one(client)) for _ in range(8)]
    await asyncio.sleep(0.5)  # the requests are in the engines when the kill comes
    request_fault(fault, "kill")
    tasks += [asyncio.create_task(_one(client)) for _ in range(8)]
    return list(await asyncio.gather(*tasks))


def test_a_replica_killed_under_load_is_replaced_and_the_endpoint_keeps_serving(
    replicas: tuple[Server, Path],
) -> None:
    server, fault = replicas
    before = _seen_replicas(server, 2)
    outcomes = asyncio.run(_load_while_killing(server, fault))
    assert not fault.exists()  # an engine took the kill
    assert set(outcomes) <= {"ok", "status 500", "status 503", "connection"}, outcomes
    # Serve's health check (engine not running) replaces the dead replica with a new one.
    deadline = time.monotonic() + REPLACED_WITHIN_S
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=TIMEOUT_S) as h:
        new: set[str] = set()
        while not new:  # meanwhile the dead replica may still answer 503
            assert time.monotonic() < deadline, f"no new replica after {REPLACED_WITHIN_S}s"
            response = h.post("/v1/completions", json=BODY)
            assert response.status_code in (200, 503), response.text
            new = {response.headers[REPLICA_HEADER]} - before if response.is_success else set()
        after = {_replica_of(h) for _ in range(12)}  # every request succeeds (asserted inside)
    assert len(after - before) == 1, (before, after)  # the new replica serves; one was replaced
