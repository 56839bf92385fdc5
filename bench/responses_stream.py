"""A Responses stream against the chat stream it runs on: TTFT and tokens/s, one server, one run.

    python bench/responses_stream.py                  # 12 rounds, 128 tokens, smollm2
    python bench/responses_stream.py --model gemma3-270m --rounds 20

Starts `convoy serve MODEL` (its defaults) on 127.0.0.1, then alternates, round after round,
one streamed /v1/chat/completions and one streamed /v1/responses with the same message, greedy,
the same --tokens (chat: max_completion_tokens + ignore_eos; Responses: max_output_tokens and
a prompt that keeps talking), so the machine's drift falls on both alike. Reports median and
min/max of TTFT (to the first text) and of tokens/s after it; the Responses row must be within
5% of chat's (issue #26).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import httpx

from peer import Server

PROMPT = "Write a long story about a lighthouse keeper and the sea, in many paragraphs."


def _stream(srv: Server, path: str, body: dict[str, object]) -> tuple[float, float, int]:
    """(TTFT s, tokens/s after the first text, output tokens) of one streamed request."""
    t0 = time.perf_counter()
    first: float | None = None
    tokens = 0
    with httpx.stream("POST", f"{srv.url}{path}", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            text = _text(ev)
            if text and first is None:
                first = time.perf_counter()
            tokens = _tokens(ev) or tokens
    end = time.perf_counter()
    assert first is not None, f"{path}: no text"
    return first - t0, (tokens - 1) / max(end - first, 1e-9), tokens


def _text(ev: dict) -> str:
    if ev.get("type") == "response.output_text.delta":
        return str(ev["delta"])
    choices = ev.get("choices") or []
    return str((choices[0].get("delta") or {}).get("content") or "") if choices else ""


def _tokens(ev: dict) -> int:
    usage = ev.get("usage") or (ev.get("response") or {}).get("usage") or {}
    return int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    srv = Server("convoy", [sys.executable, "-m", "convoy.cli", "serve", args.model,
                            "--log-level", "warning"], "127.0.0.1")  # fmt: skip
    srv.wait_ready(900)
    msg = [{"role": "user", "content": PROMPT}]
    chat = {"model": srv.model, "messages": msg, "stream": True, "temperature": 0,
            "max_completion_tokens": args.tokens, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    resp = {"model": srv.model, "input": PROMPT, "stream": True, "temperature": 0,
            "max_output_tokens": args.tokens}  # fmt: skip
    rows: dict[str, list[tuple[float, float, int]]] = {"chat": [], "responses": []}
    _stream(srv, "/v1/chat/completions", chat)  # warm-up
    for _ in range(args.rounds):
        rows["chat"].append(_stream(srv, "/v1/chat/completions", chat))
        rows["responses"].append(_stream(srv, "/v1/responses", resp))
    srv.stop()
    print(f"\n{args.rounds} rounds, {args.tokens} tokens, {args.model}\n")
    print("| route | TTFT ms median (min-max) | tokens/s median (min-max) | tokens |")
    print("|---|---|---|---|")
    base = statistics.median(r[1] for r in rows["chat"])
    for name, runs in rows.items():
        ttft = sorted(1000 * r[0] for r in runs)
        rate = sorted(r[1] for r in runs)
        ratio = statistics.median(rate) / base
        print(f"| {name} | {statistics.median(ttft):.0f} ({ttft[0]:.0f}-{ttft[-1]:.0f}) | "
              f"{statistics.median(rate):.1f} ({rate[0]:.1f}-{rate[-1]:.1f}; {ratio:.2f}x chat) | "
              f"{statistics.median(r[2] for r in runs):.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
