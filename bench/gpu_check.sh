#!/usr/bin/env bash
# The CUDA check, in one command on a machine with an NVIDIA GPU:  bash bench/gpu_check.sh
# Installs nothing beyond `make install-test`; runs the tests marked gpu (engine and server on
# CUDA, tests/engine/test_gpu.py and tests/e2e/test_gpu.py), then a short throughput figure.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s install-test
PY=.venv/bin/python
$PY -c 'import torch; assert torch.cuda.is_available(), f"torch {torch.__version__}: no CUDA device (a CPU-only torch wheel?)"; print("torch", torch.__version__, "on", torch.cuda.get_device_name())'
$PY -m pytest -m gpu -q -rs tests/engine/test_gpu.py tests/e2e/test_gpu.py
$PY - <<'PY'
"""Decode throughput on CUDA: 64 prompts x 128 tokens, greedy and seeded sampling, 3 runs each."""
import statistics, time
from convoy import LLM, SamplingParams
llm = LLM(device="cuda", enable_prefix_caching=False)  # dtype auto: bfloat16 on CUDA
prompts = [f"Write a short story about the number {i}." for i in range(64)]
modes = {"greedy": SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
         "sampled": SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=128, ignore_eos=True)}
llm.generate(prompts[:4], modes["greedy"])  # warm-up
print(f"{'mode':<8} {'seqs':>4} {'tokens':>6}   tok/s min / median / max")
for name, params in modes.items():
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    print(f"{name:<8} {len(prompts):>4} {params.max_tokens:>6}   {min(rates):.0f} / {statistics.median(rates):.0f} / {max(rates):.0f}")
PY
