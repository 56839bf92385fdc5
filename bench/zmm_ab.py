"""zmm tiles against ymm tiles (`CONVOY_CPU_ZMM=0`) in one process, on a host whose kernels are
built for AVX-512 VNNI: the quantized linears of two decoder layers of a GGUF file at each row
count, then (with --decode) greedy decode of B streams and (with --prefill) one ~1,000-token
prompt through the offline engine. Rounds alternate the order, so the machine's drift hits both
alike; the outputs are checked to be the same bits (linears) and the same tokens (decode).

    .venv/bin/python bench/zmm_ab.py ~/.cache/convoy/synth/llama-3b.q4_k_m.gguf --rows 16,64
    .venv/bin/python bench/zmm_ab.py FILE --rows 16,64 --decode 16 --prefill
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from convoy import LLM, SamplingParams
from convoy.kernels import builder
from convoy.kernels.linear import QuantLinear

FLAG = "CONVOY_CPU_ZMM"


def alternate(rounds: int, run: Callable[[], float]) -> dict[str, list[float]]:
    """run() under each setting, `rounds` times, the order flipping each round."""
    res: dict[str, list[float]] = {"zmm": [], "ymm": []}
    for r in range(rounds):
        for name in ("zmm", "ymm") if r % 2 == 0 else ("ymm", "zmm"):
            os.environ[FLAG] = "1" if name == "zmm" else "0"
            res[name].append(run())
    os.environ.pop(FLAG, None)
    return res


def report(what: str, res: dict[str, list[float]], unit: str, higher_is_better: bool) -> None:
    z, y = statistics.median(res["zmm"]), statistics.median(res["ymm"])
    ratio = z / y if higher_is_better else y / z
    print(f"{what}: zmm {z:.2f} {unit}, ymm {y:.2f} {unit}, zmm faster by {ratio:.3f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--rows", default="16,64")
    p.add_argument("--layers", default="2,3", help="decoder layers whose linears are timed")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--decode", type=int, default=0, help="streams of greedy decode (0: none)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--speculative", default="auto", help="the engine's drafting (auto, off)")
    p.add_argument("--prefill", action="store_true")
    args = p.parse_args()
    if builder.isa() != "avx512vnni":
        raise SystemExit(f"kernels here are built for {builder.isa()}: no zmm tiles to compare")
    llm = LLM(
        args.model, num_kv_blocks=1024, enable_prefix_caching=False, speculative=args.speculative
    )
    layers = [f".layers.{i}." for i in args.layers.split(",")]
    linears = [
        m
        for n, m in llm.core.worker.model.named_modules()
        if isinstance(m, QuantLinear) and any(tag in n for tag in layers)
    ]
    kinds = sorted({m.panel_kind & 0xFF for m in linears})
    print(f"{len(linears)} linears (panel kinds {kinds}), {torch.get_num_threads()} threads")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, m.in_features) for m in linears]
        macs = sum(rows * m.in_features * m.out_features for m in linears)
        outs: dict[str, list[torch.Tensor]] = {}

        def linears_once(
            rows: int = rows, xs: list = xs, macs: int = macs, outs: dict = outs
        ) -> float:
            start = time.perf_counter()
            ys = [m(x) for m, x in zip(linears, xs, strict=True)]
            seconds = time.perf_counter() - start
            outs.setdefault(os.environ[FLAG], ys)
            return macs / seconds / 1e9

        res = alternate(args.rounds, linears_once)
        same = all(torch.equal(a, b) for a, b in zip(outs["1"], outs["0"], strict=True))
        report(f"linears at {rows} rows", res, "GMAC/s", True)
        print(f"  same bits: {same}")
    if args.decode:
        prompts = [f"Story {i}: once upon a time" for i in range(args.decode)]
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts[:2], params)
        tokens: dict[str, list[list[int]]] = {}

        def decode_once() -> float:
            start = time.perf_counter()
            out = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            tokens.setdefault(os.environ[FLAG], [list(o.outputs[0].token_ids) for o in out])
            return len(prompts) * args.tokens / seconds

        report(
            f"decode, {args.decode} streams",
            alternate(max(2, args.rounds // 2), decode_once),
            "tok/s",
            True,
        )
        print(f"  same tokens: {tokens['1'] == tokens['0']}")
    if args.prefill:
        text = " ".join(f"word{i} and more text number {i}." for i in range(160))
        ids = llm.tokenizer.encode(text)[:1000]
        one = SamplingParams(max_tokens=1, temperature=0)

        def prefill_once() -> float:
            start = time.perf_counter()
            llm.generate([ids], one)
            return time.perf_counter() - start

        report(
            f"prefill of {len(ids)} tokens",
            alternate(max(2, args.rounds // 2), prefill_once),
            "s",
            False,
        )


if __name__ == "__main__":
    main()
