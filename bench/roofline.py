"""The host's limits and each GGUF file's rooflines, for reading bench/peer.py's tokens/s.

    python bench/roofline.py ~/.cache/convoy/synth/llama-3b.q4_k_m.gguf [more.gguf ...]

Measures, with the threads torch uses (default: every core):
- DRAM read bandwidth: the best of 5 `sum`s over a 2 GiB fp32 tensor (far beyond any cache);
- the int8 MAC peak: the best of `torch._int_mm` (oneDNN's int8 GEMM, VNNI where the CPU has it)
  over a few large shapes: the most int8 multiply-accumulates per second a library reaches here.

Per file: the bytes one decode token must read (every matrix of the body in the file's own types,
plus the output head: the token embedding when the head is tied; the embedding lookup reads one
row and is left out), the multiply-accumulates a token costs in those matrices (attention over
the context is left out: short contexts), and from them
- the one-stream bandwidth roofline: bandwidth / bytes per token (tokens/s);
- the compute roofline at many streams: int8 MAC peak / MACs per token (tokens/s).
A server's share of a roofline is its measured tokens/s over it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader


def bandwidth() -> float:
    x = torch.ones(512 * 1024 * 1024)  # 2 GiB of fp32
    x.sum()
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t))
    return best


def int8_peak() -> float:
    best = 0.0
    for m, k, n in ((256, 4096, 4096), (512, 4096, 4096), (1024, 4096, 2048)):
        a = torch.randint(-128, 127, (m, k), dtype=torch.int8)
        b = torch.randint(-128, 127, (k, n), dtype=torch.int8)
        torch._int_mm(a, b)
        for _ in range(3):
            t = time.perf_counter()
            torch._int_mm(a, b)
            best = max(best, m * k * n / (time.perf_counter() - t))
    return best


def per_token(path: Path) -> tuple[int, int]:
    """(bytes, MACs) one decode token reads and computes in the file's matrices."""
    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    nbytes = macs = 0
    for t in reader.tensors:
        if len(t.shape) < 2:
            continue  # norms, biases
        if t.name == "token_embd.weight" and not tied:
            continue  # only looked up
        if t.name.endswith("_exps.weight") or t.name.endswith("ffn_gate_inp.weight"):
            raise SystemExit(f"{path}: a mixture-of-experts file (see bench/README.md's MoE section)")
        nbytes += int(t.n_bytes)
        macs += int(np.prod([int(d) for d in t.shape]))
    return nbytes, macs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bw, peak = bandwidth(), int8_peak()
    print(f"threads {torch.get_num_threads()}: DRAM read {bw / 1e9:.1f} GB/s, "
          f"int8 MAC peak {peak / 1e9:.0f} GMAC/s (torch._int_mm)")  # fmt: skip
    print()
    print("| file | MB read / token | GMAC / token | 1-stream roofline tok/s | compute roofline tok/s |")
    print("|---|---|---|---|---|")
    for path in args.files:
        nbytes, macs = per_token(path)
        print(f"| {path.name} | {nbytes / 1e6:.0f} | {macs / 1e9:.2f} | {bw / nbytes:.1f} | "
              f"{peak / macs:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
