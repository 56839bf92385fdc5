"""Two-part panel layouts against the 8-bit kind, whole model, in one process: the GGUF loaded
twice, once as today (a fused linear whose parts no narrow kind holds together, e.g. Q4_K_M's
Q4_K q/k beside a Q6_K v, keeps each run of parts in its own kind) and once with such linears
packed in the one 8-bit kind that holds all (kQ8M: what Convoy did before), then greedy decode
runs alternating between the two (the order flips each round, so the machine's drift hits both
alike). Prints tokens/s per run, the medians and the median of the per-round ratios.

    .venv/bin/python bench/layout_ab.py ~/.cache/convoy/synth/llama-3b.q4_k_m.gguf --rounds 12
    .venv/bin/python bench/layout_ab.py FILE --batch 16 --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

import convoy.kernels.linear as linear
from convoy import LLM, SamplingParams


def eight_bit_layout(parts: Sequence[tuple[int, torch.Tensor]]) -> tuple[int, list[int]]:
    kind = linear.panel_kind([q for q, _ in parts])
    return kind, [kind] * len(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", help="a GGUF file")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--batch", type=int, default=1, help="sequences per run")
    p.add_argument("--tokens", type=int, default=48, help="generated tokens per sequence")
    args = p.parse_args()
    two_part = linear.panel_layout
    llms: dict[str, LLM] = {}
    try:
        for name, layout in (("8-bit", eight_bit_layout), ("two-part", two_part)):
            linear.panel_layout = layout  # type: ignore[assignment]
            llms[name] = LLM(model=args.model, enable_prefix_caching=False, speculative="off",
                             kv_cache_memory=256 << 20)  # fmt: skip
    finally:
        linear.panel_layout = two_part  # type: ignore[assignment]
    for name, llm in llms.items():
        kinds = {m.kind for m in llm.core.worker.model.modules()
                 if isinstance(m, linear.QuantLinear)}  # fmt: skip
        print(name, sorted(kinds), flush=True)
    prompts = [f"Tell me story number {i}." for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for llm in llms.values():
        llm.generate(prompts, params)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for r in range(args.rounds):
        order = list(llms.items()) if r % 2 == 0 else list(reversed(llms.items()))
        for name, llm in order:
            start = time.perf_counter()
            out = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in out) / elapsed)
    for name, values in rates.items():
        print(f"{name}: median {statistics.median(values):.2f} tok/s;",
              " ".join(f"{v:.1f}" for v in values))  # fmt: skip
    ratios = [a / b for a, b in zip(rates["two-part"], rates["8-bit"], strict=True)]
    medians = statistics.median(rates["two-part"]) / statistics.median(rates["8-bit"])
    print(f"two-part / 8-bit: medians {medians:.3f}, per round {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
