"""Speculative decoding in one process: where a step's time goes, with and without drafts.

    python bench/spec_offline.py                      # 64 edit requests: off, auto, off, auto
    python bench/spec_offline.py --modes off,ngram --requests 16

`LLM.generate` of --requests edit requests of bench/spec.py (each with its `prediction`) on the
default model, once per mode in --modes, the engine's parts timed (scheduling, drafting, the
model's step, folding the results in, the output processor), then the step costs the engine
learnt (rows and ms a step by power-of-two row bucket). Opt-in, never in CI; figures in
bench/README.md ("Speculative decoding").
"""

from __future__ import annotations

import argparse
import time

from convoy import LLM, SamplingParams
from profile_step import Timers
from spec import edit_requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="off,auto,off,auto")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--files", type=int, default=10, help="code pieces, cycled")
    parser.add_argument("--step-target-ms", type=float, default=None, help="default: LLM's")
    args = parser.parse_args()
    llm = LLM() if args.step_target_ms is None else LLM(step_target_ms=args.step_target_ms)
    tok = llm.tokenizer
    reqs = (edit_requests(args.files, 0) * (-(-args.requests // args.files)))[: args.requests]
    prompts = [tok.apply_chat_template(r.messages) for r in reqs]
    core = llm.core
    sch = core.scheduler
    timers = Timers()  # (profile_step.py's: a method wrapped to add its seconds to a phase)
    for obj, name in [(sch, "schedule"), (sch.drafts, "add_drafts"), (core.worker, "execute"),
                      (sch, "update_from_output"), (core, "_process_outputs")]:  # fmt: skip
        timers.wrap(obj, name, name)
    timers.on = True
    for mode in args.modes.split(","):
        sch.drafts.mode = mode
        params = [
            SamplingParams(temperature=0, max_tokens=r.max_tokens,
                           prediction=tok.encode(r.prediction or "", add_special_tokens=False))
            for r in reqs
        ]  # fmt: skip
        timers.acc.clear()
        kept0 = sch.drafts.num_accepted_draft_tokens
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        split = " ".join(f"{k} {v:.1f} s" for k, v in timers.acc.items())
        print(f"{mode}: {tokens / wall:.1f} tokens/s, {wall:.1f} s, kept drafts "
              f"{sch.drafts.num_accepted_draft_tokens - kept0} | {split}", flush=True)  # fmt: skip
        costs = sch.step_costs
        learnt = {b: f"{costs.rows[b]:.0f} rows {costs.seconds[b] * 1e3:.0f} ms" for b in sorted(costs.seconds)}
        print(f"  step costs: {learnt}", flush=True)


if __name__ == "__main__":
    main()
