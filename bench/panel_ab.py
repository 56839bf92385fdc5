"""Superblock-scaled panels against their base kinds, in one process: every Q4_K, Q5_K and Q6_K
linear of a GGUF packed both ways (kQ4K/kQ5K/kQ6K, the file's own scales; kQ4/kQ5/kQ6, an fp16
scale a block), then the sum of all their `quant_linear` calls timed at each row count, rounds
alternating between the two sets (the machine's drift hits both alike).

    .venv/bin/python bench/panel_ab.py ~/.cache/convoy/synth/llama-1b.q4_k_m.gguf --rows 1,16,64
    CONVOY_CPU_ISA=avx2 .venv/bin/python bench/panel_ab.py FILE     # the AVX2 build's kernels

The linears are the file's tensors one by one (not joined into qkv / gate_up as the model does).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader

from convoy import kernels
from convoy.kernels import ops

# GGML type -> (base kind, superblock-scaled kind)
KINDS = {
    12: (ops.QUANT_KIND_Q4, ops.QUANT_KIND_Q4K),
    13: (ops.QUANT_KIND_Q5, ops.QUANT_KIND_Q5K),
    14: (ops.QUANT_KIND_Q6, ops.QUANT_KIND_Q6K),
}
Linear = tuple[torch.Tensor, int, int, int]  # packed, kind, out features, in features


def packed_sets(path: Path) -> tuple[list[Linear], list[Linear]]:
    base: list[Linear] = []
    sb: list[Linear] = []
    for t in GGUFReader(path).tensors:
        qtype = int(t.tensor_type)
        if len(t.shape) != 2 or qtype not in KINDS:
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        blocks = torch.from_numpy(np.array(t.data)).view(torch.uint8).reshape(n, -1)
        for out, kind in zip((base, sb), KINDS[qtype], strict=True):
            out.append((ops.quant_pack(blocks, qtype, kind, k), kind, n, k))
    return base, sb


def run(linears: list[Linear], xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for packed, kind, n, k in linears:
        ops.quant_linear(xs[k], packed, kind, n, None)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf", type=Path)
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    if not kernels.available():
        raise SystemExit("the CPU kernels are not available here")
    base, sb = packed_sets(args.gguf.expanduser())
    print(f"# {args.gguf.name}: {len(base)} K-quant linears, threads {torch.get_num_threads()}, "
          f"kernels {kernels.builder.isa()}")  # fmt: skip
    mb = [sum(lin[0].numel() for lin in s) / 1e6 for s in (base, sb)]
    print(f"# panel bytes: base {mb[0]:.1f} MB, superblock-scaled {mb[1]:.1f} MB\n")
    print("| rows | base kinds (ms) | superblock-scaled (ms) | ratio |")
    print("|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for _, _, _, k in base}
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(args.rounds + 1):  # the first round warms up, not counted
            for linears, out in zip((base, sb), times, strict=True):
                out.append(run(linears, xs))
        a, b = (statistics.median(t[1:]) for t in times)
        print(f"| {m} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.3f} |")


if __name__ == "__main__":
    main()
