"""`convoy serve --replicas 2 --ray local:2`: the server's own app on two Ray Serve replicas
behind one endpoint, driven with the official openai client and httpx over loopback.

One server for the module (Ray and two engines start once, ~25 s). The Batch API runs through
the one coordinator, its lines on both replicas; the coordinator's process killed mid-batch is
restarted by Serve and the batch completes, every line once. The last test kills one replica's
engine thread through the fault hook (convoy/engine/faults.py) under load while a batch runs:
Serve's health check notices, replaces the replica, the endpoint keeps serving and the batch's
lines on the dead engine run on the other one.
"""

from __future__ import annotations

import asyncio
import os
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
from tests.cluster.conftest import require_ray
from tests.e2e.conftest import Server, start_server, stop_server
from tests.e2e.helpers import API_KEY, MODEL
from tests.e2e.test_batches import chat_line, completion_line, results, submit, wait

require_ray("ray.serve")

TIMEOUT_S = 60  # per request: an error must come well before this; a hang fails the test
REPLACED_WITHIN_S = 120  # health checks every 2 s, then a fresh engine loads on a shared core
BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
DEPLOYED_S = 120  # the Batch API's apps deploy after the replicas answer /health
COORDINATOR_TITLE = b"ServeReplica:convoy-files:BatchCoordinator"  # its process title (Ray's)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    log_dir = tmp_path_factory.mktemp("replicas")
    fault = log_dir / "fault"
    args = [
        MODEL, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "64MiB",
        "--replicas", "2", "--ray", "local:2", "--data-dir", str(log_dir / "store"),
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_VAR, str(fault))  # the server, Ray and its replicas inherit it
        server = start_server(args, log_dir)
    try:
        deadline = time.monotonic() + DEPLOYED_S
        while "serving 2 replicas" not in server.log():  # the log line after every app is up
            assert server.proc.poll() is None, server.log()[-4000:]
            assert time.monotonic() < deadline, server.log()[-4000:]
            time.sleep(0.2)  # polling interval
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


def _batch_lines_by_replica(server: Server) -> dict[str, float]:
    """Each replica's completed batch lines, from its own /metrics (Serve picks who answers)."""
    counts: dict[str, float] = {}
    deadline = time.monotonic() + TIMEOUT_S
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=TIMEOUT_S) as h:
        while len(counts) < 2:
            assert time.monotonic() < deadline, f"/metrics answered by {set(counts)} only"
            response = h.get("/metrics")
            pattern = r'^convoy_batch_lines_total\{outcome="completed",replica="[^"]+"\} (\S+)$'
            match = re.search(pattern, response.text, re.M)
            counts[response.headers[REPLICA_HEADER]] = float(match.group(1)) if match else 0.0
    return counts


