"""The routed experts of one MoE layer: `kernels.moe_experts` (one call) against the per-expert
Python loop (`QuantExperts.forward_loop`: quant_linear + act_and_mul + quant_linear per expert),
and a dense quant_linear over as many weight bytes as the k experts of one row (in as many copies
as the experts' bytes of all layers, used in turn), for a GB/s reference. Default: an OLMoE-like layer, H 2048, intermediate 1024, 64 experts, top 8, Q4_0.

    .venv/bin/python bench/moe_kernel.py                    # T = 1, 16, 64; 2 threads
    .venv/bin/python bench/moe_kernel.py --tokens 1 --threads 1 --repeats 50

Weights are random Q4_0 blocks (random quants, fp16 scales 0.001-0.01), packed as QuantExperts
packs them, in --layers copies used in turn (several layers' experts: more than the host's caches
hold, as in a model) with fresh random routes (top-k of 64, uniform) each call. Prints the median
and min ms per call, the expert weight bytes the call reads (the distinct experts routed to), and
GB/s = those bytes / median time. On a shared host use --wait-idle: a neighbour's busy thread
stalls every 2-thread parallel region.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable

import torch

from convoy import kernels
from convoy.kernels.ops import QUANT_KIND_Q4, quant_linear, quant_pack
from convoy.models.moe import QuantExperts

Q4_0 = 2
Q4_0_BYTES = 18  # per 32 weights


def q4_0_blocks(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """(..., rows, cols / 32 * 18) random Q4_0 blocks with a sane fp16 scale in bytes 0-1."""
    *lead, cols = shape
    raw = torch.randint(0, 256, (*lead, cols // 32, Q4_0_BYTES), dtype=torch.uint8, generator=gen)
    d = (torch.rand(*lead, cols // 32, generator=gen) * 0.009 + 0.001).to(torch.float16)
    raw[..., 0:2] = d.view(torch.uint8).reshape(*lead, cols // 32, 2)
    return raw.reshape(*lead, -1)


def timed(fn: Callable[[int], object], repeats: int) -> tuple[float, float]:
    fn(0)  # warm
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i + 1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def host_cpu() -> float:
    """Seconds of CPU the whole host used so far (from /proc/stat), to tell a noisy run."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


Case = tuple[str, Callable[[int], object], float]


def cases(
    x: torch.Tensor,
    routes: list[tuple[torch.Tensor, torch.Tensor]],
    layers: list[QuantExperts],
    dense: list[torch.Tensor],
    rows: int,
    read: float,
    dense_bytes: int,
) -> list[Case]:
    """(name, call n, bytes read) of the three contenders at one x; call n runs route n on layer
    copy n % copies."""

    def kernel(n: int) -> object:
        return layers[n % len(layers)](x, *routes[n])

    def loop(n: int) -> object:
        return layers[n % len(layers)].forward_loop(x, *routes[n])

    def dense_linear(n: int) -> object:
        return quant_linear(x, dense[n % len(dense)], QUANT_KIND_Q4, rows, None)

    assert torch.equal(layers[0](x, *routes[0]), layers[0].forward_loop(x, *routes[0]))
    return [("moe_experts", kernel, read), ("python loop", loop, read),
            ("dense quant_linear", dense_linear, dense_bytes)]  # fmt: skip


def wait_idle(limit_s: float, max_others: float = 0.2) -> float:
    """Wait (up to limit_s) for half a second in which other processes used under max_others
    cores; returns the last such reading (cores)."""
    deadline = time.monotonic() + limit_s
    while True:
        host0, own0, t0 = host_cpu(), time.process_time(), time.perf_counter()
        time.sleep(0.5)
        others = (host_cpu() - host0 - (time.process_time() - own0)) / (time.perf_counter() - t0)
        if others < max_others or time.monotonic() > deadline:
            return others


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", default="1,16,64")
    p.add_argument("--layers", type=int, default=4, help="copies of the experts, used in turn")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--wait-idle", type=float, default=0.0, help="seconds to wait for a quiet host")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels.build()
    h, i, e, k = args.hidden, args.intermediate, args.experts, args.top_k
    gen = torch.Generator().manual_seed(0)
    gu = q4_0_blocks((e, 2 * i, h), gen)
    dn = q4_0_blocks((e, h, i), gen)
    first = QuantExperts([(Q4_0, gu)], [(Q4_0, dn)], h, i, "silu")
    layers = [first, *(copy.deepcopy(first) for _ in range(1, args.layers))]
    expert_bytes = (layers[0].gate_up.numel() + layers[0].down.numel()) // e
    # dense reference: one (k * (2i + h), h) Q4_0 weight = the bytes of k experts
    rows = k * (2 * i * h + h * i) // h
    # as many copies as hold all the layers' experts: the host's L3 may hold a few (480 MB here)
    copies = max(1, args.layers * e // k)
    dense = [quant_pack(q4_0_blocks((rows, h), gen), Q4_0, QUANT_KIND_Q4, h)
             for _ in range(copies)]  # fmt: skip
    dense_bytes = dense[0].numel()
    print(
        f"H {h}, intermediate {i}, {e} experts, top {k}, Q4_0, {args.threads} threads, "
        f"{args.layers} layer copies; {expert_bytes / 2**20:.2f} MiB an expert, "
        f"dense reference {rows}x{h} ({dense_bytes / 2**20:.1f} MiB, {copies} copies)"
    )
    print("| T | what | median ms | min ms | MiB read | GB/s (median) |")
    print("|---|---|---|---|---|---|")
    host0, own0, wall0 = host_cpu(), time.process_time(), time.perf_counter()
    for t in [int(v) for v in args.tokens.split(",")]:
        x = torch.randn(t, h, generator=gen)
        routes = []
        for _ in range(args.repeats + 1):
            logits = torch.randn(t, e, generator=gen)
            w, ids = torch.topk(torch.softmax(logits, -1), k, -1)
            routes.append((ids, w / w.sum(-1, keepdim=True)))
        read = statistics.mean(len(torch.unique(r[0])) for r in routes) * expert_bytes
        for name, fn, nbytes in cases(x, routes, layers, dense, rows, read, dense_bytes):
            if args.wait_idle:
                wait_idle(args.wait_idle)
            med, lo = timed(fn, args.repeats)
            gbs = nbytes / med / 1e6
            print(f"| {t} | {name} | {med:.2f} | {lo:.2f} | {nbytes / 2**20:.0f} | {gbs:.1f} |")
    wall = time.perf_counter() - wall0
    others = (host_cpu() - host0) - (time.process_time() - own0)
    print(f"\nother processes' CPU during the run: ~{max(others, 0) / wall:.2f} cores on average")


if __name__ == "__main__":
    main()
