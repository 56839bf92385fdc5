"""Decode attention alone (`kernels.decode_attention`): B rows over a paged cache of `ctx` keys
each, per layer. Where long contexts make attention the larger part of a step (many streams,
verification rows): ms a layer, GMAC/s (scores and weighted sums) and the K/V bytes read a second.

    python bench/attention.py                                  # SmolLM2's heads, 64 x 1,000 keys
    python bench/attention.py --heads 4 --kv-heads 1 --head-dim 256 --rows 64 --ctx 1000
    python bench/attention.py --rows 9 --ctx 1600 --one-sequence   # a draft's 9 verification rows

Blocks of each sequence are scattered over the pool (a random permutation), as a server's are
after a while; --contiguous lays them in order. --one-sequence: every row is the next position
of one sequence (the same block table, lengths one apart). Opt-in, never in CI; figures in
bench/README.md ("Decode attention").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from convoy import kernels
from convoy.worker.kv_cache import _zeros as kv_zeros


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=1000, help="keys a row attends")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--one-sequence", action="store_true")
    parser.add_argument("--contiguous", action="store_true")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit("the CPU kernels are not available (no compiler?)")
    torch.manual_seed(0)
    h, hkv, d, bs, b = args.heads, args.kv_heads, args.head_dim, args.block_size, args.rows
    per_seq = -(-(args.ctx + b) // bs)
    num_blocks = per_seq * (1 if args.one_sequence else b)
    dtype = getattr(torch, args.cache_dtype)
    # allocated as the server's pool is (transparent huge pages asked for: with 4 KB pages every
    # scattered block is a TLB miss), then filled
    k = kv_zeros((hkv, num_blocks * bs, d), dtype, torch.device("cpu"))
    v = kv_zeros((hkv, num_blocks * bs, d), dtype, torch.device("cpu"))
    k.copy_(torch.randn(hkv, num_blocks * bs, d))
    v.copy_(torch.randn(hkv, num_blocks * bs, d))
    order = torch.arange(num_blocks) if args.contiguous else torch.randperm(num_blocks)
    if args.one_sequence:
        tables = order.expand(b, -1).contiguous()
        lens = torch.arange(args.ctx, args.ctx + b)
    else:
        tables = order.view(b, per_seq)
        lens = torch.full((b,), args.ctx)
    q = torch.randn(b, h, d)
    scale = d**-0.5

    def run() -> torch.Tensor:
        return kernels.decode_attention(q, k, v, tables, lens, bs, scale, 0)

    for _ in range(5):
        run()
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    dt = statistics.median(times)
    keys = int(lens.sum())
    macs = keys * h * d * 2  # q.k and p.v
    kv_bytes = (args.ctx + b if args.one_sequence else keys) * hkv * d * 2 * k.element_size()
    print(
        f"{b} rows x {args.ctx} keys, heads {h}/{hkv} x {d}, {args.cache_dtype} cache"
        f"{', one sequence' if args.one_sequence else ''}: {dt * 1e3:.2f} ms a layer (median of"
        f" {args.repeats}), {macs / dt / 1e9:.1f} GMAC/s, K/V {kv_bytes / dt / 1e9:.1f} GB/s,"
        f" {torch.get_num_threads()} threads"
    )


if __name__ == "__main__":
    main()
