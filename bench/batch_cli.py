"""`convoy batch` against the same requests sent concurrently over HTTP to `convoy serve`.

    python bench/batch_cli.py                      # 1,000 lines x 32 tokens, smollm2 fp32
    python bench/batch_cli.py --lines 100 --tokens 16 --repeats 2

Each repeat, on fresh prompts (a run tag in front, so the prefix cache never serves a repeat;
greedy, EOS ignored, so every line generates exactly --tokens tokens):
  convoy batch    a JSONL file of --lines /v1/completions lines through `convoy batch` in a
                  subprocess: "lines" is the time the command itself reports for running them,
                  "process" the whole command (model load included)
  HTTP            the same --lines requests, one prompt each, all in flight at once against one
                  `convoy serve` (started once, before the repeats; its start time is reported)
Both use the same engine defaults (--max-num-seqs 256; `convoy batch` keeps 2 x that many lines in
flight, as the Batch API does). Prints min/median/max over --repeats and the ratio of medians.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batch_api import _lines
from serve import ServerProcess, concurrent_requests, make_prompts_tagged


def run_batch_cli(args: argparse.Namespace, folder: Path, tag: str) -> tuple[float, float, int]:
    """(seconds running the lines, seconds of the whole command, tokens generated)."""
    inp, out = folder / f"{tag}.jsonl", folder / f"{tag}.out.jsonl"
    inp.write_bytes(_lines(make_prompts_tagged(args.lines, tag), args.tokens, args.model))
    cmd = [
        sys.executable, "-m", "convoy.cli", "batch", "-i", str(inp), "-o", str(out), args.model,
        "--dtype", args.dtype, "--device", args.device, "--log-level", "warning",
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    process_s = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"convoy batch exited {done.returncode}:\n{done.stderr[-3000:]}")
    match = re.search(r"in ([0-9.]+) s,", done.stderr)
    assert match is not None, done.stderr[-2000:]
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(answers) == args.lines, len(answers)
    assert all(a["response"]["status_code"] == 200 for a in answers)
    tokens = sum(a["response"]["body"]["usage"]["completion_tokens"] for a in answers)
    return float(match.group(1)), process_s, tokens


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    expected = args.lines * args.tokens

    batch_lines: list[float] = []
    batch_process: list[float] = []
    with tempfile.TemporaryDirectory(prefix="convoy-batch-cli-") as folder:
        for r in range(args.repeats):
            lines_s, process_s, tokens = run_batch_cli(args, Path(folder), f"batch-{r}")
            assert tokens == expected, tokens
            batch_lines.append(lines_s)
            batch_process.append(process_s)
            print(f"  convoy batch repeat {r}: {expected / lines_s:.1f} tok/s", file=sys.stderr)

    http_s: list[float] = []
    start = time.perf_counter()
    server = ServerProcess(args)
    try:
        server.wait_healthy()
        start_s = time.perf_counter() - start
        concurrent_requests(args, server.url, make_prompts_tagged(2, "warm-up"))
        for r in range(args.repeats):
            prompts = make_prompts_tagged(args.lines, f"http-{r}")
            begin = time.perf_counter()
            tokens = concurrent_requests(args, server.url, prompts)
            http_s.append(time.perf_counter() - begin)
            assert tokens == expected, tokens
            print(f"  HTTP repeat {r}: {expected / http_s[-1]:.1f} tok/s", file=sys.stderr)
    finally:
        server.stop()

    http_rate = statistics.median(expected / s for s in http_s)
    print(
        f"\n{args.model} {args.dtype} on {args.device}: {args.lines} lines x {args.tokens} tokens,"
        f" {args.repeats} repeats; min / median / max\n"
    )
    print("| path | wall s | generated tok/s | tok/s vs HTTP |")
    print("|---|---|---|---|")
    rows = [
        ("convoy batch: lines", batch_lines),
        ("convoy batch: whole command", batch_process),
        ("HTTP: concurrent requests", http_s),
    ]
    for name, times in rows:
        rates = [expected / s for s in times]
        ratio = statistics.median(rates) / http_rate
        print(f"| {name} | {spread(times)} | {spread(rates)} | {ratio:.2f}x |")
    print(f"| HTTP: server start (model load) | {start_s:.1f} | | |")


if __name__ == "__main__":
    main()
