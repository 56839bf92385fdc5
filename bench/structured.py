"""Structured outputs: validity over the 50-schema suite, and what constraints cost, in one run.

    .venv/bin/python bench/structured.py                       # both models, 3 repeats
    .venv/bin/python bench/structured.py --models smollm2-135m-instruct --repeats 1

Per model (offline `LLM`, greedy, prefix cache off so repeats recompute their prompts):
  suite        the 50 schemas of tests/structured_schemas.py, one request each, all at once,
               max_tokens 200: outputs that stop and validate (jsonschema), and the share cut by
               max_tokens (an unfinished JSON text, as OpenAI documents)
  16 free      16 unconstrained sequences (EOS ignored, --tokens tokens each) alone
  + 16 free    the same 16 with 16 unconstrained neighbours (also --tokens tokens)
  + 16 json    the same 16 with 16 constrained neighbours (an array of one suite object after
               another: they run the whole --tokens); the goal is >= 0.9x of "+ 16 free" (same
               batch size; against "16 free" alone the doubled batch costs what it costs)
  16 json      16 constrained sequences (suite objects) alone, against
  16 free, same lengths   16 unconstrained ones of the same lengths (EOS ignored)
  mask fill    ms a step to fill 16 rows' bitmasks (the suite's first 16 outputs replayed),
               and ms a step to apply them in the sampler (16 x V logits)
Throughput is the 16 measured sequences' tokens / wall time; min/median/max over --repeats (the
machine is shared, so timings are noisy); ratios are medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

from convoy import LLM, RequestOutput, SamplingParams
from convoy.structured.matcher import fill_bitmasks
from convoy.structured.params import StructuredOutputsParams
from convoy.worker.batch import SamplerRow
from convoy.worker.sampler import sample

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tests

from tests.engine.conftest import prompts16  # noqa: E402
from tests.structured_schemas import make_schemas  # noqa: E402

MODELS = ("smollm2-135m-instruct", "gemma3-270m")
FORMATS = jsonschema.FormatChecker(formats=["date", "email", "uuid", "ipv4"])


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def chat(llm: LLM, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def json_params(schema: dict[str, Any], max_tokens: int) -> SamplingParams:
    spec = StructuredOutputsParams(json=schema)
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)


def run_suite(llm: LLM) -> tuple[list[RequestOutput], str]:
    suite = make_schemas(50)
    start = time.perf_counter()
    outs = llm.generate([chat(llm, p) for p, _ in suite], [json_params(s, 200) for _, s in suite])
    wall = time.perf_counter() - start
    valid = cut = invalid = 0
    for (_, schema), out in zip(suite, outs, strict=True):
        c = out.outputs[0]
        if str(c.finish_reason) == "length":
            cut += 1
            continue
        try:
            jsonschema.validate(json.loads(c.text), schema, format_checker=FORMATS)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            invalid += 1
            log(f"  INVALID: {c.text[:120]!r}: {str(e)[:120]}")
    stopped = valid + invalid
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return outs, (
        f"{valid}/{stopped} stopped outputs valid ({100 * valid / max(stopped, 1):.0f}%), "
        f"{cut}/50 cut by max_tokens ({100 * cut / 50:.0f}%); {tokens} tokens in {wall:.1f} s"
    )


def timed(llm: LLM, prompts: list[str], params: list[SamplingParams], repeats: int) -> list[float]:
    """Seconds per run of the whole batch."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
    return times


