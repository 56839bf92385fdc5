"""What one activation scale per 256 weights would cost in accuracy, against today's one per 32.

The quantized kernels (csrc/quant_linear.cpp) quantize each activation row to int8 in blocks of
32 (scale amax / 127) and scale every block's integer dot in fp32. Integer sums across a whole
superblock (one activation scale per 256, as llama.cpp's Q8_K against Q4_K / Q6_K) would save
most of the per-block float steps (bench/README.md, "The int8 peak by instruction set"), but they
change the numerics. This measures that change on the shipped models, in simulation: the exact
mode (the GGUF dequantized, fp32 linears) with each linear's input rounded to int8 in blocks of
32 or of 256 before the product (round half to even, as the kernels), against no rounding. The
blocks-of-32 row reproduces what the quantized default's activations do (its weights are the
same dequantized values), so the step from it to 256 is what the change would add.

    .venv/bin/python bench/act_blocks.py                        # smollm2 and gemma3-270m

Per model and setting: perplexity of a fixed set of prose passages (the project's own docs),
mean |log-probability difference| per token and top-1 agreement of every position's argmax,
both against the unrounded exact mode. Two settings of 256: only linears whose input width is a
multiple of 256 (the others keep 32; the superblock kinds need K % 256 == 0 anyway), and every
linear (a row's last block shorter): the shipped models' hidden widths (576, 640) are not
multiples of 256, so the first touches only their down (and Gemma's o) projections, while a
Llama-3-shaped Q4_K_M file would round every linear's input per 256, as the second does.
Opt-in, never in CI; figures in bench/README.md.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import torch

from convoy import LLM, SamplingParams
from convoy.kernels.packed_linear import Fp32KernelLinear

ROOT = Path(__file__).resolve().parent.parent


def passages(count: int, words: int) -> list[str]:
    """Paragraphs of the project's docs, joined into `count` passages of ~`words` words."""
    text = (ROOT / "docs" / "architecture.md").read_text() + (ROOT / "README.md").read_text()
    paras = [p for p in re.split(r"\n\s*\n", text) if p[:1].isalpha() and len(p.split()) > 20]
    out, cur = [], []
    for p in paras:
        cur.append(" ".join(p.split()))
        if sum(len(c.split()) for c in cur) >= words:
            out.append("\n\n".join(cur))
            cur = []
        if len(out) == count:
            break
    return out


def fake_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    """x rounded to int8 in blocks of |block| (0: unrounded). A negative block: every linear, the
    last block of a row that |block| does not divide shorter; a positive one falls back to 32."""
    k = x.shape[-1]
    if block == 0:
        return x
    if block > 0 and k % block:
        block = 32
    block = abs(block)
    pad = -k % block
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    xb = xp.reshape(*x.shape[:-1], (k + pad) // block, block)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.round(xb / torch.where(d > 0, d, torch.ones_like(d)))
    return (q * d).reshape(xp.shape)[..., :k]


BLOCK = 0
LABELS = {
    0: "fp32 (exact)",
    32: "int8, a scale per 32",
    256: "int8, a scale per 256 where K % 256 = 0",
    -256: "int8, a scale per 256 in every linear",
}
_orig = Fp32KernelLinear._linear_2d


def _rounded(self: Fp32KernelLinear, x: torch.Tensor) -> torch.Tensor:
    return _orig(self, fake_quant(x, BLOCK))


def score(llm: LLM, texts: list[str]) -> Scores:
    """Per passage: each position's log-probability of the text's token and its argmax token."""
    outs = llm.generate(texts, SamplingParams(max_tokens=0, prompt_logprobs=1))
    res = []
    for o in outs:
        assert o.prompt_logprobs is not None
        lps, tops = [], []
        for pos, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True):
            assert pos
            lps.append(pos[t])
            tops.append(max(pos, key=lambda tok: pos[tok]))
        res.append((lps, tops))
    return res


Scores = list[tuple[list[float], list[int]]]


def row(name: str, label: str, res: Scores, base: Scores | None) -> str:
    lps = [v for r in res for v in r[0]]
    ppl = math.exp(-sum(lps) / len(lps))
    if base is None:
        return f"| {name} | {label} | {ppl:.4f} | - | - ({len(lps)} tokens) |"
    pairs = list(zip(res, base, strict=True))
    diff = [abs(x - y) for r, b in pairs for x, y in zip(r[0], b[0], strict=True)]
    agree = [x == y for r, b in pairs for x, y in zip(r[1], b[1], strict=True)]
    return (
        f"| {name} | {label} | {ppl:.4f} | {sum(diff) / len(diff):.4f} "
        f"| {100 * sum(agree) / len(agree):.2f}% |"
    )


def main() -> None:
    global BLOCK
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="smollm2,gemma3-270m")
    p.add_argument("--passages", type=int, default=8)
    p.add_argument("--words", type=int, default=300)
    a = p.parse_args()
    texts = passages(a.passages, a.words)
    Fp32KernelLinear._linear_2d = _rounded  # type: ignore[method-assign]
    print("| model | activations | perplexity | mean abs logprob diff | top-1 agreement |")
    print("|---|---|---|---|---|")
    for name in a.models.split(","):
        llm = LLM(model=name, dtype="float32", enable_prefix_caching=False)
        base = None
        for block in (0, 32, 256, -256):
            BLOCK = block
            res = score(llm, texts)
            print(row(name, LABELS[block], res, base), flush=True)
            if base is None:
                base = res
        del llm
        # the quantized default itself (its kernels' int8 activations in blocks of 32)
        res = score(LLM(model=name, enable_prefix_caching=False), texts)
        print(row(name, "the quantized default's kernels", res, base), flush=True)


if __name__ == "__main__":
    main()
