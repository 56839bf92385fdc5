"""The Batch API under load: interactive TTFT beside a batch, batch throughput, memory, kill -9.

    python bench/batch_api.py ttft        # TTFT of short requests: idle vs beside a 2,000-line batch
    python bench/batch_api.py throughput  # one batch of P lines vs the same P requests over HTTP
    python bench/batch_api.py rss         # peak RSS while a 50,000-line batch runs
    python bench/batch_api.py kill        # 500 lines, SIGKILL twice mid-way: each custom_id once

Starts `convoy serve` (fp32 SmolLM2 unless told otherwise, a fresh --data-dir) on a free port.
Flags after `--` go to `convoy serve` (e.g. `-- --batch-share 0.1`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from prompts import TOPICS
from serve import ServerProcess, concurrent_requests, make_prompts_tagged


def _lines(prompts: list[str], tokens: int | list[int], model: str) -> bytes:
    rows = []
    for i, prompt in enumerate(prompts):
        n = tokens if isinstance(tokens, int) else tokens[i]
        body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        rows.append({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                     "body": body})  # fmt: skip
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def submit(http: httpx.Client, data: bytes) -> str:
    file = http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    file.raise_for_status()
    body = {"input_file_id": file.json()["id"], "endpoint": "/v1/completions",
            "completion_window": "24h"}  # fmt: skip
    batch = http.post("/v1/batches", json=body)
    batch.raise_for_status()
    batch_id: str = batch.json()["id"]
    return batch_id


def status(http: httpx.Client, batch_id: str) -> dict[str, Any]:
    batch: dict[str, Any] = http.get(f"/v1/batches/{batch_id}").json()
    return batch


def wait_done(http: httpx.Client, batch_id: str, poll_s: float = 0.05) -> dict[str, Any]:
    while (batch := status(http, batch_id))["status"] not in ("completed", "failed", "cancelled",
                                                              "expired"):  # fmt: skip
        time.sleep(poll_s)
    return batch


def ttft_probe(http: httpx.Client, model: str, prompt: str) -> float:
    """Seconds from sending a streaming request to its first token."""
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("no token")


def ttft_series(http: httpx.Client, args: argparse.Namespace, tag: str) -> list[float]:
    rng = random.Random(tag)
    out = []
    for i in range(args.probes):
        # ~20 prompt tokens, distinct each time (no prefix-cache hit)
        prompt = f"[{tag} {i}] Write one sentence about the number {rng.randint(0, 10**6)} and"
        out.append(ttft_probe(http, args.model, prompt))
        time.sleep(rng.uniform(0.05, 0.3))  # arrivals at random points of the batch's steps
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _pcts(xs: list[float]) -> str:
    p50, p90, p99 = (1000 * _pct(xs, q) for q in (0.5, 0.9, 0.99))
    return f"p50 {p50:7.1f} ms  p90 {p90:7.1f} ms  p99 {p99:7.1f} ms  max {1000 * max(xs):7.1f} ms"


def run_ttft(http: httpx.Client, args: argparse.Namespace, server: ServerProcess) -> None:
    ttft_probe(http, args.model, "warm-up")
    idle = ttft_series(http, args, "idle")
    batch_id = submit(
        http, _lines(make_prompts_tagged(args.lines, "ttft"), args.tokens, args.model)
    )
    while status(http, batch_id)["request_counts"]["completed"] < 1:
        time.sleep(0.1)  # the batch is running and has its slots full
    busy = ttft_series(http, args, "busy")
    batch = status(http, batch_id)
    print(f"idle:         {_pcts(idle)}")
    print(
        f"beside batch: {_pcts(busy)}  (batch {batch['status']}, "
        f"{batch['request_counts']['completed']}/{args.lines} lines done when probes ended)"
    )
    ratios = [_pct(busy, q) / _pct(idle, q) for q in (0.5, 0.99)]
    print(f"beside batch / idle: p50 {ratios[0]:.2f}x, p99 {ratios[1]:.2f}x (goal p99 <= 3x)")
    http.post(f"/v1/batches/{batch_id}/cancel")


def run_throughput(http: httpx.Client, args: argparse.Namespace, server: ServerProcess) -> None:
    args.prompts = args.lines
    concurrent_requests(args, server.url, make_prompts_tagged(4, "warm-up"))
    rows = []
    for r in range(args.repeats):
        prompts = make_prompts_tagged(args.lines, f"http {r}")
        start = time.perf_counter()
        tokens = concurrent_requests(args, server.url, prompts)
        rows.append(("concurrent HTTP", tokens / (time.perf_counter() - start)))
        data = _lines(make_prompts_tagged(args.lines, f"batch {r}"), args.tokens, args.model)
        time.sleep(args.grace)  # no interactive load: the batch has the engine to itself
        start = time.perf_counter()
        batch = wait_done(http, submit(http, data))
        rate = batch["usage"]["output_tokens"] / (time.perf_counter() - start)
        rows.append(("batch API", rate))
        print(
            f"repeat {r}: http {rows[-2][1]:7.1f} tok/s, batch {rate:7.1f} tok/s", file=sys.stderr
        )
    for name in ("concurrent HTTP", "batch API"):
        rates = [rate for n, rate in rows if n == name]
        print(f"{name:<16} median {statistics.median(rates):7.1f} tok/s  ({len(rates)} runs)")
    http_rate = statistics.median(rate for n, rate in rows if n == "concurrent HTTP")
    batch_rate = statistics.median(rate for n, rate in rows if n == "batch API")
    print(f"batch / concurrent: {batch_rate / http_rate:.2f}x (goal >= 0.9x)")


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def run_rss(http: httpx.Client, args: argparse.Namespace, server: ServerProcess) -> None:
    pid = server.proc.pid
    ttft_probe(http, args.model, "warm-up")
    before = _rss_kib(pid, "VmRSS")
    # short distinct prompts: the figure is about the server's memory per line, not prefill
    prompts = [f"{i}: {TOPICS[i % len(TOPICS)]}" for i in range(args.lines)]
    batch_id = submit(http, _lines(prompts, args.tokens, args.model))
    start, next_report = time.perf_counter(), 0
    while (batch := status(http, batch_id))["status"] not in ("completed", "failed"):
        if (done := batch["request_counts"]["completed"]) >= next_report:
            print(f"  {done:6d} lines done: RSS {_rss_kib(pid, 'VmRSS') / 1024:7.1f} MiB")
            next_report += args.lines // 10
        time.sleep(1.0)
    elapsed = time.perf_counter() - start
    print(
        f"{args.lines} lines in {elapsed:.0f} s ({batch['status']}); RSS before "
        f"{before / 1024:.0f} MiB, after {_rss_kib(pid, 'VmRSS') / 1024:.0f} MiB, peak "
        f"{_rss_kib(pid, 'VmHWM') / 1024:.0f} MiB"
    )


def run_kill(http: httpx.Client, args: argparse.Namespace, server: ServerProcess) -> None:
    rng = random.Random(args.seed)
    prompts = make_prompts_tagged(args.lines, "kill")
    # lengths spread over 1..2x --tokens, so lines finish (and commit) throughout the run
    data = _lines(prompts, [rng.randint(1, 2 * args.tokens) for _ in prompts], args.model)
    batch_id = submit(http, data)
    for k in range(args.kills):
        target = rng.randint(args.lines * (2 * k + 1) // (2 * args.kills + 2),
                             args.lines * (2 * k + 2) // (2 * args.kills + 2))  # fmt: skip
        while (done := status(http, batch_id)["request_counts"]["completed"]) < target:
            time.sleep(rng.uniform(0.01, 0.2))
        server.proc.kill()
        server.proc.wait()
        print(f"kill {k + 1}: SIGKILL with {done} lines committed", file=sys.stderr)
        server.restart()
    batch = wait_done(http, batch_id)
    output = http.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()
    ids = [json.loads(line)["custom_id"] for line in output]
    missing = {f"line-{i}" for i in range(args.lines)} - set(ids)
    print(
        f"{batch['status']}: {len(ids)} output lines, {len(set(ids))} distinct custom_ids, "
        f"{len(missing)} missing, {len(ids) - len(set(ids))} duplicated"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["ttft", "throughput", "rss", "kill"])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lines", type=int)
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--probes", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--grace",
        type=float,
        default=2.5,
        help="wait this long after HTTP traffic (throughput:"
        " past the server's --batch-grace, so the batch runs alone)",
    )
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    defaults = {"ttft": (2000, 64), "throughput": (256, 64), "rss": (50000, 1), "kill": (500, 16)}
    args.lines = args.lines or defaults[args.mode][0]
    args.tokens = args.tokens or defaults[args.mode][1]
    data_dir = tempfile.mkdtemp(prefix="convoy-batch-bench-")
    args.serve_args = ["--data-dir", data_dir, *extra]
    server = ServerProcess(args)
    try:
        server.wait_healthy()
        with httpx.Client(base_url=server.url, timeout=None) as http:
            {"ttft": run_ttft, "throughput": run_throughput, "rss": run_rss,
             "kill": run_kill}[args.mode](http, args, server)  # fmt: skip
    finally:
        server.stop()


if __name__ == "__main__":
    main()
