"""Where a decode step's time goes: scheduler, input preparation, model forward (by op type),
sampling, output processing, for 1 and 64 concurrent sequences of the default model.

    .venv/bin/python bench/profile_step.py                           # fp32, default settings
    .venv/bin/python bench/profile_step.py --dtype float32 --kv-cache-dtype bfloat16
    .venv/bin/python bench/profile_step.py --quantization gguf --batches 1,16,64
    .venv/bin/python bench/profile_step.py --threads 1 --steps 40

Every phase is timed with perf_counter around the engine's own calls (the `EngineCore.step`
structure: schedule -> worker.execute [prepare, forward, compute_logits, sample] -> update ->
output processing). The model forward is split by op type from a torch.profiler run of a few extra
steps (self CPU time of each op, attributed to the innermost model part it runs under), scaled to
the un-profiled forward time. Prints a markdown table: median ms per decode step (min-max).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

PHASES = ("schedule", "prepare", "forward", "logits", "sample", "update", "output", "step")
FORWARD_KINDS = (
    "fused layers", "linears", "attention", "norms", "rotary", "activation", "other",
)  # fmt: skip

# Scopes of the model parts, by module class name (whichever of them exist in this tree).
_SCOPE_CLASSES = {
    "RMSNorm": "norms",
    "RotaryEmbedding": "rotary",
    "Attention": "attention",
    "Linear": "linears",
    "PackedLinear": "linears",
    "Bf16PackedLinear": "linears",
    "QuantLinear": "linears",
}
_SCOPE_PREFIX = "convoy_scope::"


def _op_kind(name: str) -> str | None:
    """The kind of an op by its own name, where it says it; else None (use the scope)."""
    n = name.lower()
    if "decode_layer" in n:  # a whole decoder layer in one call (csrc/decoder_layer.cpp)
        return "fused layers"
    if any(s in n for s in ("quant_linear", "bf16_linear", "mkldnn", "aten::linear", "addmm")):
        return "linears"
    if "decode_attention" in n or "scaled_dot_product" in n:
        return "attention"
    if "rms_norm" in n or "rmsnorm" in n:
        return "norms"
    if "rotary" in n or "rope" in n:
        return "rotary"
    if "and_mul" in n or "silu" in n or "gelu" in n:
        return "activation"
    return None


class Timers:
    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, obj: Any, attr: str, phase: str) -> None:
        fn: Callable[..., Any] = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.on:
                    self.acc[phase] += time.perf_counter() - t0

        setattr(obj, attr, timed)


def _instrument(llm: Any, timers: Timers) -> None:
    import convoy.worker.worker as worker_mod

    core = llm.core
    runner = core.worker.runner
    timers.wrap(core.scheduler, "schedule", "schedule")
    timers.wrap(core.scheduler, "update_from_output", "update")
    timers.wrap(core.output, "process", "output")
    timers.wrap(runner, "prepare", "prepare")
    timers.wrap(runner.model, "forward", "forward")  # an instance attribute: what __call__ runs
    timers.wrap(runner.model, "compute_logits", "logits")
    timers.wrap(worker_mod, "sample", "sample")
    timers.wrap(core, "step", "step")


def _scope_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    found = []
    for module in model.modules():
        kind = _SCOPE_CLASSES.get(type(module).__name__)
        if kind is not None:
            found.append((module, kind))
        act = getattr(module, "act", None)
        if act is not None and not isinstance(act, torch.nn.Module):
            found.append((module, "activation:act"))
    return found


def _add_scopes(model: torch.nn.Module) -> Callable[[], None]:
    """Wrap each model part's forward in a profiler label; returns the undo."""
    undo: list[Callable[[], None]] = []
    for module, kind in _scope_modules(model):
        if kind == "activation:act":
            act = module.act  # type: ignore[attr-defined]

            def scoped_act(x: torch.Tensor, _act: Any = act) -> Any:
                with torch.profiler.record_function(_SCOPE_PREFIX + "activation"):
                    return _act(x)

            module.act = scoped_act  # type: ignore[attr-defined]
            undo.append(lambda m=module, a=act: setattr(m, "act", a))
            continue
        fwd = module.forward

        def scoped(*args: Any, _fwd: Any = fwd, _kind: str = kind, **kwargs: Any) -> Any:
            with torch.profiler.record_function(_SCOPE_PREFIX + _kind):
                return _fwd(*args, **kwargs)

        module.forward = scoped  # type: ignore[method-assign]
        undo.append(lambda m=module: m.__dict__.pop("forward", None))

    def restore() -> None:
        for u in undo:
            u()

    return restore


