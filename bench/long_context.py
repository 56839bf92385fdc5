"""Many streams at long contexts, in one process: where attention is the larger part of a step.

    python bench/long_context.py                        # 64 streams, ~1,100-token prompts
    PYTHONPATH=<other tree>/src python bench/long_context.py   # the same for another tree
    python bench/long_context.py --prefill 3000         # one prompt's prefill, 3 of them timed

`LLM.generate` (default model and settings, `--speculative off`) of --streams of spec.py's
quote prompts (~1,000 tokens of docs/architecture.md each), --tokens greedy tokens each with EOS
ignored; prints the wall time and the median time of the model's step (`worker.execute`) over
the last 40 steps, when every sequence decodes at ~1,100-1,150 tokens of context. Compare trees
in one sitting, alternating (this VM drifts ~20% between runs). --prefill N: instead, the mean
time of three prompts of N tokens of docs/architecture.md (offsets 500 apart, prefix cache off),
one at a time, one output token each. Opt-in, never in CI; figures in bench/README.md ("Decode
attention").
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from convoy import LLM, SamplingParams
from spec import quote_requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="default: LLM's")
    parser.add_argument("--prefill", type=int, default=0, help="time prompts of N tokens instead")
    args = parser.parse_args()
    if args.prefill:
        prefill(args.model, args.prefill)
        return
    llm = LLM(args.model, speculative="off")
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template(r.messages) for r in quote_requests(args.streams, 0)]
    core = llm.core
    times: list[float] = []
    execute = core.worker.execute

    def timed(*a: object, **k: object) -> object:
        t = time.perf_counter()
        out = execute(*a, **k)
        times.append(time.perf_counter() - t)
        return out

    core.worker.execute = timed  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, [params] * len(prompts))
    wall = time.perf_counter() - t
    ctx = statistics.mean(len(o.prompt_token_ids) for o in outs)
    last = times[-min(40, args.tokens // 2) :]
    print(
        f"{args.streams} streams, prompts of {ctx:.0f} tokens on average, {args.tokens} tokens"
        f" each: {wall:.1f} s; a decode step at the end {statistics.median(last) * 1e3:.1f} ms"
        f" (median of the last {len(last)})"
    )


def prefill(model: str | None, n: int) -> None:
    llm = LLM(model, speculative="off", enable_prefix_caching=False)
    ids = llm.tokenizer.encode(
        (Path(__file__).parents[1] / "docs" / "architecture.md").read_text(),
        add_special_tokens=False,
    )
    prompts = [ids[i * 500 : i * 500 + n] for i in range(3)]
    llm.generate([ids[:100]], SamplingParams(max_tokens=1))  # warm-up
    t = time.perf_counter()
    for p in prompts:
        llm.generate([p], SamplingParams(max_tokens=1))
    dt = (time.perf_counter() - t) / len(prompts)
    print(f"prefill of {len(prompts[-1])} tokens: {dt:.2f} s ({len(prompts[-1]) / dt:.0f} tokens/s)")


if __name__ == "__main__":
    main()