def test_a_batch_runs_once_through_the_coordinator_on_both_replicas(
    replicas: tuple[Server, Path],
) -> None:
    server, _ = replicas
    client = _client(server)
    before = _batch_lines_by_replica(server)
    lines = [completion_line(i, max_tokens=4 + i % 5) for i in range(24)]
    batch = wait(client, submit(client, lines).id, timeout_s=180)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None and batch.request_counts.completed == 24
    out = results(client, batch.output_file_id)  # asserts each custom_id once
    assert sorted(out) == sorted(line["custom_id"] for line in lines)
    assert {line["response"]["status_code"] for line in out.values()} == {200}
    ran = {r: n - before.get(r, 0.0) for r, n in _batch_lines_by_replica(server).items()}
    assert sum(ran.values()) == 24 and min(ran.values()) > 0, ran  # both replicas ran lines
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=TIMEOUT_S) as h:
        for line in lines:  # greedy: the batch's answer is what the same request returns
            alone = h.post("/v1/completions", json=line["body"])
            assert alone.status_code == 200, alone.text
            body = out[line["custom_id"]]["response"]["body"]
            assert body["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    files = {f.id: f for f in client.files.list()}
    assert files[batch.input_file_id].purpose == "batch"
    assert files[batch.output_file_id].purpose == "batch_output"  # type: ignore[index]
    assert batch.id in {b.id for b in client.batches.list(limit=5)}
    assert (Path(server.log_path.parent) / "store" / "convoy.db").exists()  # --data-dir's store
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")  # an OpenAI error object through the relay


def _coordinator_pids(server: Server) -> list[int]:
    """The coordinator's process (Ray's title for it) among the server's descendants."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if COORDINATOR_TITLE in cmdline and _descends_from(int(entry), server.proc.pid):
            pids.append(int(entry))
    return pids


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's id
    return False


def _retrieve(client: OpenAI, batch_id: str, deadline: float) -> Any:
    """The batch; while the coordinator restarts, the forwarder answers 503 (retried)."""
    while True:
        try:
            return client.batches.retrieve(batch_id)
        except openai.APIStatusError as e:
            assert e.status_code in (502, 503), e
        assert time.monotonic() < deadline, "the Batch API did not come back"
        time.sleep(0.2)  # polling interval


def test_the_coordinator_killed_mid_batch_is_restarted_and_the_batch_completes(
    replicas: tuple[Server, Path],
) -> None:
    server, _ = replicas
    client = _client(server)
    (pid,) = _coordinator_pids(server)
    lines = [chat_line(i) for i in range(40)]
    for i, line in enumerate(lines):
        line["body"]["max_tokens"] = 4 + 3 * (i % 8)  # lines end, and commit, at different times
    batch = submit(client, lines, "/v1/chat/completions")
    deadline = time.monotonic() + 180
    while True:
        batch = client.batches.retrieve(batch.id)
        assert batch.status in ("validating", "in_progress"), batch
        if batch.request_counts is not None and batch.request_counts.completed > 0:
            break
        assert time.monotonic() < deadline, "no line committed"
        time.sleep(0.05)  # polling interval
    os.kill(pid, signal.SIGKILL)  # as a crash: the process goes, its lines in flight too
    assert batch.request_counts.completed < 40, "the batch ended before the kill"
    while (batch := _retrieve(client, batch.id, deadline)).status not in ("completed", "failed"):
        time.sleep(0.1)  # polling interval
    assert batch.status == "completed", batch
    out = results(client, batch.output_file_id)  # each custom_id once: none committed twice
    assert sorted(out) == sorted(line["custom_id"] for line in lines)
    assert {line["response"]["status_code"] for line in out.values()} == {200}
    assert _coordinator_pids(server) not in ([], [pid])  # a new process serves the store


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


def _from_serve(response: httpx.Response) -> bool:
    """Serve's own plain-text 500: a request its proxy sent to the dead replica's actor as the
    controller stopped it (a race inside Ray Serve; the openai client retries a 500). Convoy's
    app answers every error, an unexpected one too, with a JSON error object, never this."""
    return response.status_code == 500 and response.text == "Internal Server Error"


def test_a_replica_killed_under_load_is_replaced_and_the_endpoint_keeps_serving(
    replicas: tuple[Server, Path],
) -> None:
    server, fault = replicas
    before = _seen_replicas(server, 2)
    client = _client(server)
    lines = [completion_line(i, max_tokens=32) for i in range(24)]  # on both engines at the kill
    batch = wait(client, submit(client, lines).id, ("in_progress", "completed", "failed"))
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
            assert response.status_code in (200, 503) or _from_serve(response), response.text
            new = {response.headers[REPLICA_HEADER]} - before if response.is_success else set()
        after = {_replica_of(h) for _ in range(12)}  # every request succeeds (asserted inside)
    assert len(after - before) == 1, (before, after)  # the new replica serves; one was replaced
    # The batch's lines on the dead engine ran again on a live one, each committed once.
    batch = wait(client, batch.id, timeout_s=REPLACED_WITHIN_S)
    assert batch.status == "completed", batch
    out = results(client, batch.output_file_id)
    assert sorted(out) == sorted(line["custom_id"] for line in lines)
    assert {line["response"]["status_code"] for line in out.values()} == {200}
