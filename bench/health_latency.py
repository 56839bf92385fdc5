"""/health latency while the server parses and tokenizes one ~32 MiB request.

    python bench/health_latency.py                      # smollm2, fp32, every shape, 31.5 MiB
    python bench/health_latency.py --shapes text --mib 8

Starts `convoy serve` on a free 127.0.0.1 port (default --max-request-bytes, 32 MiB) and, for
each request shape, sends one body just under the limit while another thread polls GET /health
every --interval seconds; it prints the request's status and time and /health latency
p50 / p99 / max over the polls made while the request was in flight. Shapes:
  idle      no request: /health alone, the machine's noise
  text      one text prompt of the whole body (too long for the context: 400 after tokenizing)
  texts     128 text prompts of 1/128 of the body each (every one is tokenized)
  chat      one chat message of the whole body (chat template, then tokenized)
Goal: max < 100 ms; a /health that waits for the request shows up as its whole duration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from typing import Any

import httpx

from prompts import make_prompts
from serve import ServerProcess

SHAPES = ("idle", "text", "texts", "chat")
IDLE_S = 3.0
NUM_TEXTS = 128


def make_body(shape: str, model: str, num_bytes: int) -> bytes:
    """A JSON body of about num_bytes (under it) whose prompt text fills it."""
    base = " ".join(make_prompts(64)) + " "
    text_len = num_bytes - 200  # room for the rest of the JSON
    if shape == "texts":
        piece = (base * (text_len // NUM_TEXTS // len(base) + 1))[: text_len // NUM_TEXTS - 8]
        body: dict[str, Any] = {"model": model, "prompt": [piece] * NUM_TEXTS, "max_tokens": 1}
    else:
        text = (base * (text_len // len(base) + 1))[:text_len]
        if shape == "chat":
            messages = [{"role": "user", "content": text}]
            body = {"model": model, "messages": messages, "max_tokens": 1}
        else:
            body = {"model": model, "prompt": text, "max_tokens": 1}
    raw = json.dumps(body).encode()
    assert len(raw) <= num_bytes, (len(raw), num_bytes)
    return raw


def poll_health(url: str, interval: float, until: threading.Event) -> list[float]:
    """/health latencies (s), one poll per interval, until `until` is set."""
    latencies: list[float] = []
    with httpx.Client(timeout=600) as client:
        next_at = time.perf_counter()
        while not until.is_set():
            start = time.perf_counter()
            assert client.get(f"{url}/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            next_at = max(next_at + interval, time.perf_counter())
            time.sleep(max(0.0, next_at - time.perf_counter()))
    return latencies


def run_shape(url: str, model: str, shape: str, args: argparse.Namespace) -> dict[str, Any]:
    done = threading.Event()
    result: dict[str, Any] = {"shape": shape, "mib": 0.0, "status": "-", "seconds": IDLE_S}
    if shape == "idle":
        threading.Timer(IDLE_S, done.set).start()
    else:
        raw = make_body(shape, model, int(args.mib * 2**20))
        result["mib"] = len(raw) / 2**20
        path = "/v1/chat/completions" if shape == "chat" else "/v1/completions"

        def send() -> None:
            start = time.perf_counter()
            try:
                with httpx.Client(timeout=600) as client:
                    headers = {"Content-Type": "application/json"}
                    response = client.post(f"{url}{path}", content=raw, headers=headers)
                result["status"] = response.status_code
            finally:
                result["seconds"] = time.perf_counter() - start
                done.set()

        threading.Thread(target=send, daemon=True).start()
    latencies = poll_health(url, args.interval, done)
    result["polls"] = len(latencies)
    ms = sorted(x * 1000 for x in latencies)
    result["p50"] = statistics.median(ms)
    result["p99"] = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    result["max"] = ms[-1]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mib", type=float, default=31.5, help="body size (limit: 32 MiB)")
    parser.add_argument("--interval", type=float, default=0.01, help="seconds between polls")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()

    server = ServerProcess(args)
    rows = []
    try:
        server.wait_healthy()
        for shape in args.shapes.split(","):
            rows.append(run_shape(server.url, args.model, shape, args))
            print(f"  {shape}: done", file=sys.stderr)
    finally:
        server.stop()
    print(f"\n/health latency (ms) while one request is processed; {args.model} {args.dtype}\n")
    print("| shape | body MiB | status | request s | polls | p50 | p99 | max |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['mib']:.1f} | {r['status']} | {r['seconds']:.1f} |"
            f" {r['polls']} | {r['p50']:.1f} | {r['p99']:.1f} | {r['max']:.1f} |"
        )


if __name__ == "__main__":
    main()
