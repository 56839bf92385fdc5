"""Command line: `convoy generate PROMPT` (one-shot greedy generation)."""

from __future__ import annotations

import argparse
import logging

import torch


def _generate(args: argparse.Namespace) -> None:
    from convoy.engine.tokenizer import Tokenizer
    from convoy.models.loader import load_model, resolve_model
    from convoy.worker.kv_cache import allocate_kv_cache
    from convoy.worker.model_runner import ModelRunner, ScheduledSeq

    resolved = resolve_model(args.model)
    model = load_model(resolved, torch.float32, torch.device("cpu"))
    tok = Tokenizer(resolved.model_dir, resolved.config.model_type)
    ids = tok.encode(args.prompt)
    block_size = 16
    num_blocks = (len(ids) + args.max_tokens) // block_size + 1
    kv = allocate_kv_cache(
        resolved.config, num_blocks, block_size, torch.float32, torch.device("cpu")
    )
    runner = ModelRunner(model, kv, torch.device("cpu"))
    table = list(range(num_blocks))
    out: list[int] = []
    new, start = ids, 0
    for _ in range(args.max_tokens):
        logits = runner.execute([ScheduledSeq(new, start, table, need_logits=True)]).logits
        token = int(logits[0].argmax())
        if token == tok.eos_token_id:
            break
        out.append(token)
        start, new = start + len(new), [token]
    print(args.prompt + tok.decode(out))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="convoy")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="one-shot greedy generation")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None)
    gen.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    _generate(args)


if __name__ == "__main__":
    main()
