"""Peak memory of scoring a long prompt (`echo` + `logprobs`, i.e. prompt logprobs).

    python bench/prompt_logprobs_memory.py                          # Gemma 3 (262k vocabulary)
    python bench/prompt_logprobs_memory.py --model smollm2-135m-instruct --tokens 1000

A fresh subprocess loads the model, runs one short warm-up request, reads VmRSS, then scores a
prompt of --tokens tokens in one step (max_num_batched_tokens = tokens + 1) with prompt_logprobs=1
and max_tokens=1, and reads VmHWM (the peak). growth = peak - before: what the scoring step
materialised (logits, log-softmax, activations). Unsliced, the logits of the whole chunk are
tokens x vocab fp32 (2,000 x 262,144 x 4 B = 2.1 GB for Gemma), twice with the log-softmax.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

MB = 1 << 20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(model: str, num_tokens: int) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    from convoy import LLM, SamplingParams

    llm = LLM(model=model, max_num_batched_tokens=num_tokens + 1, enable_prefix_caching=False)
    words = " ".join(f"word{i % 97} and" for i in range(num_tokens))
    ids = llm.tokenizer.encode(words)[:num_tokens]
    llm.generate([ids[:64]], SamplingParams(max_tokens=1, prompt_logprobs=1))  # warm-up
    before = _status("VmRSS")
    start = time.perf_counter()
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    seconds = time.perf_counter() - start
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == num_tokens
    row = {"before": before, "peak": _status("VmHWM"), "seconds": seconds}
    print(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, args.tokens)
        return
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--tokens", str(args.tokens)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    print(f"{'model':<24} {'tokens':>6} {'RSS before':>11} {'peak':>9} {'growth':>9} {'time':>7}")
    print(
        f"{args.model:<24} {args.tokens:>6} {row['before'] / MB:>8.0f} MB "
        f"{row['peak'] / MB:>6.0f} MB {(row['peak'] - row['before']) / MB:>6.0f} MB "
        f"{row['seconds']:>6.2f}s"
    )


if __name__ == "__main__":
    main()
