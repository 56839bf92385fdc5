"""Load and overload on loopback (issue #10): many streams, a disconnect storm, the queue limit.

    python bench/load.py                        # 256 streams, 200 dropped, queue limit 64
    python bench/load.py --streams 128 --tokens 16 --drop 100

Three phases, each against a fresh `convoy serve` on 127.0.0.1 (default model, dtype auto):
  streams     --streams concurrent streaming /v1/completions (--tokens each, EOS ignored):
              counts errors and streams that did not end with `[DONE]`; the server's peak RSS
              (VmHWM) and wall time
  disconnect  --drop streams, each closed by its client after its first chunks; then
              `convoy_kv_blocks_used` must come back to 0 and a new request must be served
  queue       a server with `--max-queue-seqs Q`: 2 x Q one-sequence requests at once; the ones
              over the limit get 429 with Retry-After, every other one completes (none hangs)
Prints a table and exits 1 when a phase fails. Every request is bounded by --timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from dataclasses import dataclass

import httpx

from prompts import make_prompts
from serve import ServerProcess


@dataclass
class Phase:
    name: str
    ok: bool
    detail: str


def status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key}")


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{name} not in /metrics")
    return float(match.group(1))


def body(prompt: str, tokens: int, stream: bool) -> dict[str, object]:
    return {
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def one_stream(
    client: httpx.AsyncClient, url: str, prompt: str, tokens: int, drop_after: int | None
) -> str:
    """'done' (ended with [DONE]), 'dropped' (closed by us), else what went wrong."""
    async with client.stream("POST", f"{url}/v1/completions", json=body(prompt, tokens, True)) as r:
        if r.status_code != 200:
            return f"status {r.status_code}"
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "done"
            if '"error"' in line:
                return "error frame"
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return "dropped"  # leaving the block closes the connection mid-stream
    return "no [DONE]"


async def streams_phase(args: argparse.Namespace, url: str, pid: int) -> Phase:
    prompts = make_prompts(args.streams)
    limits = httpx.Limits(max_connections=args.streams)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        results = await asyncio.gather(
            *(one_stream(client, url, p, args.tokens, None) for p in prompts),
            return_exceptions=True,
        )
    wall = time.monotonic() - t0
    bad = [r for r in results if r != "done"]
    peak = status_kb(pid, "VmHWM") / 1024
    detail = (
        f"{args.streams} streams x {args.tokens} tokens in {wall:.1f} s "
        f"({args.streams * args.tokens / wall:.0f} tok/s); {len(bad)} failed "
        f"{sorted(set(map(str, bad)))[:3]}; peak RSS {peak:.0f} MiB"
    )
    return Phase("streams", not bad, detail)


async def disconnect_phase(args: argparse.Namespace, url: str) -> Phase:
    prompts = make_prompts(args.drop)
    limits = httpx.Limits(max_connections=args.drop)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        results = await asyncio.gather(
            *(one_stream(client, url, p, 256, drop_after=2) for p in prompts),
            return_exceptions=True,
        )
    dropped = sum(r == "dropped" for r in results)
    deadline = time.monotonic() + 60
    used = metric(url, "convoy_kv_blocks_used")
    while used and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # polling the gauge
        used = metric(url, "convoy_kv_blocks_used")
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        after = await client.post(f"{url}/v1/completions", json=body("Hello", 8, False))
    detail = (
        f"{dropped}/{args.drop} streams dropped mid-way; KV blocks used after: {used:.0f}; "
        f"next request: {after.status_code}"
    )
    return Phase(
        "disconnect", dropped == args.drop and used == 0 and after.status_code == 200, detail
    )


async def queue_phase(args: argparse.Namespace, url: str) -> Phase:
    n = 2 * args.queue
    prompts = make_prompts(n)
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        responses = await asyncio.gather(
            *(client.post(f"{url}/v1/completions", json=body(p, 16, False)) for p in prompts),
            return_exceptions=True,
        )
    codes: dict[str, int] = {}
    missing_retry = 0
    for r in responses:
        key = type(r).__name__ if isinstance(r, BaseException) else str(r.status_code)
        codes[key] = codes.get(key, 0) + 1
        if isinstance(r, httpx.Response) and r.status_code == 429:
            missing_retry += "retry-after" not in r.headers
    ok = set(codes) <= {"200", "429"} and codes.get("429", 0) > 0 and not missing_retry
    detail = f"{n} requests against a queue of {args.queue}: {codes}; 429 without Retry-After: {missing_retry}"
    return Phase("queue", ok, detail)


def run_server(args: argparse.Namespace, extra: list[str]) -> ServerProcess:
    args.serve_args = extra
    server = ServerProcess(args)
    server.wait_healthy()
    return server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--drop", type=int, default=200)
    p.add_argument("--queue", type=int, default=64)
    p.add_argument("--timeout", type=float, default=600, help="seconds, per request")
    args = p.parse_args()

    phases: list[Phase] = []
    server = run_server(args, [])
    try:
        phases.append(asyncio.run(streams_phase(args, server.url, server.proc.pid)))
        phases.append(asyncio.run(disconnect_phase(args, server.url)))
    finally:
        server.stop()
    queue = str(args.queue)
    server = run_server(args, ["--max-queue-seqs", queue, "--max-seqs-per-request", queue])
    try:
        phases.append(asyncio.run(queue_phase(args, server.url)))
    finally:
        server.stop()
    print("| phase | pass | figures |\n|---|---|---|")
    for ph in phases:
        print(f"| {ph.name} | {'yes' if ph.ok else 'NO'} | {ph.detail} |")
    sys.exit(0 if all(ph.ok for ph in phases) else 1)


if __name__ == "__main__":
    main()
