"""Speculative decoding: Convoy with drafts against Convoy without and against llama-server.

    python bench/spec.py                                  # smollm2, every workload, 1 and 64 streams
    python bench/spec.py --model gemma3-270m --files 10   # fewer edit files
    python bench/spec.py --workloads edit --concurrency 1 --skip-llama

Three workloads of chat requests (greedy, `/v1/chat/completions`), each run by three servers on
127.0.0.1 on the same GGUF, all started at once and taking turns (one runs while the others idle;
--rounds R passes each, in a rotating order, and the median is reported with the spread, so the
VM's drift hits every server alike):
- edit: --files pieces of 300-800 tokens of Convoy's own source; the request asks for the piece
  back with a line added at the top and sends the piece as `prediction` (OpenAI's predicted
  outputs); max_tokens = the piece's tokens + 48;
- quote: a ~1,000-token context (paragraphs of docs/architecture.md) and a request to quote one
  paragraph of it word for word (prompt lookup drafts; no prediction); max_tokens 256;
- chat: questions whose answers share nothing with the prompt; max_tokens 128;
- faithful: what `edit` would be with a model that edits faithfully (the shipped small models
  rewrite the code instead: bench/edit_faithfulness.py). The edit requests, each answered once
  first by `convoy serve --speculative off` (greedy: the answer every server gives); the
  prediction sent is that answer with every --changed-every'th line replaced, so the answer
  differs from the "original" in ~1 line in N, as a real small edit does. It measures the
  mechanism (verifying the prediction, re-aligning after each changed line), not a model.
Servers: `convoy serve --speculative off`, `convoy serve` (auto: prompt lookup, and the
prediction), and llama-server with its default flags (no speculative decoding: it ignores
`prediction`). Per --concurrency N: N clients send the workload's requests (cycled to at least N
requests) until all are answered; tokens/s = completion tokens (usage) / wall. For Convoy with
drafts: the share of draft tokens kept and the tokens a sequence gains per step (from /metrics:
completion tokens / (completion tokens - kept draft tokens)), and whether every answer is the
text Convoy gives without drafts (greedy: it must be). Opt-in, never in CI; figures in
bench/README.md ("Speculative decoding").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from peer import Server, build_llama_server, gguf_path, log, machine_cpu, tree_stats, wait_idle

ROOT = Path(__file__).resolve().parents[1]
CHAT_QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a rainy weekend.",
    "What are the pros and cons of electric cars?",
    "Describe the water cycle in a few sentences.",
    "Write a poem about autumn leaves.",
    "How do vaccines train the immune system?",
    "Plan a three-day trip to Lisbon.",
    "What makes a good team leader?",
    "Summarise the causes of the French Revolution.",
    "Suggest a recipe for a quick vegetarian dinner.",
    "Why do cats purr?",
    "Compare tea and coffee.",
    "Tell me about the history of the bicycle.",
    "How does a refrigerator keep food cold?",
    "Write a letter thanking a teacher.",
    "What are black holes?",
    "Describe a busy market in the morning.",
    "How can I sleep better?",
    "Invent a new board game and explain its rules.",
]


@dataclass
class Req:
    messages: list[dict[str, str]]
    max_tokens: int
    prediction: str | None = None


def code_pieces(n: int, seed: int) -> list[str]:
    """n pieces of 1,100-2,800 characters (~300-800 tokens) of Convoy's source, whole lines."""
    files = sorted((ROOT / "src" / "convoy").rglob("*.py"))
    rng = random.Random(seed)
    pieces: list[str] = []
    while len(pieces) < n:
        lines = rng.choice(files).read_text().splitlines(keepends=True)
        start = rng.randrange(max(1, len(lines) - 20))
        piece = ""
        for line in lines[start:]:
            if len(piece) + len(line) > 2800:
                break
            piece += line
        if len(piece) >= 1100:
            pieces.append(piece)
    return pieces


def prose_pieces(n: int, seed: int) -> list[str]:
    """n pieces of 1,100-2,800 characters (~300-800 tokens) of Convoy's docs: runs of whole
    paragraphs of plain text (no code blocks, tables or lists), blank lines between them."""
    paras: list[str] = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for para in re.split(r"\n\s*\n", path.read_text()):
            para = para.strip()
            if len(para) >= 200 and not para.startswith(("```", "|", "#", "-", "*", "    ")):
                paras.append(para)
    rng = random.Random(seed)
    pieces: list[str] = []
    while len(pieces) < n:
        start = rng.randrange(len(paras))
        piece = ""
        for para in paras[start:]:
            if len(piece) + len(para) + 2 > 2800:
                break
            piece += para + "\n\n"
        if len(piece) >= 1100:
            pieces.append(piece.rstrip("\n") + "\n")
    return pieces


