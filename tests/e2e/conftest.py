"""One real `convoy serve` subprocess on 127.0.0.1 for the whole session, driven over HTTP.

The server runs the embedded default model in fp32 with an API key, a queue cap (for the 429
test) and a small body limit (for the 413 test). Teardown sends SIGTERM and checks that the
server drains and exits cleanly.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.e2e.helpers import API_KEY, GEMMA, MODEL

MAX_QUEUE = 64  # sequences in flight; also the most one request may start
MAX_REQUEST_BYTES = 1 << 20
MAX_FILE_BYTES = 4 << 20  # over MAX_REQUEST_BYTES: uploads have their own limit
STARTUP_TIMEOUT_S = 300  # first start converts the GGUF; later starts take seconds
SHUTDOWN_TIMEOUT_S = 60


@dataclass
class Server:
    base_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str) -> float:
        """Current value of an unlabelled metric from /metrics."""
        text = httpx.get(f"{self.base_url}/metrics", headers=self.headers, timeout=10).text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert match is not None, f"{name} not in /metrics"
        return float(match.group(1))

    def wait_for_metric(self, name: str, value: float, timeout_s: float = 60) -> None:
        """Poll /metrics until `name` equals `value` (the server works asynchronously)."""
        deadline = time.monotonic() + timeout_s
        current = self.metric(name)
        while current != value:
            assert time.monotonic() < deadline, f"{name} stayed at {current}, expected {value}"
            time.sleep(0.05)  # polling interval, not synchronisation
            current = self.metric(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"server exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # polling interval while the model loads
    pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log()[-4000:]}")


def start_server(serve_args: list[str], log_dir: Path) -> Server:
    """`convoy serve <serve_args>` on a free loopback port with API_KEY, healthy when returned;
    the caller stops it (`stop_server`)."""
    port = _free_port()
    log_path = log_dir / "server.log"
    cmd = [sys.executable, "-m", "convoy.cli", "serve", *serve_args,
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    # NOTE: each server its own data folder: two servers never share files and batches.
    env = {**os.environ, "CONVOY_API_KEY": API_KEY, "CONVOY_DATA_DIR": str(log_dir / "data")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        _wait_healthy(server)
    except BaseException:
        stop_server(server)
        raise
    return server


@contextlib.contextmanager
def served_client(serve_args: list[str], log_dir: Path, log_line: str) -> Iterator[OpenAI]:
    """An official client of a server started with `serve_args`, whose log must show `log_line`
    (what the test relies on: the model or device it loaded); the server stops afterwards."""
    server = start_server(serve_args, log_dir)
    try:
        assert log_line in server.log()
        yield OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    finally:
        stop_server(server)


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


@contextlib.contextmanager
def running_server(serve_args: list[str], log_dir: Path) -> Iterator[Server]:
    """A server (`start_server`) for the block, stopped after it (a module fixture's body)."""
    server = start_server(serve_args, log_dir)
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = [
        MODEL, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "256MiB",
        "--max-queue-seqs", str(MAX_QUEUE), "--max-seqs-per-request", str(MAX_QUEUE),
        "--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-file-bytes", str(MAX_FILE_BYTES),
        # a request that finds any step in flight takes a side step (the default waits for a
        # step with 100 ms left): the tests of many clients at once run through side steps too
        "--side-step-ms", "0.001",
    ]  # fmt: skip
    server = start_server(args, tmp_path_factory.mktemp("server"))
    try:
        yield server
        _terminate_while_streaming(server)
    finally:
        stop_server(server)


def _terminate_while_streaming(server: Server) -> None:
    """SIGTERM drains: a stream in flight still completes, then the server exits cleanly."""
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 12, "ignore_eos": True}
    url = f"{server.base_url}/v1/completions"
    with httpx.stream(
        "POST", url, json={**body, "stream": True}, headers=server.headers, timeout=60
    ) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]", rest[-3:]
    assert '"finish_reason":"length"' in rest[-2]  # the stream ran to its end
    try:
        returncode = server.proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"server did not exit on SIGTERM:\n{server.log()[-4000:]}")
    # NOTE: uvicorn re-raises the signal once it has shut down, so -SIGTERM is a clean exit.
    assert returncode in (0, -signal.SIGTERM), server.log()[-4000:]
    log = server.log()
    assert "shutting down the engine" in log and "Application shutdown complete" in log


@pytest.fixture(scope="session")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    """A second server: Gemma 3 in dtype auto (its GGUF quantized, as `convoy serve gemma3-270m`
    runs it)."""
    args = [GEMMA, "--dtype", "auto", "--kv-cache-memory", "64MiB", "--log-level", "info"]
    with served_client(
        args, tmp_path_factory.mktemp("gemma"), f"loaded {GEMMA} (Gemma3ForCausalLM)"
    ) as client:
        yield client


@pytest.fixture(scope="session")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def aclient(server: Server) -> AsyncOpenAI:
    # function scope: an async client is bound to the event loop of the test that uses it
    return AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120
    )


@pytest.fixture(scope="session")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as c:
        yield c