def _forward_breakdown(prof: Any) -> dict[str, float]:
    """Self CPU time (us) of every op under the `forward` scope, by kind."""
    out: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.name.startswith(_SCOPE_PREFIX) or ev.name == "convoy_forward":
            continue
        kind = _op_kind(ev.name)
        parent = ev.cpu_parent
        in_forward = False
        scope = None
        while parent is not None:
            if parent.name == "convoy_forward":
                in_forward = True
                break
            if scope is None and parent.name.startswith(_SCOPE_PREFIX):
                scope = parent.name[len(_SCOPE_PREFIX) :]
            parent = parent.cpu_parent
        if not in_forward:
            continue
        if kind is None:
            kind = scope or "other"
        out[kind] += ev.self_cpu_time_total
    return out


def _run_batch(llm: Any, timers: Timers, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    from convoy import SamplingParams

    core = llm.core
    prompt_ids = llm.tokenizer.encode("Write a long story about a ship at sea.")
    total_steps = args.warmup + args.steps + args.profile_steps
    params = SamplingParams(temperature=0.0, max_tokens=total_steps + 4, ignore_eos=True)
    for i in range(batch):
        # distinct prompts (no prefix-cache sharing beyond the common text)
        ids = [*prompt_ids, 100 + i]
        llm.frontend.add(llm.frontend.inputs.process(ids, params, f"prof-{batch}-{i}", None),
                         lambda _out: None)  # fmt: skip
    # prefill: step until every sequence has a sampled token
    while (
        any(r.num_output_tokens == 0 for r in core.scheduler.running) or core.scheduler.num_waiting
    ):
        llm.frontend.step()
    for _ in range(args.warmup):
        llm.frontend.step()
    per_step: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.steps):
        timers.acc.clear()
        timers.on = True
        llm.frontend.step()
        timers.on = False
        for phase in PHASES:
            per_step[phase].append(timers.acc.get(phase, 0.0) * 1e3)
    # profiled steps: the forward's op breakdown
    model = core.worker.runner.model
    restore = _add_scopes(model)
    forward = model.forward

    def labelled(*a: Any, **k: Any) -> Any:
        with torch.profiler.record_function("convoy_forward"):
            return forward(*a, **k)

    model.forward = labelled
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.profile_steps):
                llm.frontend.step()
    finally:
        model.forward = forward
        restore()
    kinds = _forward_breakdown(prof)
    # drain the rest
    core.abort_requests([r.req_id for r in list(core.scheduler.running)])
    while llm.frontend.has_work():
        llm.frontend.step()
    return {"steps": per_step, "kinds": kinds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-dtype", default=None, help="auto, float32, bfloat16, float16")
    p.add_argument("--quantization", default=None, help="auto, none, gguf, int8, int4")
    p.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE",
        help="any other engine setting (true/false/ints parsed), e.g. --set block_size=32",
    )  # fmt: skip
    p.add_argument("--no-cpu-kernels", action="store_true", help="the torch path")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per batch")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    from convoy import LLM

    kwargs: dict[str, Any] = {
        "dtype": args.dtype,
        "cpu_kernels": not args.no_cpu_kernels,
        "max_num_seqs": 256,
    }
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization
    if args.kv_cache_dtype is not None:
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    for item in args.set:
        name, _, value = item.partition("=")
        parsed: Any = {"true": True, "false": False}.get(value.lower(), value)
        kwargs[name] = int(value) if value.isdigit() else parsed
    llm = LLM(args.model, **kwargs)
    timers = Timers()
    _instrument(llm, timers)
    print(f"# profile_step: {' '.join(sys.argv[1:]) or '(defaults)'}; threads "
          f"{torch.get_num_threads()}; {os.cpu_count()} CPUs", flush=True)  # fmt: skip
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        print(f"batch {batch}...", file=sys.stderr, flush=True)
        rows.append((batch, _run_batch(llm, timers, batch, args)))
    print()
    print("| phase (ms/step, median (min-max)) | " + " | ".join(f"B={b}" for b, _ in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for phase in PHASES:
        cells = []
        for _, r in rows:
            v = r["steps"][phase]
            cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})")
        print(f"| {phase} | " + " | ".join(cells) + " |")
    print()
    print("| forward by op type (ms/step, profiler shares x median forward) | "
          + " | ".join(f"B={b}" for b, _ in rows) + " |")  # fmt: skip
    print("|---|" + "---|" * len(rows))
    for kind in FORWARD_KINDS:
        cells = []
        for _, r in rows:
            total = sum(r["kinds"].values()) or 1.0
            fwd = statistics.median(r["steps"]["forward"])
            share = r["kinds"].get(kind, 0.0) / total
            cells.append(f"{share * fwd:.2f} ({share:.0%})")
        print(f"| {kind} | " + " | ".join(cells) + " |")
    print()
    print("step = the whole EngineCore step (frontend routing excluded); logits = compute_logits")


if __name__ == "__main__":
    main()
