"""The event loop beside many streams: /health and a new request's first token while N clients
stream (issue #29, "The event loop under many streams").

    python bench/stream_loop.py                          # smollm2, fp32, 256 streams
    python bench/stream_loop.py --streams 64 --dtype auto

Starts `convoy serve` on a free 127.0.0.1 port. Idle first: --probes times a one-token streamed
completion (its time to the first token, TTFT) and /health is polled every --interval seconds
for a few seconds. Then --streams clients each stream one completion of --max-tokens tokens
(ignore_eos) at once; while they run, /health is polled and a probe request is sent every
second (from a client process of its own). Prints /health p50 / p99 / max idle and under load, the probes' TTFT (median and max)
idle and under load, and the streams' tokens a second. Goals (#29): /health max < 500 ms and a
new request's TTFT < 3x idle beside 256 streams. Opt-in, never in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from prompts import make_prompts
from serve import ServerProcess

IDLE_S = 3.0


async def poll_health(client: httpx.AsyncClient, interval: float, stop: asyncio.Event) -> list[float]:
    out = []
    while not stop.is_set():
        t = time.perf_counter()
        (await client.get("/health")).raise_for_status()
        out.append(time.perf_counter() - t)
        await asyncio.sleep(interval)
    return out


PROBE = """
import json, sys, time, httpx
url, model, prompt = sys.argv[1:4]
body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True}
with httpx.Client(base_url=url, timeout=600) as client:
    t = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                print(time.perf_counter() - t)
                break
"""


HEALTH = """
import os, sys, time, httpx
url, interval, stop = sys.argv[1], float(sys.argv[2]), sys.argv[3]
t0 = time.perf_counter()
with httpx.Client(base_url=url, timeout=600) as client:
    while not os.path.exists(stop):
        t = time.perf_counter()
        client.get("/health").raise_for_status()
        print(f"{t - t0:.3f} {time.perf_counter() - t:.6f}", flush=True)
        time.sleep(interval)
"""


async def start_health_process(url: str, interval: float, stop: str) -> asyncio.subprocess.Process:
    """/health polled from a process of its own (the streams' client loop, busy with their chunks,
    delays the in-process poller's own reading of each reply)."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", HEALTH, url, str(interval), stop, stdout=asyncio.subprocess.PIPE
    )


async def ttft(url: str, model: str, prompt: str) -> float:
    """Seconds from sending a streamed one-token completion to its first token, from a client
    process of its own (a new user's; the streams' client loop, busy with their chunks on the
    same host, would otherwise add its own delay to the figure)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PROBE, url, model, prompt, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0 or not out.strip():
        raise RuntimeError("no token")
    return float(out)


async def stream(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            chunks += line.startswith("data: {")
    return chunks


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


async def run(args: argparse.Namespace, url: str) -> None:
    limits = httpx.Limits(max_connections=args.streams + 16, max_keepalive_connections=args.streams + 16)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        prompts = make_prompts(args.streams + args.probes)
        idle_ttft = [await ttft(url, model, p) for p in prompts[: args.probes]]
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_health(client, args.interval, stop))
        await asyncio.sleep(IDLE_S)
        stop.set()
        idle_health = await poller

        stop = asyncio.Event()
        poller = asyncio.create_task(poll_health(client, args.interval, stop))
        stop_file = Path(tempfile.mkdtemp(prefix="stream-loop-")) / "stop"
        health_proc = await start_health_process(url, args.interval, str(stop_file))
        t0 = time.perf_counter()
        streams = [asyncio.create_task(stream(client, model, p, args.max_tokens))
                   for p in prompts[: args.streams]]  # fmt: skip
        busy_ttft = []
        await asyncio.sleep(2.0)  # the streams are admitted and decoding
        while not all(s.done() for s in streams) and len(busy_ttft) < args.probes:
            busy_ttft.append(await ttft(url, model, prompts[-1 - len(busy_ttft)]))
            await asyncio.sleep(1.0)
        chunks = sum(await asyncio.gather(*streams))
        wall = time.perf_counter() - t0
        stop.set()
        busy_health = await poller
        stop_file.touch()
        out, _ = await health_proc.communicate()
        stop_file.unlink()
        stop_file.parent.rmdir()
    # (seconds since the streams started, latency) of each poll from the process of its own
    apart = [tuple(map(float, line.split())) for line in out.decode().splitlines()]
    ms = 1e3
    print(f"\n{args.model} {args.dtype}, {args.streams} streams x {args.max_tokens} tokens: "
          f"{chunks} chunks in {wall:.1f} s ({chunks / wall:.0f} a second)")  # fmt: skip
    for name, h in (("idle", idle_health), ("beside the streams", busy_health)):
        print(f"/health {name}: p50 {statistics.median(h) * ms:.1f} ms, p99 {pct(h, 0.99) * ms:.1f} ms,"
              f" max {max(h) * ms:.1f} ms over {len(h)} polls")  # fmt: skip
    if apart:
        lat = [x for _, x in apart]
        worst = sorted(apart, key=lambda p: -p[1])[:3]
        print(f"/health beside the streams, polled from a process of its own: p50"
              f" {statistics.median(lat) * ms:.1f} ms, p99 {pct(lat, 0.99) * ms:.1f} ms, max"
              f" {max(lat) * ms:.1f} ms over {len(lat)} polls; worst at "
              + ", ".join(f"{t:.1f} s ({x * ms:.0f} ms)" for t, x in worst))  # fmt: skip
    print("TTFT beside the streams, each probe: "
          + ", ".join(f"{t * ms:.0f}" for t in busy_ttft) + " ms")
    for name, t in (("idle", idle_ttft), ("beside the streams", busy_ttft)):
        if t:
            print(f"TTFT {name}: median {statistics.median(t) * ms:.0f} ms, max {max(t) * ms:.0f} ms"
                  f" over {len(t)} probes")  # fmt: skip
    if busy_ttft:
        ratio = statistics.median(busy_ttft) / statistics.median(idle_ttft)
        apart_max = f", {max(lat) * ms:.0f} ms from a process of its own" if apart else ""
        print(f"TTFT beside the streams / idle (medians): {ratio:.1f}x (goal < 3x); "
              f"/health max {max(busy_health) * ms:.0f} ms{apart_max} (goal < 500 ms)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--probes", type=int, default=8)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between /health polls")
    parser.add_argument("--max-num-seqs", type=int, default=0, help="the server's; 0: its default")
    parser.add_argument("serve_args", nargs="*", help="after --: more `convoy serve` flags")
    args = parser.parse_args()
    args.serve_args[:0] = ["--max-queue-seqs", str(4 * args.streams), "--max-seqs-per-request", "16"]
    if args.max_num_seqs:
        args.serve_args += ["--max-num-seqs", str(args.max_num_seqs)]
    server = ServerProcess(args)
    try:
        server.wait_healthy()
        asyncio.run(run(args, server.url))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
