"""One stream against llama-server, the two servers loaded at once and asked in turn.

    python bench/alternate.py --model ~/.cache/convoy/synth/llama-1b.q4_k_m.gguf \\
        --convoy-flag=--speculative=off --rounds 10 --tokens 128

`peer.py` runs one server after the other, so a host whose speed drifts over minutes (a shared
VM: the same 128-token stream here took 45 to 67 tok/s within a quarter of an hour) puts its
drift into the ratio. Here both servers load the same GGUF first and stay up; each round sends
one greedy streamed /v1/completions (EOS ignored) to one, then the other, the order flipped
every round, and the ratio is taken round by round: both sides of a ratio ran within seconds
of each other. Prints each round's tokens/s (tokens over the request's wall time, and decode
alone: after the first token) and the median of the per-round ratios. `--whole` also sends each
round the same completion unstreamed to each server (right after its streamed one), so what
streaming costs each server shows beside the ratio.

Both servers must fit in memory together, or the one that maps its file (llama-server) reads
its weights back from disk while the other runs: the script refuses when the file's size x 3
(llama-server's mapping and buffers, Convoy's repacked panels) exceeds MemAvailable, unless
--force. Synthetic files loop, and Convoy's default drafts from a sequence's own n-grams: pass
--convoy-flag=--speculative=off on them (llama-server drafts nothing by default). Opt-in,
never in CI.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peer  # noqa: E402  (bench/ scripts import each other as peer.py imports prompts)

PROMPT = "Once upon a time in a land far away,"


def mem_available() -> int:
    """/proc/meminfo's MemAvailable in bytes (0 where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def one(srv: peer.Server, tokens: int, timeout_s: float) -> tuple[float, float]:
    """(tokens / wall, decode tokens/s after the first token) of one streamed completion."""
    run = peer.streams(srv, [PROMPT], tokens, timeout_s)
    return run.tokens / run.wall_s, (run.tokens - 1) / max(run.wall_s - run.ttfts[0], 1e-9)


def whole(srv: peer.Server, tokens: int, timeout_s: float) -> float:
    """tokens / wall of the same completion, not streamed."""
    run = peer.one_request(srv, [PROMPT], tokens, timeout_s)
    return run.tokens / run.wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--model", default="smollm2-135m-instruct", help="short name or .gguf path")
    add("--convoy-flag", action="append", default=[], help="extra `convoy serve` flag, repeatable")
    add("--rounds", type=int, default=10)
    add("--tokens", type=int, default=128, help="generated tokens a request")
    add("--threads", type=int, default=None, help="llama-server -t (default: all cores)")
    add("--llama-server", type=Path, default=None, help="use this binary instead of building")
    add("--host", default="127.0.0.1", help="loopback only")
    add("--timeout", type=float, default=600, help="seconds a request")
    add("--start-timeout", type=float, default=900, help="seconds for a server to load")
    add("--force", action="store_true", help="run even where both may not fit in memory")
    add("--whole", action="store_true", help="also the same completion unstreamed, each round")
    args = parser.parse_args()
    if args.host not in peer.LOOPBACK:
        parser.error(f"--host {args.host}: only {' or '.join(peer.LOOPBACK)}")
    if args.rounds < 1 or args.tokens < 2:
        parser.error("--rounds >= 1 and --tokens >= 2")
    gguf = peer.gguf_path(args.model)
    if not gguf.is_file():
        sys.exit(f"{gguf}: no such GGUF file")
    need, have = 3 * gguf.stat().st_size, mem_available()
    if have and need > have and not args.force:
        sys.exit(
            f"both servers on {gguf.name} need ~{need / 2**30:.1f} GiB (3x the file) and"
            f" {have / 2**30:.1f} GiB is available: their ratio would measure the disk"
            " (--force runs anyway)"
        )
    cores = os.cpu_count() or 1
    threads = args.threads or cores
    binary = args.llama_server or peer.build_llama_server(cores)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so atexit stops the servers
    env = peer.server_env(threads, cores)
    ctx = 4096  # one slot's context, the same tokens of KV on both sides
    servers = [
        peer.Server("llama-server", peer.llama_cmd(binary, gguf, 1, ctx, threads), args.host),
        peer.Server("convoy", peer.convoy_cmd(gguf, ctx, args.convoy_flag), args.host, env),
    ]
    for srv in servers:
        srv.wait_ready(args.start_timeout)
        one(srv, 8, args.timeout)  # warm: first requests build caches and touch pages
    names = [s.name for s in servers]
    res: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    unstreamed: dict[str, list[float]] = {n: [] for n in names}
    print(f"{gguf.name}, {threads} threads, {args.tokens} tokens a request; tok/s (wall / decode)")
    extra = " unstreamed: llama-server / convoy |" if args.whole else ""
    print(f"| round | llama-server | convoy | convoy / llama-server |{extra}")
    print("|---|---|---|---|" + ("---|" if args.whole else ""))
    for r in range(args.rounds):
        for srv in servers if r % 2 == 0 else servers[::-1]:
            res[srv.name].append(one(srv, args.tokens, args.timeout))
            if args.whole:
                unstreamed[srv.name].append(whole(srv, args.tokens, args.timeout))
        (lw, ld), (cw, cd) = res["llama-server"][-1], res["convoy"][-1]
        cells = f"| {r} | {lw:.1f} / {ld:.1f} | {cw:.1f} / {cd:.1f} | {cw / lw:.2f}x |"
        if args.whole:
            cells += f" {unstreamed['llama-server'][-1]:.1f} / {unstreamed['convoy'][-1]:.1f} |"
        print(cells, flush=True)
    ratios = [c[0] / ll[0] for c, ll in zip(res["convoy"], res["llama-server"], strict=True)]
    med = {n: statistics.median(w for w, _ in res[n]) for n in names}
    print(
        f"median: llama-server {med['llama-server']:.1f}, convoy {med['convoy']:.1f} tok/s;"
        f" per-round ratio median {statistics.median(ratios):.2f}x"
        f" (min {min(ratios):.2f}, max {max(ratios):.2f})"
    )
    if args.whole:
        wr = [
            c / ll for c, ll in zip(unstreamed["convoy"], unstreamed["llama-server"], strict=True)
        ]
        wm = {n: statistics.median(unstreamed[n]) for n in names}
        print(
            f"unstreamed: llama-server {wm['llama-server']:.1f}, convoy {wm['convoy']:.1f} tok/s;"
            f" per-round ratio median {statistics.median(wr):.2f}x"
            f" (min {min(wr):.2f}, max {max(wr):.2f})"
        )
    for srv in servers:
        srv.stop()


if __name__ == "__main__":
    main()
