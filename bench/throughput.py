"""Aggregate decode throughput: Convoy offline vs. transformers, side by side, in one run.

    python bench/throughput.py                 # both models, auto (quantized) + fp32 + bf16,
                                               # batches 1/4/16/64, 128 tokens
    python bench/throughput.py --quick         # smollm2, bf16, batches 1/16, 32 tokens (~1-2 min)
    python bench/throughput.py --models gemma3-270m --dtypes bfloat16 --batches 16,64

Per model x dtype x batch size B, every sequence generates exactly --tokens tokens (greedy, EOS
ignored) and the table reports all generated tokens / wall time for:
  convoy   `LLM(model, dtype).generate(prompts, SamplingParams(temperature=0, ignore_eos=True))`,
           --repeats runs, min/median/max shown (the machine is shared, so timings are noisy)
  1-at-a-time  transformers `generate` per prompt (text-generation-webui). It is strictly
           sequential, so per-prompt times are measured once per model x dtype and summed; above
           --seq-sample prompts, the mean of the first --seq-sample prompts is extrapolated (*)
  static   transformers `generate` on all B prompts left-padded into one batch, timed once
Both baselines load the HF folder Convoy converted from the GGUF (`worker.model_dir`): same weights
(dequantized; in fp32 for Convoy's dtype auto, whose linears run on the GGUF's quantized blocks).
All three paths get the same token ids. Prefix caching is off unless --prefix-cache, so repeated
Convoy runs recompute their prompts as the baselines do. "agree" = leading generated tokens of
prompt 0 that Convoy and one-at-a-time transformers have in common (of --tokens). "others' CPU" =
share of all CPUs used by other processes while this row was measured (from /proc/stat): on a
shared machine, read ratios from rows where it is low; --wait-idle N waits for a quiet machine.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from prompts import make_prompts

MODELS = ("smollm2-135m-instruct", "gemma3-270m")
DTYPES = ("auto", "float32", "bfloat16")  # auto: a GGUF runs quantized (int8 kernels)


class CpuMeter:
    """Share of the machine's CPU time used by other processes while we measure (contention)."""

    def __init__(self) -> None:
        self.busy = self.ours = 0.0
        self.total = 0.0

    @staticmethod
    def read() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
        return (sum(v) - v[3] - v[4]) / tick, sum(v) / tick, time.process_time()

    def __enter__(self) -> CpuMeter:
        self._start = self.read()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self.read()
        self.busy += end[0] - self._start[0]
        self.total += end[1] - self._start[1]
        self.ours += end[2] - self._start[2]

    def others(self) -> float | None:
        return None if self.total <= 0 else max(0.0, self.busy - self.ours) / self.total


@dataclass
class Row:
    model: str
    dtype: str
    batch: int
    convoy: list[float] = field(default_factory=list)  # tok/s per repeat
    seq: float | None = None
    seq_extrapolated: bool = False
    static: float | None = None
    agree: int | None = None
    meter: CpuMeter = field(default_factory=CpuMeter)


def wait_idle(max_wait: float, log) -> None:
    """Wait (at most max_wait s) until other processes use under a quarter of the CPUs."""
    deadline = time.monotonic() + max_wait
    while time.monotonic() < deadline:
        with CpuMeter() as m:
            time.sleep(2)
        if (m.others() or 0.0) < 0.25:
            return
    if max_wait > 0:
        log(f"  machine still busy after {max_wait:.0f}s; measuring anyway")


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


