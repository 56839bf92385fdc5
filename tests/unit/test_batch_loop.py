"""The Batch API never makes the event loop wait on the database or the disk.

The Batch API's own app (`build_batch_app`, as the `--replicas` coordinator runs it) over a fake
line runner, in this process: every database call, fsync, rename, removal and input line parse
is recorded with the thread it ran on, while a batch is uploaded, created, listed, read, run to
the end, and another one cancelled; none may run on the loop's thread. (Latency figures with a
real server: bench/batch_loop.py.)
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from convoy.api.server import build_batch_app
from convoy.batch import lines as lines_mod
from convoy.batch.db import BatchDB
from convoy.batch.service import BatchMetrics
from convoy.config import ServerConfig
from tests.unit.test_batch_runner import EP, MODEL, FakeLines


class Recorder:
    """Which blocking calls ran on the loop's thread (while `on`)."""

    def __init__(self, loop_thread: int) -> None:
        self.loop_thread = loop_thread
        self.on = False
        self.on_loop: list[str] = []
        self.num_calls = 0

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.num_calls += 1
                if threading.get_ident() == self.loop_thread:
                    self.on_loop.append(name)
            return fn(*args, **kwargs)

        return recorded


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    rec = Recorder(threading.get_ident())  # the test's loop runs on this thread
    monkeypatch.setattr(BatchDB, "read", rec.wrap("BatchDB.read", BatchDB.read))
    monkeypatch.setattr(
        BatchDB, "transaction", rec.wrap("BatchDB.transaction", BatchDB.transaction)
    )
    monkeypatch.setattr(os, "fsync", rec.wrap("os.fsync", os.fsync))
    monkeypatch.setattr(Path, "rename", rec.wrap("Path.rename", Path.rename))
    monkeypatch.setattr(Path, "mkdir", rec.wrap("Path.mkdir", Path.mkdir))
    monkeypatch.setattr(shutil, "rmtree", rec.wrap("shutil.rmtree", shutil.rmtree))
    monkeypatch.setattr(lines_mod, "load_line", rec.wrap("load_line", lines_mod.load_line))
    yield rec


def _jsonl(num_lines: int, tag: str) -> bytes:
    rows = (
        json.dumps({"custom_id": f"{tag}{i}", "method": "POST", "url": EP,
                    "body": {"model": MODEL, "prompt": f"p{i}"}}) + "\n"
        for i in range(num_lines)
    )  # fmt: skip
    return "".join(rows).encode()


async def _batch(http: httpx.AsyncClient, data: bytes) -> str:
    file = await http.post("/v1/files", files={"file": ("in.jsonl", data)},
                           data={"purpose": "batch"})  # fmt: skip
    assert file.status_code == 200, file.text
    body = {"input_file_id": file.json()["id"], "endpoint": EP, "completion_window": "24h"}
    batch = await http.post("/v1/batches", json=body)
    assert batch.status_code == 200, batch.text
    batch_id: str = batch.json()["id"]
    return batch_id


async def test_batch_routes_and_runner_leave_the_loop_free(
    tmp_path: Path, recorder: Recorder
) -> None:
    lines = FakeLines()
    lines.gate = asyncio.Event()  # the second batch's lines wait: it is cancelled mid-run
    settings = ServerConfig(data_dir=str(tmp_path / "data"))
    app = build_batch_app(settings, {EP: lines}, MODEL, window=8)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app):
        runner = app.state.batch_runner
        recorder.on = True
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            cancelled = await _batch(http, _jsonl(300, "c"))
            while lines.num_calls == 0:  # it runs: lines wait at the gate
                await asyncio.sleep(0.01)
            assert (await http.post(f"/v1/batches/{cancelled}/cancel")).status_code == 200
            await asyncio.gather(*runner.tasks.values())
            lines.gate.set()
            done = await _batch(http, _jsonl(200, "d"))
            for _ in range(5):
                assert (await http.get("/v1/batches", params={"limit": 10})).status_code == 200
                assert (await http.get(f"/v1/batches/{done}")).status_code == 200
            await asyncio.gather(*runner.tasks.values())
            got = (await http.get(f"/v1/batches/{done}")).json()
            assert got["status"] == "completed" and got["request_counts"]["completed"] == 180
            assert (await http.get(f"/v1/batches/{cancelled}")).json()["status"] == "cancelled"
            out = await http.get(f"/v1/files/{got['output_file_id']}/content")
            assert len(out.text.splitlines()) == 180
        metrics = BatchMetrics(CollectorRegistry())
        metrics.store = runner.store
        metrics.collect()  # a /metrics scrape reads the store's count, not the database
        recorder.on = False
    assert recorder.num_calls > 100  # the recorder saw the work...
    assert recorder.on_loop == []  # ...and none of it on the loop
