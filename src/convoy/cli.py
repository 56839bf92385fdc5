"""Command line: `convoy serve [MODEL]` (the OpenAI-compatible server) and `convoy generate PROMPT`."""

from __future__ import annotations

import argparse
import logging
import os
import re

_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_size(text: str) -> int:
    """Bytes from "2GiB", "512MiB", "1.5G" or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmg]i?)?b?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default=None, help="short name, .gguf file or HF folder")
    serve.add_argument("--model", dest="model_flag", default=None, help="same as MODEL")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    serve.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    serve.add_argument("--served-model-name", default=None, help="name clients send as `model`")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("CONVOY_API_KEY"),
        help="require `Authorization: Bearer KEY` (default: $CONVOY_API_KEY)",
    )
    serve.add_argument("--max-num-seqs", type=_positive, default=256)
    serve.add_argument("--max-num-batched-tokens", type=_positive, default=2048)
    serve.add_argument("--max-model-len", type=_positive, default=None)
    serve.add_argument(
        "--kv-cache-memory", type=parse_size, default=2 << 30, help="KV pool budget, e.g. 2GiB"
    )
    serve.add_argument("--max-prompts-per-request", type=_positive, default=1024)
    serve.add_argument(
        "--max-queue",
        type=_positive,
        default=None,
        help="answer 429 while this many engine requests (one per prompt) are in flight",
    )
    serve.add_argument("--max-request-bytes", type=parse_size, default=32 << 20)
    serve.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from convoy.api.server import ServerSettings, build_app

    settings = ServerSettings(
        model=args.model_flag or args.model,
        dtype=args.dtype,
        device=args.device,
        served_model_name=args.served_model_name,
        api_key=args.api_key or None,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        max_prompts_per_request=args.max_prompts_per_request,
        max_queue=args.max_queue,
        max_request_bytes=args.max_request_bytes,
    )
    # uvicorn handles SIGINT/SIGTERM: stop accepting, let in-flight requests finish (up to the
    # grace period), then the lifespan shuts the engine down. Our own middleware logs requests.
    uvicorn.run(
        build_app(settings),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=30,
    )


def _generate(args: argparse.Namespace) -> None:
    from convoy import LLM, SamplingParams

    llm = LLM(model=args.model)
    out = llm.generate([args.prompt], SamplingParams(temperature=0, max_tokens=args.max_tokens))
    print(args.prompt + out[0].outputs[0].text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="convoy")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="one-shot greedy generation")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None)
    gen.add_argument("--max-tokens", type=int, default=32)
    _add_serve_parser(sub)
    args = parser.parse_args(argv)
    level = getattr(logging, getattr(args, "log_level", "info").upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        _serve(args)
    else:
        _generate(args)


if __name__ == "__main__":
    main()