class HFBaselines:
    """transformers on the same converted folder: one prompt at a time, and a padded static batch."""

    def __init__(self, model_dir: str, dtype: torch.dtype, pad_id: int) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.pad_id = pad_id
        self.seq_times: dict[int, float] = {}  # prompt index -> seconds for --tokens tokens
        self.first_output: list[int] | None = None
        self.generate([[self.pad_id + 1] * 4] * 2, 4)  # warm-up: both paths' kernels

    @torch.inference_mode()
    def generate(self, batch: list[list[int]], tokens: int) -> torch.Tensor:
        width = max(len(ids) for ids in batch)
        ids = torch.tensor([[self.pad_id] * (width - len(x)) + x for x in batch])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch])
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=tokens,
            min_new_tokens=tokens, pad_token_id=self.pad_id, top_p=None, top_k=None,
        )  # fmt: skip
        assert out.shape[1] == width + tokens, out.shape
        return out[:, width:]

    def one_at_a_time(
        self, prompts: list[list[int]], tokens: int, sample: int
    ) -> tuple[float, bool]:
        """Seconds to run `prompts` sequentially (extrapolated above `sample` prompts)."""
        idx = range(len(prompts)) if len(prompts) <= sample else range(sample)
        for i in idx:
            if i not in self.seq_times:
                t0 = time.perf_counter()
                out = self.generate([prompts[i]], tokens)
                self.seq_times[i] = time.perf_counter() - t0
                if i == 0:
                    self.first_output = out[0].tolist()
        mean = statistics.fmean(self.seq_times[i] for i in idx)
        return mean * len(prompts), len(prompts) > sample

    def static_batch(self, prompts: list[list[int]], tokens: int) -> float:
        t0 = time.perf_counter()
        self.generate(prompts, tokens)
        return time.perf_counter() - t0


