"""Serving throughput through HTTP: what batching buys a client, side by side, in one run.

    python bench/serve.py                       # smollm2, fp32, 16 prompts x 32 tokens, 3 repeats
    python bench/serve.py --tokens 64 --repeats 5 --dtype bfloat16

Starts `convoy serve` on a free 127.0.0.1 port and times, for the same P prompts (greedy, EOS
ignored, so every prompt generates exactly --tokens tokens):
  one request     one /v1/completions request whose `prompt` is the list of P prompts
  sequential      the P prompts sent one after another, each waiting for the previous answer
                  (what a client without batching, or text-generation-webui's API, gets)
  concurrent      P requests of one prompt each, all in flight at once
  offline         `LLM.generate(prompts)` in this process's main thread, after the server stopped
  offline thread  the same, called from a worker thread, as the server's engine loop runs
                  (on a busy machine torch's OpenMP threads can make the main thread far slower)
Every repeat uses fresh prompts (a run tag in front), so the prefix cache never serves a repeat.
Throughput is generated tokens / wall time; min/median/max over --repeats (the machine is shared,
so timings are noisy); ratios are medians against the sequential row.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import httpx

from prompts import make_prompts


def make_prompts_tagged(num_prompts: int, tag: str) -> list[str]:
    return [f"[{tag}] {p}" for p in make_prompts(num_prompts)]


class ServerProcess:
    """`convoy serve` as a subprocess, as a user runs it."""

    def __init__(self, args: argparse.Namespace) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [
            sys.executable, "-m", "convoy.cli", "serve", args.model, "--port", str(self.port),
            "--dtype", args.dtype, "--device", args.device, "--log-level", "warning",
            *getattr(args, "serve_args", []),
        ]  # fmt: skip
        self.cmd = cmd
        self.env = {k: v for k, v in os.environ.items() if k != "CONVOY_API_KEY"}
        self.proc = subprocess.Popen(cmd, env=self.env)
        self.url = f"http://127.0.0.1:{self.port}"

    def restart(self) -> None:
        """Start the same command again (same port) after the process ended; wait till healthy."""
        self.proc = subprocess.Popen(self.cmd, env=self.env)
        self.wait_healthy()

    def wait_healthy(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)  # polling while the model loads
        raise RuntimeError("server did not become healthy")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def _body(args: argparse.Namespace, prompt: str | list[str]) -> dict[str, object]:
    return {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def _completion_tokens(response: httpx.Response) -> int:
    response.raise_for_status()
    tokens: int = response.json()["usage"]["completion_tokens"]
    return tokens


def one_request(args: argparse.Namespace, url: str, prompts: list[str]) -> int:
    with httpx.Client(timeout=None) as client:
        return _completion_tokens(client.post(f"{url}/v1/completions", json=_body(args, prompts)))


def sequential(args: argparse.Namespace, url: str, prompts: list[str]) -> int:
    with httpx.Client(timeout=None) as client:
        return sum(
            _completion_tokens(client.post(f"{url}/v1/completions", json=_body(args, p)))
            for p in prompts
        )


def concurrent_requests(args: argparse.Namespace, url: str, prompts: list[str]) -> int:
    async def run() -> int:
        limits = httpx.Limits(max_connections=len(prompts))
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            responses = await asyncio.gather(
                *(client.post(f"{url}/v1/completions", json=_body(args, p)) for p in prompts)
            )
        return sum(_completion_tokens(r) for r in responses)

    return asyncio.run(run())


def measure(
    name: str, args: argparse.Namespace, run: Callable[[list[str]], int]
) -> tuple[str, list[float]]:
    """Tokens per second of `run` over --repeats, each repeat on fresh prompts."""
    rates = []
    for r in range(args.repeats):
        prompts = make_prompts_tagged(args.prompts, f"{name} {r}")
        start = time.perf_counter()
        num_tokens = run(prompts)
        elapsed = time.perf_counter() - start
        assert num_tokens == args.prompts * args.tokens, (name, num_tokens)
        rates.append(num_tokens / elapsed)
        print(f"  {name:<14} repeat {r}: {num_tokens / elapsed:8.1f} tok/s", file=sys.stderr)
    return name, rates


def offline(args: argparse.Namespace) -> list[tuple[str, list[float]]]:
    from convoy import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, device=args.device)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(make_prompts_tagged(2, "warm-up"), params)

    def run(prompts: list[str]) -> int:
        return sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params))

    def run_in_thread(prompts: list[str]) -> int:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(run, prompts).result()

    return [measure("offline", args, run), measure("offline thread", args, run_in_thread)]


def print_table(args: argparse.Namespace, rows: list[tuple[str, list[float]]]) -> None:
    baseline = statistics.median(dict(rows)["sequential"])
    print(
        f"\n{args.model} {args.dtype} on {args.device}: {args.prompts} prompts x {args.tokens}"
        f" tokens, {args.repeats} repeats, generated tokens/s\n"
    )
    print(f"| {'path':<14} | {'min':>8} | {'median':>8} | {'max':>8} | {'vs sequential':>13} |")
    print(f"|{'-' * 16}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 15}|")
    for name, rates in rows:
        med = statistics.median(rates)
        print(
            f"| {name:<14} | {min(rates):8.1f} | {med:8.1f} | {max(rates):8.1f} |"
            f" {med / baseline:12.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    server = ServerProcess(args)
    try:
        server.wait_healthy()
        url = server.url
        one_request(args, url, make_prompts_tagged(2, "warm-up"))
        rows = [
            measure("one request", args, lambda p: one_request(args, url, p)),
            measure("sequential", args, lambda p: sequential(args, url, p)),
            measure("concurrent", args, lambda p: concurrent_requests(args, url, p)),
        ]
    finally:
        server.stop()
    rows += offline(args)
    print_table(args, rows)


if __name__ == "__main__":
    main()
