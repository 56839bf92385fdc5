"""Soak: does `convoy serve` hold its memory under steady load? (issues #10, #29: growth < 1 KB
a request, in every mode)

    python bench/soak.py                        # float32, bfloat16, auto: 2,000 + 20,000 each
    python bench/soak.py --dtypes float32 --warmup 500 --requests 4000 --concurrency 32

For each of --dtypes (auto: the quantized default) starts `convoy serve` on a free 127.0.0.1
port with a KV pool of --kv-cache-memory (small, so the warm-up touches all of it), then sends
short completions (distinct prompts, `max_tokens` drawn from [--min-tokens, --max-tokens],
seeded) from --concurrency clients. The server's VmRSS (from /proc/PID/status) is sampled every
--every requests. After the warm-up, a least-squares line through the samples gives the growth
per request, and one through the last half of them the plateau check; the script prints each
curve and a summary, and exits 1 when a slope is above --limit-kb.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import sys
import time

import httpx

from prompts import make_prompts
from serve import ServerProcess


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0


async def soak(args: argparse.Namespace, url: str, pid: int) -> list[tuple[int, int, float]]:
    """Send warm-up + requests; returns (requests done, RSS bytes, seconds) samples."""
    rng = random.Random(args.seed)
    total = args.warmup + args.requests
    base = make_prompts(64)
    bodies = [
        {
            "prompt": f"#{i} {base[i % len(base)]}",
            "max_tokens": rng.randint(args.min_tokens, args.max_tokens),
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(total)
    ]
    samples: list[tuple[int, int, float]] = [(0, rss_bytes(pid), 0.0)]
    done = 0
    errors = 0
    next_job = 0
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def worker() -> None:
            nonlocal done, errors, next_job
            while next_job < total:
                body = bodies[next_job]
                next_job += 1
                r = await client.post(f"{url}/v1/completions", json=body)
                errors += r.status_code != 200
                done += 1
                if done % args.every == 0:
                    samples.append((done, rss_bytes(pid), time.monotonic() - t0))
                    n, rss, sec = samples[-1]
                    print(f"{n} requests, RSS {rss / 2**20:.1f} MiB, {sec:.0f} s", flush=True)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    if errors:
        print(f"{errors} requests failed", file=sys.stderr)
    return samples


def growth_kb(samples: list[tuple[int, int, float]], warmup: int) -> tuple[float, float]:
    """KB a request after the warm-up, and over the last half of those samples (the plateau)."""
    after = [(n, rss) for n, rss, _ in samples if n >= warmup]
    late = after[len(after) // 2 :]

    def kb(points: list[tuple[int, int]]) -> float:
        return (
            slope([n for n, _ in points], [r for _, r in points]) / 1024 if len(points) > 1 else 0
        )

    return kb(after), kb(late)


def run_mode(args: argparse.Namespace, dtype: str) -> tuple[float, float, int]:
    """One server in `dtype`: prints its curve; returns (KB/request, plateau KB/request, RSS)."""
    mode = copy.copy(args)
    mode.dtype = dtype
    mode.serve_args = ["--kv-cache-memory", args.kv_cache_memory, *args.serve_args]
    server = ServerProcess(mode)
    try:
        server.wait_healthy()
        samples = asyncio.run(soak(args, server.url, server.proc.pid))
    finally:
        server.stop()
    print(f"\n# soak: {args.model} dtype {dtype}, KV pool {args.kv_cache_memory}, concurrency "
          f"{args.concurrency}, max_tokens {args.min_tokens}-{args.max_tokens}")  # fmt: skip
    print("| requests | RSS MiB | seconds |\n|---|---|---|")
    for n, rss, s in samples:
        print(f"| {n} | {rss / 2**20:.1f} | {s:.0f} |")
    kb, late_kb = growth_kb(samples, args.warmup)
    return kb, late_kb, samples[-1][1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtypes", default="float32,bfloat16,auto", help="comma-separated modes")
    p.add_argument("--kv-cache-memory", default="128MiB", help="KV pool of each server")
    p.add_argument("--device", default="cpu")
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--every", type=int, default=500, help="RSS sample interval (requests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit-kb", type=float, default=1.0, help="pass: growth per request below")
    p.add_argument("serve_args", nargs="*", help="after --: more `convoy serve` flags")
    args = p.parse_args()

    rows = [(dtype, *run_mode(args, dtype)) for dtype in args.dtypes.split(",")]
    print(f"\n{args.warmup} warm-up + {args.requests} requests a mode, growth after the warm-up"
          f" (limit {args.limit_kb} KB/request)\n")  # fmt: skip
    print("| dtype | KB/request | last half KB/request | final RSS MiB |\n|---|---|---|---|")
    for dtype, kb, late_kb, rss in rows:
        print(f"| {dtype} | {kb:.2f} | {late_kb:.2f} | {rss / 2**20:.1f} |")
    worst = max(max(kb, late_kb) for _, kb, late_kb, _ in rows)
    sys.exit(0 if worst < args.limit_kb else 1)


if __name__ == "__main__":
    main()