def throughput(llm: LLM, tokens: int, repeats: int) -> list[tuple[str, list[float]]]:
    """Rows of (label, tok/s of the 16 measured sequences per repeat)."""
    free = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    suite = make_schemas(16, small=True)
    measured = prompts16()
    neighbours = [chat(llm, f"{p} Give a list of 32 of them.") for p, _ in suite]
    arrays = [{"type": "array", "items": s, "minItems": 32, "maxItems": 32} for _, s in suite]
    constrained = [json_params(a, tokens) for a in arrays]
    n = 16 * tokens
    rows = [
        ("16 free alone", timed(llm, measured, [free] * 16, repeats)),
        ("16 free + 16 free", timed(llm, measured + neighbours, [free] * 32, repeats)),
        (
            "16 free + 16 json",
            timed(llm, measured + neighbours, [free] * 16 + constrained, repeats),
        ),
    ]
    single = [json_params(s, 200) for _, s in suite]
    lengths = [len(o.outputs[0].token_ids) for o in llm.generate(neighbours[:16], single)]
    same = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths]
    rows.append(("16 json alone", timed(llm, neighbours, single, repeats)))
    rows.append(("16 free, same lengths", timed(llm, neighbours, same, repeats)))
    out = [(label, [n / t for t in times]) for label, times in rows[:3]]
    num = sum(lengths)
    return out + [(label, [num / t for t in times]) for label, times in rows[3:]]


def mask_costs(llm: LLM, outs: list[RequestOutput]) -> str:
    """Mean ms a step to fill 16 rows (replaying the suite's outputs) and to apply them."""
    compiler = llm.core.grammars
    suite = make_schemas(16)
    matchers = [compiler.compile(StructuredOutputsParams(json=s)).matcher("x") for _, s in suite]
    token_ids = [o.outputs[0].token_ids for o in outs[:16]]
    fills: list[float] = []
    for step in range(max(len(t) for t in token_ids)):
        live = [(m, t[step]) for m, t in zip(matchers, token_ids, strict=True) if step < len(t)]
        start = time.perf_counter()
        masks = fill_bitmasks([m for m, _ in live], compiler.num_words)
        fills.append((time.perf_counter() - start) * 1e3 * 16 / len(live))
        for m, token in live:
            m.accept(token)
    vocab = llm.core.vocab_size
    logits = torch.randn(16, vocab)
    masks = fill_bitmasks([compiler.compile(StructuredOutputsParams(json=s)).matcher("x")
                           for _, s in suite], compiler.num_words)  # fmt: skip
    plain = [SamplerRow(SamplingParams(temperature=0), None, [], [], [], False) for _ in range(16)]
    masked = [SamplerRow(SamplingParams(temperature=0), None, [], [], [], False, m) for m in masks]
    apply = [timed_sample(logits, masked) - timed_sample(logits, plain) for _ in range(20)]
    return (
        f"fill {statistics.mean(fills):.3f} ms/step (max {max(fills):.2f}) for 16 rows, "
        f"apply {statistics.median(apply):.2f} ms/step (V = {vocab})"
    )


def timed_sample(logits: torch.Tensor, rows: list[SamplerRow]) -> float:
    start = time.perf_counter()
    sample(logits, rows)
    return (time.perf_counter() - start) * 1e3


def fmt(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:7.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per measured sequence")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for model in args.models.split(","):
        log(f"{model}: loading")
        llm = LLM(model, dtype=args.dtype, enable_prefix_caching=False)
        log(f"{model}: 50-schema suite")
        outs, suite = run_suite(llm)
        log(f"{model}: throughput")
        rows = throughput(llm, args.tokens, args.repeats)
        costs = mask_costs(llm, outs)
        medians = {label: statistics.median(v) for label, v in rows}
        print(f"\n## {model} ({args.dtype}, {args.tokens} tokens, {args.repeats} repeats)\n")
        print(f"suite: {suite}\n\nmask: {costs}\n")
        print("| sequences measured (16) | tok/s median (min-max) |\n|---|---|")
        for label, values in rows:
            print(f"| {label} | {fmt(values)} |")
        with_json = medians["16 free + 16 json"]
        print(
            f"\n16 free with 16 json neighbours: {with_json / medians['16 free + 16 free']:.2f}x"
            f" of with 16 free neighbours, {with_json / medians['16 free alone']:.2f}x of alone;"
            f" json / free at the same lengths:"
            f" {medians['16 json alone'] / medians['16 free, same lengths']:.2f}x"
        )


if __name__ == "__main__":
    main()
