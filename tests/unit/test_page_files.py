"""The playground page's files (api/page/): what index.html and the modules load is served, and
the page names only metrics that /metrics exposes."""

from __future__ import annotations

import re

from prometheus_client import generate_latest

from convoy.api.metrics import ServerMetrics
from convoy.api.routes.page import PAGE_DIR, page_files, page_url
from convoy.batch.service import BatchMetrics
from convoy.engine.stats import EngineStats


def test_every_file_the_page_loads_is_served() -> None:
    files = page_files()
    index = files["index.html"][0].decode()
    loaded = set(re.findall(r'"/page/([\w.-]+)"', index))
    for name, (body, _) in files.items():
        if name.endswith(".js"):
            loaded |= set(re.findall(r'from "\./([\w.-]+)"', body.decode()))
    assert loaded and loaded <= set(files)
    assert {p.name for p in PAGE_DIR.iterdir()} == set(files)  # nothing unservable lies there


def test_the_metrics_the_page_reads_exist() -> None:
    metrics = ServerMetrics()
    BatchMetrics(metrics.registry)
    metrics.attach_engine(lambda: EngineStats(0, 0, 0, 0, 0, 0, 0), lambda: 0)
    exposed = set(re.findall(r"^(\w+)", generate_latest(metrics.registry).decode(), re.MULTILINE))
    read = set(re.findall(r'metrics\.get\("(\w+)"\)', page_files()["numbers.js"][0].decode()))
    assert read == {
        "convoy_generation_tokens_total", "convoy_num_requests_running",
        "convoy_num_requests_waiting", "convoy_kv_blocks_used", "convoy_kv_blocks_total",
        "convoy_batch_queue_lines",
    }  # fmt: skip
    assert read <= exposed


def test_page_url() -> None:
    assert page_url("127.0.0.1", 8000) == "http://127.0.0.1:8000/"
    assert page_url("0.0.0.0", 9000) == "http://127.0.0.1:9000/"
    assert page_url("::1", 8000) == "http://[::1]:8000/"
