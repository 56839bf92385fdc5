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

With --by-isa, the int8 MAC peak is measured once per instruction set oneDNN can use on this CPU
(`ONEDNN_MAX_CPU_ISA` in a fresh process each: AVX2's `vpmaddubsw`, AVX-VNNI, AVX-512 VNNI, AMX),
and with --rows / --streams Convoy's own kernels are measured beside them, once per kernel build
(`CONVOY_CPU_ISA`: the AVX2 build and, where the CPU has them, the AVX-VNNI and AVX-512 VNNI
ones), each against
the oneDNN peak of its own instruction set:
- --rows 16,64: the quantized linears of two decoder layers of each file at that many rows, GMAC/s;
- --streams 16: greedy decode of that many streams of each file (decode only: the time of 65
  tokens less that of 1), tokens/s and GMAC/s (tokens/s x GMAC a token).

    python bench/roofline.py --by-isa --rows 16,64 --streams 16 ~/.cache/convoy/synth/llama-1b.q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
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
            raise SystemExit(
                f"{path}: a mixture-of-experts file (see bench/README.md's MoE section)"
            )
        nbytes += int(t.n_bytes)
        macs += int(np.prod([int(d) for d in t.shape]))
    return nbytes, macs


# oneDNN's names (ONEDNN_MAX_CPU_ISA) and the /proc/cpuinfo flags each needs; Convoy's kernel
# build that runs on the same instructions
ONEDNN_ISAS = (
    ("AVX2", {"avx2"}, "avx2"),
    ("AVX2_VNNI", {"avx2", "avx_vnni"}, "avxvnni"),
    ("AVX512_CORE_VNNI", {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "avx512vnni"),
    ("AVX512_CORE_AMX", {"amx_int8", "amx_tile"}, None),
)


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def worker(args: list[str], env: dict[str, str]) -> dict:
    """This script's --worker mode in a fresh process (the ISA variables are read at start)."""
    out = subprocess.run(
        [sys.executable, __file__, "--worker", *args],
        env={**os.environ, **env}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def convoy_kernels(path: str, rows: list[int], streams: int) -> dict:
    """Convoy's quantized linears of decoder layers 2-3 at each row count (GMAC/s, median of 8)
    and greedy decode of `streams` streams (tokens/s, median of 3), in this process."""
    from convoy import LLM, SamplingParams
    from convoy.kernels import builder
    from convoy.kernels.linear import QuantLinear

    llm = LLM(path, enable_prefix_caching=False)
    res: dict = {"isa": builder.isa(), "linears": {}}
    tags = (".layers.2.", ".layers.3.")
    lin = [
        m for n, m in llm.core.worker.model.named_modules()
        if isinstance(m, QuantLinear) and any(t in n for t in tags)
    ]  # fmt: skip
    for m_rows in rows:
        xs = [torch.randn(m_rows, m.in_features) for m in lin]
        macs = sum(m_rows * m.in_features * m.out_features for m in lin)
        rates = []
        for _ in range(8):
            t = time.perf_counter()
            for m, x in zip(lin, xs, strict=True):
                m(x)
            rates.append(macs / (time.perf_counter() - t))
        res["linears"][m_rows] = statistics.median(rates)
    if streams:
        prompts = [f"Story {i}: once upon a time" for i in range(streams)]

        def run(n: int) -> float:
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            return time.perf_counter() - t

        run(4)
        rates = []
        for _ in range(3):
            one = run(1)
            rates.append(streams * 64 / (run(65) - one))
        res["decode"] = statistics.median(rates)
    return res


def by_isa(files: list[Path], rows: list[int], streams: int) -> None:
    flags = cpu_flags()
    peaks: dict[str, float] = {}
    for name, need, _ in ONEDNN_ISAS:
        if need <= flags:
            peaks[name] = worker(["peak"], {"ONEDNN_MAX_CPU_ISA": name})["peak"]
    print("int8 MAC peak by instruction set (oneDNN `torch._int_mm`, ONEDNN_MAX_CPU_ISA): "
          + ", ".join(f"{n} {p / 1e9:.0f} GMAC/s" for n, p in peaks.items()))  # fmt: skip
    if not files or not (rows or streams):
        return
    print()
    head = [f"linears at {r} rows" for r in rows] + (
        [f"decode, {streams} streams"] if streams else []
    )
    print("| file | kernels | same-ISA peak | " + " | ".join(head) + " |")
    print("|---" * (3 + len(head)) + "|")
    for path in files:
        _, macs = per_token(path)
        for name, _, build in ONEDNN_ISAS:
            if build is None or name not in peaks:
                continue
            r = worker(["convoy", str(path), ",".join(map(str, rows)), str(streams)],
                       {"CONVOY_CPU_ISA": build})  # fmt: skip
            peak = peaks[name]
            cells = [f"{v / 1e9:.0f} GMAC/s ({v / peak:.0%})" for v in r["linears"].values()]
            if streams:
                tps = r["decode"]
                cells.append(
                    f"{tps:.1f} tok/s = {tps * macs / 1e9:.0f} GMAC/s ({tps * macs / peak:.0%})"
                )
            print(f"| {path.name} | {r['isa']} | {name} {peak / 1e9:.0f} | " + " | ".join(cells) + " |",
                  flush=True)  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        what = sys.argv[2]
        if what == "peak":
            print(json.dumps({"peak": max(int8_peak() for _ in range(3))}))  # best of 3 tries
        else:
            rows = [int(r) for r in sys.argv[4].split(",") if r]
            print(json.dumps(convoy_kernels(sys.argv[3], rows, int(sys.argv[5]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    parser.add_argument("--by-isa", action="store_true", help="the int8 peak per instruction set")
    parser.add_argument("--rows", default="", help="with --by-isa: Convoy's linears at these rows")
    parser.add_argument("--streams", type=int, default=0, help="with --by-isa: decode of N streams")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.by_isa:
        by_isa(args.files, [int(r) for r in args.rows.split(",") if r], args.streams)
        return
    bw, peak = bandwidth(), int8_peak()
    print(f"threads {torch.get_num_threads()}: DRAM read {bw / 1e9:.1f} GB/s, "
          f"int8 MAC peak {peak / 1e9:.0f} GMAC/s (torch._int_mm)")  # fmt: skip
    print()
    print(
        "| file | MB read / token | GMAC / token | 1-stream roofline tok/s | compute roofline tok/s |"
    )
    print("|---|---|---|---|---|")
    for path in args.files:
        nbytes, macs = per_token(path)
        print(f"| {path.name} | {nbytes / 1e6:.0f} | {macs / 1e9:.2f} | {bw / nbytes:.1f} | "
              f"{peak / macs:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