def edit_requests(n: int, seed: int) -> list[Req]:
    out = []
    for piece in code_pieces(n, seed):
        ask = (
            "Add the line `# Reviewed.` at the top of this code and reply with the whole code,"
            f" nothing else.\n\n{piece}"
        )
        out.append(Req([{"role": "user", "content": ask}], len(piece) // 3 + 48, piece))
    return out


def faithful_requests(edits: list[Req], answers: list[str], every: int) -> list[Req]:
    """The edit requests with, as prediction, their answer with every `every`'th line (from the
    `every // 2`'th) changed: the original a faithful edit would have come from."""
    out = []
    for req, answer in zip(edits, answers, strict=True):
        lines = answer.splitlines(keepends=True)
        for i in range(every // 2, len(lines), every):
            lines[i] = f"    value = changed_{i}()  # not in the answer\n"
        out.append(Req(req.messages, req.max_tokens, "".join(lines)))
    return out


def quote_requests(n: int, seed: int) -> list[Req]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if 300 <= len(p.strip()) <= 1200]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(max(1, len(paras) - 6))
        context = paras[start : start + 6]  # ~1,000 tokens
        target = rng.choice(context)
        first = " ".join(target.split()[:6])
        ask = (
            "\n\n".join(context)
            + f"\n\nQuote the paragraph above that begins with \"{first}\" word for word."
        )
        out.append(Req([{"role": "user", "content": ask}], 256))
    return out


def chat_requests(n: int) -> list[Req]:
    return [Req([{"role": "user", "content": q}], 128) for q in (CHAT_QUESTIONS * 4)[:n]]


async def run_requests(
    srv: Server, reqs: list[Req], concurrency: int, timeout: float
) -> tuple[float, int, list[str]]:
    """(wall s, completion tokens, answers in request order) with `concurrency` clients."""
    answers = [""] * len(reqs)
    tokens = 0
    queue = list(reversed(range(len(reqs))))

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            i = queue.pop()
            r = reqs[i]
            body: dict[str, object] = {
                "model": srv.model, "messages": r.messages, "max_tokens": r.max_tokens,
                "temperature": 0,
            }  # fmt: skip
            if r.prediction is not None:
                body["prediction"] = {"type": "content", "content": r.prediction}
            resp = await client.post(f"{srv.url}/v1/chat/completions", json=body)
            resp.raise_for_status()
            data = resp.json()
            answers[i] = data["choices"][0]["message"]["content"] or ""
            tokens += int(data["usage"]["completion_tokens"])

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return time.perf_counter() - t0, tokens, answers


def metric(srv: Server, name: str) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def one_run(
    srv: Server, batch: list[Req], n: int, args: argparse.Namespace
) -> tuple[dict[str, float], list[str]]:
    """One pass of `batch` with n clients against `srv`: its row and its answers."""
    wait_idle(args.wait_idle)
    d0, a0 = (metric(srv, f"convoy_spec_decode_{k}_tokens_total") for k in ("draft", "accepted"))
    (b0, t0), s0 = machine_cpu(), tree_stats(srv.proc.pid)[1]
    wall, tokens, texts = asyncio.run(run_requests(srv, batch, n, args.timeout))
    (b1, t1), s1 = machine_cpu(), tree_stats(srv.proc.pid)[1]
    d1, a1 = (metric(srv, f"convoy_spec_decode_{k}_tokens_total") for k in ("draft", "accepted"))
    others = max(0.0, (b1 - b0) - (s1 - s0)) / max(t1 - t0, 1e-9)
    row = {"tok_s": tokens / wall, "wall": wall, "tokens": tokens,
           "drafted": d1 - d0, "kept": a1 - a0, "others": others}  # fmt: skip
    return row, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--model", default="smollm2-135m-instruct", help="short name or .gguf path")
    add("--files", type=int, default=20, help="edit workload: code pieces")
    add("--requests", type=int, default=20, help="quote and chat workloads: requests")
    add("--workloads", default="edit,quote,chat", help="of edit, quote, chat, faithful")
    add("--changed-every", type=int, default=10, help="faithful: one line in N differs")
    add("--concurrency", default="1,64")
    add("--seed", type=int, default=0)
    add("--rounds", type=int, default=1, help="passes of each row per server, taking turns (median)")
    add("--skip-llama", action="store_true")
    add("--wait-idle", type=float, default=20)
    add("--timeout", type=float, default=1800)
    add("--convoy-flag", action="append", default=[],
        help="extra flag for the Convoy that drafts, repeatable (--convoy-flag=--num-speculative-tokens=16)")  # fmt: skip
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    gguf = gguf_path(args.model)
    workloads = {
        "edit": edit_requests(args.files, args.seed),
        "quote": quote_requests(args.requests, args.seed),
        "chat": chat_requests(args.requests),
        "faithful": [],  # made once the servers run (the answers without drafts)
    }
    workloads = {k: v for k, v in workloads.items() if k in args.workloads.split(",")}
    concurrency = [int(c) for c in args.concurrency.split(",")]
    slots = max(concurrency)
    ctx = 2048
    convoy = [sys.executable, "-m", "convoy.cli", "serve", str(gguf), "--log-level", "warning",
              "--max-model-len", str(ctx)]  # fmt: skip
    servers: list[tuple[str, list[str]]] = [
        ("convoy-off", [*convoy, "--speculative", "off"]),
        ("convoy", [*convoy, *args.convoy_flag]),
    ]
    if not args.skip_llama:
        binary = build_llama_server(cores)
        servers.append(("llama-server", [str(binary), "-m", str(gguf), "--parallel", str(slots),
                                         "-c", str(slots * ctx), "-t", str(cores), "--no-webui"]))  # fmt: skip
    results: dict[tuple[str, str, int], dict[str, float]] = {}
    answers: dict[tuple[str, str, int], list[str]] = {}
    live = [Server(name, cmd, "127.0.0.1") for name, cmd in servers]
    try:
        for srv in live:
            srv.wait_ready(900)
            asyncio.run(run_requests(srv, chat_requests(2), 2, args.timeout))  # warm-up
        if "faithful" in workloads:
            edits = edit_requests(args.files, args.seed)
            texts = asyncio.run(run_requests(live[0], edits, 4, args.timeout))[2]
            workloads["faithful"] = faithful_requests(edits, texts, args.changed_every)
        for wl, reqs in workloads.items():
            for n in concurrency:
                batch = (reqs * (-(-n // len(reqs))))[: max(n, len(reqs))]
                rounds: dict[str, list[dict[str, float]]] = {srv.name: [] for srv in live}
                for r in range(args.rounds):
                    # the servers take turns, in an order that rotates every round
                    for srv in live[r % len(live) :] + live[: r % len(live)]:
                        row, texts = one_run(srv, batch, n, args)
                        rounds[srv.name].append(row)
                        key = (srv.name, wl, n)
                        if key in answers and texts != answers[key]:
                            log(f"{srv.name} {wl} x{n}: round {r} answered differently")
                            row["changed"] = 1.0
                        answers.setdefault(key, texts)
                        log(f"{srv.name} {wl} x{n} round {r}: {row['tok_s']:.1f} tok/s, "
                            f"{row['tokens']:.0f} tokens in {row['wall']:.1f} s, kept "
                            f"{row['kept']:.0f}/{row['drafted']:.0f} drafts, others' CPU {row['others']:.0%}")  # fmt: skip
                for name, rows in rounds.items():
                    med = statistics.median(x["tok_s"] for x in rows)
                    results[(name, wl, n)] = {
                        "tok_s": med, "tokens": sum(x["tokens"] for x in rows),
                        "drafted": sum(x["drafted"] for x in rows), "kept": sum(x["kept"] for x in rows),
                        "others": max(x["others"] for x in rows), "spread": (max(x["tok_s"] for x in rows) - min(x["tok_s"] for x in rows)) / med,
                    }  # fmt: skip
    finally:
        for srv in live:
            srv.stop()
    print(f"\n{gguf.name}, {cores} threads; tokens/s (x Convoy without drafts; x llama-server)\n")
    print("| workload | streams | llama-server | Convoy, off | Convoy | kept drafts | tokens/step | same text | others' CPU | spread off / on |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for wl in workloads:
        for n in concurrency:
            off, on = results[("convoy-off", wl, n)], results[("convoy", wl, n)]
            llama = results.get(("llama-server", wl, n))
            kept = f"{on['kept'] / on['drafted']:.0%}" if on["drafted"] else "-"
            per_step = on["tokens"] / max(on["tokens"] - on["kept"], 1)
            same = sum(a == b for a, b in zip(answers[("convoy", wl, n)], answers[("convoy-off", wl, n)], strict=True))
            vs_llama = f" ({on['tok_s'] / llama['tok_s']:.2f}x)" if llama else ""
            others = max(on["others"], off["others"], llama["others"] if llama else 0.0)
            print(f"| {wl} | {n} | {llama['tok_s']:.1f} | " if llama else f"| {wl} | {n} | - | ", end="")
            print(f"{off['tok_s']:.1f} | {on['tok_s']:.1f} ({on['tok_s'] / off['tok_s']:.2f}x){vs_llama}"
                  f" | {kept} | {per_step:.2f} | {same}/{len(answers[('convoy', wl, n)])} | {others:.0%} | {off['spread']:.0%} / {on['spread']:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
