"""The event loop beside Batch API work: /health latency and a streaming request's token gaps.

    python bench/batch_loop.py                      # every scenario, SmolLM2 fp32
    python bench/batch_loop.py --scenarios big --big-batches 5

Starts `convoy serve` (a fresh --data-dir) on a free port. While each scenario runs, one thread
polls GET /health every --interval seconds and another streams interactive completions one
after another (max_tokens 64), recording the gap between chunks. Scenarios:
  idle    nothing else: the machine's noise
  50k     upload a 50,000-line batch file, create a batch from it, list the batches 20 times,
          cancel it and wait until it is cancelled (its part files finalised)
  big     upload --big-batches files of one ~32 MiB line each, create a batch from each and
          wait until they end (validated in one pass each, then the line answered: 400, too
          long for the context)
Goal (issue #29): /health max < 100 ms in every scenario, stream gaps as idle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import httpx

from batch_api import status, wait_done
from serve import ServerProcess

LINES_50K = 50_000
BIG_BYTES = 32 * 2**20 - 4096  # under --max-request-bytes (32 MiB) with the line around it
FINAL = ("completed", "failed", "cancelled", "expired")


def poll_health(url: str, interval: float, until: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=600) as client:
        while not until.is_set():
            start = time.perf_counter()
            assert client.get(f"{url}/health").status_code == 200
            out.append(time.perf_counter() - start)
            time.sleep(max(0.0, interval - (time.perf_counter() - start)))


def stream_gaps(url: str, model: str, until: threading.Event, out: list[float]) -> None:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.Client(timeout=600) as client:
        while not until.is_set():
            last = None
            with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        out.append(now - last)
                    last = now


def upload(http: httpx.Client, data: bytes) -> str:
    file = http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    file.raise_for_status()
    file_id: str = file.json()["id"]
    return file_id


def create(http: httpx.Client, file_id: str) -> str:
    body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    batch = http.post("/v1/batches", json=body)
    batch.raise_for_status()
    batch_id: str = batch.json()["id"]
    return batch_id


def scenario_50k(http: httpx.Client, model: str, _: argparse.Namespace) -> str:
    rows = (
        json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": model, "prompt": f"Line {i}:", "max_tokens": 8}}) + "\n"
        for i in range(LINES_50K)
    )  # fmt: skip
    batch_id = create(http, upload(http, "".join(rows).encode()))
    for _ in range(20):
        http.get("/v1/batches", params={"limit": 100}).raise_for_status()
    while status(http, batch_id)["status"] == "validating":
        time.sleep(0.05)  # polling: the cancel must find it running
    http.post(f"/v1/batches/{batch_id}/cancel").raise_for_status()
    batch = wait_done(http, batch_id)
    return f"{batch['status']}, {batch['request_counts']['completed']} lines done"


def scenario_big(http: httpx.Client, model: str, args: argparse.Namespace) -> str:
    head = json.dumps({"custom_id": "big", "method": "POST", "url": "/v1/completions",
                       "body": {"model": model, "max_tokens": 1, "prompt": ""}})  # fmt: skip
    text = ("All work and no play. " * (BIG_BYTES // 22 + 1))[: BIG_BYTES - len(head)]
    line = (head[:-3] + json.dumps(text) + "}}\n").encode()
    file_ids = [upload(http, line) for _ in range(args.big_batches)]
    batch_ids = [create(http, f) for f in file_ids]
    batches = [wait_done(http, b) for b in batch_ids]
    return ", ".join(sorted({b["status"] for b in batches})) + f" ({len(line) / 2**20:.1f} MiB)"


SCENARIOS = {"idle": None, "50k": scenario_50k, "big": scenario_big}


def run(url: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    done = threading.Event()
    health: list[float] = []
    gaps: list[float] = []
    threads = [
        threading.Thread(target=poll_health, args=(url, args.interval, done, health)),
        threading.Thread(target=stream_gaps, args=(url, args.model, done, gaps)),
    ]
    for t in threads:
        t.start()
    start = time.perf_counter()
    try:
        fn = SCENARIOS[name]
        if fn is None:
            time.sleep(3.0)
            outcome = "-"
        else:
            with httpx.Client(base_url=url, timeout=None) as http:
                outcome = fn(http, args.model, args)
    finally:
        done.set()
        for t in threads:
            t.join()
    ms = sorted(x * 1000 for x in health)
    gap_ms = sorted(x * 1000 for x in gaps)
    return {
        "name": name, "outcome": outcome, "seconds": time.perf_counter() - start,
        "polls": len(ms), "p50": statistics.median(ms), "p99": ms[int(len(ms) * 0.99)],
        "max": ms[-1], "gap_p50": statistics.median(gap_ms) if gap_ms else 0.0,
        "gap_max": gap_ms[-1] if gap_ms else 0.0,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--interval", type=float, default=0.01, help="seconds between polls")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--big-batches", type=int, default=20)
    args = parser.parse_args()
    args.serve_args = ["--data-dir", tempfile.mkdtemp(prefix="convoy-loop-bench-")]
    server = ServerProcess(args)
    rows = []
    try:
        server.wait_healthy()
        for name in args.scenarios.split(","):
            rows.append(run(server.url, name, args))
            print(f"  {name}: {rows[-1]['outcome']}", file=sys.stderr)
    finally:
        server.stop()
    print(
        f"\n/health and stream token gaps (ms) beside Batch API work; {args.model} {args.dtype}\n"
    )
    print("| scenario | outcome | s | polls | health p50 | p99 | max | gap p50 | gap max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['outcome']} | {r['seconds']:.1f} | {r['polls']} |"
            f" {r['p50']:.1f} | {r['p99']:.1f} | {r['max']:.1f} | {r['gap_p50']:.1f} |"
            f" {r['gap_max']:.1f} |"
        )


if __name__ == "__main__":
    main()
