"""The sampler's cost per step for many rows of a large vocabulary (default: 64 rows of Gemma 3's
262144 logits), greedy and random, with and without top-p, on logits of a chosen spread.

    .venv/bin/python bench/sampler.py                       # N(0, 4^2) logits: a peaked nucleus
    .venv/bin/python bench/sampler.py --scale 1 --rows 16   # flat logits: top-p sorts the row

Prints the median and min of `sampler.sample` over --repeats calls per case.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from convoy.sampling_params import SamplingParams
from convoy.worker.batch import SamplerRow
from convoy.worker.sampler import sample

CASES = {
    "greedy": (SamplingParams(temperature=0.0), None),
    "temperature 0.8": (SamplingParams(temperature=0.8), None),
    "temperature 0.8, seeded": (SamplingParams(temperature=0.8), 7),
    "temperature 0.8, top_p 0.9": (SamplingParams(temperature=0.8, top_p=0.9), None),
    "temperature 0.8, top_k 40": (SamplingParams(temperature=0.8, top_k=40), None),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--scale", type=float, default=4.0, help="logits ~ N(0, scale^2)")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=gen) * args.scale
    print(f"{args.rows} rows x {args.vocab} logits ~ N(0, {args.scale}^2), ms per sample() call")
    print("| case | median | min |\n|---|---|---|")
    for name, (params, seed) in CASES.items():
        rows = [SamplerRow(params, seed, [1], [2], [0], False) for _ in range(args.rows)]
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            sample(logits, rows)
            times.append(time.perf_counter() - t)
        print(f"| {name} | {statistics.median(times) * 1e3:.1f} | {min(times) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