def bench_model_dtype(name: str, dtype: str, args: argparse.Namespace, log) -> list[Row]:
    from convoy import LLM, SamplingParams
    from convoy.models.resolve import ensure_hf_weights, resolve_model

    t0 = time.perf_counter()
    llm = LLM(
        model=name,
        dtype=dtype,
        enable_prefix_caching=args.prefix_cache,
        prepack_linears=not args.torch_path,
        cpu_kernels=not args.torch_path,
        quantization=args.quantization,
    )
    worker = llm.core.worker
    log(
        f"[{name} {dtype}] Convoy loaded in {time.perf_counter() - t0:.1f}s ({llm.model_path.name});"
        f" quantized linears: {worker.quantized_linears}, packed linears: {worker.packed_linears},"
        f" native decode attention: {worker.native_decode}"
    )
    tok = llm.tokenizer
    all_ids = [tok.encode(p) for p in make_prompts(max(args.batches))]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(all_ids[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))

    hf = None
    if not args.skip_baselines:
        pad = tok._tok.pad_token_id
        pad = pad if pad is not None else tok.eos_token_id
        t0 = time.perf_counter()
        hf_dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
        folder = ensure_hf_weights(resolve_model(name))  # a quantized load writes none
        hf = HFBaselines(str(folder), hf_dtype, pad)
        log(f"[{name} {dtype}] transformers loaded in {time.perf_counter() - t0:.1f}s")

    rows = []
    for b in args.batches:
        prompts = all_ids[:b]
        row = Row(name, dtype, b)
        first: list[int] = []
        for _ in range(args.repeats):
            wait_idle(args.wait_idle, log)
            t0 = time.perf_counter()
            with row.meter:
                outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            assert n == b * args.tokens, f"Convoy generated {n} tokens, expected {b * args.tokens}"
            row.convoy.append(n / dt)
            first = list(outs[0].outputs[0].token_ids)
        log(f"  B={b:<3} convoy  " + " ".join(f"{x:.1f}" for x in row.convoy) + " tok/s")
        if hf is not None:
            wait_idle(args.wait_idle, log)
            with row.meter:
                secs, row.seq_extrapolated = hf.one_at_a_time(prompts, args.tokens, args.seq_sample)
            row.seq = b * args.tokens / secs
            log(f"  B={b:<3} 1-at-a-time {row.seq:.1f} tok/s" + (" (*)" * row.seq_extrapolated))
            wait_idle(args.wait_idle, log)
            with row.meter:
                row.static = b * args.tokens / hf.static_batch(prompts, args.tokens)
            log(f"  B={b:<3} static  {row.static:.1f} tok/s")
            if hf.first_output is not None:
                pairs = enumerate(zip(first, hf.first_output, strict=True))
                row.agree = next((i for i, (a, c) in pairs if a != c), args.tokens)
        rows.append(row)
        log("  " + markdown([row], args).splitlines()[-1])
    del llm, hf
    gc.collect()
    log(f"  peak RSS so far {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    return rows


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    head = (
        "| model | dtype | B | convoy tok/s median (min-max) | 1-at-a-time tok/s | static tok/s "
        "| convoy / 1-at-a-time | convoy / static | agree | others' CPU |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        med = statistics.median(r.convoy)
        conv = f"{med:.1f} ({min(r.convoy):.1f}-{max(r.convoy):.1f})"
        seq = fmt(r.seq) + (" *" if r.seq_extrapolated else "")
        agree = "-" if r.agree is None else f"{r.agree}/{args.tokens}"
        lines.append(
            f"| {r.model} | {r.dtype} | {r.batch} | {conv} | {seq} | {fmt(r.static)} "
            f"| {ratio(med, r.seq)} | {ratio(med, r.static)} | {agree} "
            f"| {fmt(None if (o := r.meter.others()) is None else 100 * o, 0)}% |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="auto,float32,bfloat16")
    p.add_argument("--batches", default="1,4,16,64", help="sequences per run, comma-separated")
    p.add_argument("--tokens", type=int, default=128, help="generated tokens per sequence")
    p.add_argument("--repeats", type=int, default=3, help="Convoy runs per batch size")
    p.add_argument("--seq-sample", type=int, default=4, help="prompts timed one at a time, max")
    p.add_argument("--skip-baselines", action="store_true", help="Convoy only")
    p.add_argument("--prefix-cache", action="store_true", help="keep Convoy's prefix cache on")
    p.add_argument(
        "--torch-path",
        action="store_true",
        help="Convoy without its CPU kernels (plain torch linears and attention), for A/B runs",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "none", "gguf", "int8", "int4"),
        help="Convoy's quantization (auto: a GGUF's blocks kept in dtype auto, else none)",
    )
    p.add_argument("--wait-idle", type=float, default=0, help="wait up to N s for a quiet CPU")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--quick", action="store_true", help="smollm2, bfloat16, batches 1,16, 32 tok")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.dtypes, args.batches, args.tokens = MODELS[0], "bfloat16", "1,16", 32
    args.models = [m for m in args.models.split(",") if m]
    args.dtypes = [
        {"fp32": "float32", "bf16": "bfloat16"}.get(d, d) for d in args.dtypes.split(",")
    ]
    args.batches = [int(b) for b in args.batches.split(",")]
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad:
        p.error(f"unknown dtype(s) {bad}; choose from {DTYPES}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"{time.perf_counter() - start:7.1f}s {msg}", file=sys.stderr, flush=True)

    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.tokens} tokens/seq")
    rows: list[Row] = []
    for name in args.models:
        for dtype in args.dtypes:
            rows += bench_model_dtype(name, dtype, args, log)
    print()
    print(markdown(rows, args))
    print()
    notes = [
        f"{args.tokens} generated tokens per sequence, greedy, EOS ignored; tok/s = all sequences'",
        f"generated tokens / wall time; torch threads: {torch.get_num_threads()}; convoy: median",
        f"(min-max) of {args.repeats} runs, prefix cache {'on' if args.prefix_cache else 'off'};",
        "baselines: one run.",
    ]
    if any(r.seq_extrapolated for r in rows):
        notes.append(
            f"* one-at-a-time is sequential: mean time of the first {args.seq_sample} prompts "
            "(short to long) x B."
        )
    print(" ".join(notes[:4]) + ("\n" + notes[4] if len(notes) > 4 else ""))
    print(f"\nTotal wall time: {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
