"""/v1/embeddings side by side with llama-server (`--embeddings`) on the same GGUF, one run.

    python bench/embeddings.py                       # 1,000 texts of 64-256 tokens, smollm2
    python bench/embeddings.py --model gemma3-270m --texts 500 --batch 16 --concurrency 4

Each server runs alone on 127.0.0.1 (llama-server built as bench/peer.py builds it, with
`--embeddings --pooling <pooling>` and --parallel slots of 512 tokens; Convoy with its defaults
and `--pooling`). After a warm-up, --concurrency clients each send requests of --batch texts
until all --texts are embedded. Reported: inputs/s and prompt tokens/s (tokens as Convoy's usage
counts them, the same tokenizer for both), per-request latency p50/p99, the CPU other processes
used, and the cosine similarity of the two servers' vectors for every text (the same last-token
hidden state after the final norm, from two sets of quantized kernels). Opt-in, never in CI;
see bench/README.md ("Embeddings against llama-server").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from peer import Server, build_llama_server, gguf_path, log

_WORD_TEXT = (
    "river market silver quietly engine forest number window argue gentle library orbit "
    "paper winter signal carbon harbor simple yellow travel measure history castle ocean "
    "theory garden pencil violet bridge rapid thunder mirror planet season circle velvet "
    "anchor figure modern canvas spirit island minute shadow pattern summit copper meadow"
)
WORDS = _WORD_TEXT.split(" ")


def make_texts(n: int, seed: int) -> list[str]:
    """n texts of 50-200 words (about 64-256 tokens with these words), deterministic."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 200))) for _ in range(n)]


async def embed_all(
    url: str, model: str, texts: list[str], batch: int, concurrency: int, timeout: float
) -> tuple[float, list[float], list[np.ndarray], int]:
    """(wall s, request latencies, vectors in text order, prompt tokens by usage)."""
    chunks = [list(range(i, min(i + batch, len(texts)))) for i in range(0, len(texts), batch)]
    vectors: list[np.ndarray] = [np.empty(0)] * len(texts)
    latencies: list[float] = []
    tokens = 0
    queue = list(reversed(chunks))

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            idx = queue.pop()
            t0 = time.perf_counter()
            r = await client.post(
                f"{url}/v1/embeddings", json={"model": model, "input": [texts[i] for i in idx]}
            )
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)
            body = r.json()
            for item in body["data"]:
                vectors[idx[item["index"]]] = np.asarray(item["embedding"], dtype=np.float64)
            tokens += int(body.get("usage", {}).get("prompt_tokens") or 0)

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return wall, latencies, vectors, tokens


def run_server(srv: Server, args: argparse.Namespace, texts: list[str]) -> dict[str, object]:
    from peer import machine_cpu, tree_stats

    srv.wait_ready(args.start_timeout)
    asyncio.run(embed_all(srv.url, srv.model, texts[:32], args.batch, 2, args.timeout))  # warm-up
    (busy0, total0), ours0 = machine_cpu(), time.process_time()
    srv0 = tree_stats(srv.proc.pid)[1]
    wall, lat, vectors, tokens = asyncio.run(
        embed_all(srv.url, srv.model, texts, args.batch, args.concurrency, args.timeout)
    )
    (busy1, total1), ours1 = machine_cpu(), time.process_time()
    hwm, srv1 = tree_stats(srv.proc.pid)
    others = max(0.0, busy1 - busy0 - (ours1 - ours0) - (srv1 - srv0)) / (total1 - total0)
    srv.stop()
    lat.sort()
    return {"wall": wall, "p50": lat[len(lat) // 2], "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "vectors": vectors, "tokens": tokens, "others": others, "rss": hwm / 1024}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--model", default="smollm2-135m-instruct", help="short name or .gguf path")
    add("--texts", type=int, default=1000)
    add("--batch", type=int, default=32, help="texts per request")
    add("--concurrency", type=int, default=4, help="requests in flight")
    add("--pooling", default="last", choices=("last", "mean"))
    add("--slots", type=int, default=16, help="llama-server --parallel (512 tokens each)")
    add("--seed", type=int, default=0)
    add("--llama-server", type=Path, default=None, help="use this binary instead of building")
    add("--timeout", type=float, default=600)
    add("--start-timeout", type=float, default=900)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    gguf = gguf_path(args.model)
    binary = args.llama_server or build_llama_server(cores)
    texts = make_texts(args.texts, args.seed)
    env = {k: v for k, v in os.environ.items() if k != "CONVOY_API_KEY"}
    host = "127.0.0.1"
    llama_cmd = [str(binary), "-m", str(gguf), "--embeddings", "--pooling", args.pooling,
                 "--parallel", str(args.slots), "-c", str(args.slots * 512), "-t", str(cores),
                 "--no-webui"]  # fmt: skip
    convoy_cmd = [sys.executable, "-m", "convoy.cli", "serve", str(gguf), "--log-level",
                  "warning", "--pooling", args.pooling]  # fmt: skip
    results = {}
    for name, cmd in (("llama-server", llama_cmd), ("convoy", convoy_cmd)):
        results[name] = run_server(Server(name, cmd, host, env), args, texts)
        log(f"{name}: {args.texts / results[name]['wall']:.1f} inputs/s")
    tokens = int(results["convoy"]["tokens"])  # type: ignore[call-overload]
    base = results["llama-server"]
    print(f"\n{args.texts} texts ({tokens} tokens by Convoy's count), {gguf.name}, "
          f"{args.batch} a request, {args.concurrency} in flight, pooling {args.pooling}\n")  # fmt: skip
    print(
        "| server | wall s | inputs/s | tokens/s | p50 / p99 request s | peak RSS MiB | others' CPU |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        wall = float(r["wall"])  # type: ignore[arg-type]
        ratio = "" if name == "llama-server" else f" ({float(base['wall']) / wall:.2f}x)"  # type: ignore[arg-type]
        print(f"| {name} | {wall:.2f} | {args.texts / wall:.1f}{ratio} | {tokens / wall:.0f} | "
              f"{r['p50']:.2f} / {r['p99']:.2f} | {r['rss']:.0f} | {100 * float(r['others']):.0f}% |")  # type: ignore[arg-type]  # fmt: skip
    cos = [float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
           for a, b in zip(base["vectors"], results["convoy"]["vectors"], strict=True)]  # type: ignore[call-overload]  # fmt: skip
    print(
        f"\ncosine(llama-server, Convoy) per text: min {min(cos):.4f}, "
        f"median {float(np.median(cos)):.4f}"
    )


if __name__ == "__main__":
    main()
