"""Command line: `convoy serve [MODEL]` (the OpenAI-compatible server), `convoy generate PROMPT`
and `convoy batch -i IN.jsonl -o OUT.jsonl [MODEL]` (a batch file offline).

The flags are generated from the config dataclasses in config.py (one `--field-name` per leaf
setting, defaults and help from the fields), so a setting added there appears here by itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convoy.config import (
    ConfigError,
    ConfigField,
    EngineConfig,
    ServerConfig,
    format_size,
    leaf_fields,
    parse_size,
)

if TYPE_CHECKING:
    from convoy.batch.offline import BatchSummary, OfflineJob


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


# How a flag's text becomes a value: by the field's `kind` metadata, else by its type.
_PARSERS: dict[Any, tuple[Callable[[str], Any], str | None]] = {
    "size": (_size, "SIZE"),
    "positive": (_positive, "N"),
    int: (int, "N"),
    float: (float, "X"),
    str: (str, None),
}


def _leaf(cls: type, name: str) -> ConfigField:
    return next(leaf for leaf in leaf_fields(cls) if leaf.name == name)


def _flag(leaf: ConfigField) -> str:
    return "--" + leaf.name.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser, leaves: Iterable[ConfigField]) -> None:
    """One flag per leaf setting: `--name` (dest `name`), default and help from the field."""
    for leaf in leaves:
        if leaf.type is bool:
            action = parser.add_argument(
                _flag(leaf),
                action=argparse.BooleanOptionalAction,
                default=leaf.default,
                help=leaf.help,
            )
            if "%(default)" not in (action.help or ""):  # Python versions that don't add it
                action.help = f"{leaf.help} (default: %(default)s)"
            continue
        key = leaf.kind if leaf.kind is not None else leaf.type
        if key not in _PARSERS:
            raise TypeError(f"no command-line parser for {leaf.name}: {key!r}")
        parse, metavar = _PARSERS[key]
        help_text = leaf.help
        if leaf.default is not None:
            shown = format_size(leaf.default) if leaf.kind == "size" else leaf.default
            help_text += f" (default: {shown})"
        parser.add_argument(
            _flag(leaf),
            type=parse,
            default=leaf.default,
            choices=leaf.choices,
            metavar=None if leaf.choices else metavar,
            help=help_text.replace("%", "%%"),
        )


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """MODEL, positional or as --model (dest model_flag: a positional default must not win)."""
    model = _leaf(EngineConfig, "model")
    parser.add_argument("model", nargs="?", default=model.default, help=model.help)
    parser.add_argument(
        "--model", dest="model_flag", metavar="MODEL", default=None, help="same as MODEL"
    )


def _add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_model_arguments(serve)
    add_config_arguments(
        serve, (leaf for leaf in leaf_fields(ServerConfig) if leaf.name != "model")
    )
    serve.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="read the API key from this file, so it does not show in `ps` (as $CONVOY_API_KEY)",
    )
    group = serve.add_argument_group(
        "replicas on Ray Serve (pip install 'convoy[ray]')",
        "N engines behind one endpoint: Serve's proxy listens on --host/--port and routes each"
        " request to a replica (x-convoy-replica names it); /v1/files and /v1/batches: one store"
        " (--data-dir, on this machine), each batch line run on a replica",
    )
    _add_ray_arguments(group, "replicas", "local, with --replicas above 1")
    return serve


def _api_key(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """--api-key, else --api-key-file's content, else $CONVOY_API_KEY (else no key)."""
    if args.api_key_file is None:
        return args.api_key or os.environ.get("CONVOY_API_KEY") or None
    if args.api_key:
        parser.error("give --api-key or --api-key-file, not both")
    try:
        key = Path(args.api_key_file).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        parser.error(f"--api-key-file: cannot read {args.api_key_file}: {e}")
    if not key:
        parser.error(f"--api-key-file: {args.api_key_file} is empty")
    return key


def _add_generate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    gen = sub.add_parser("generate", help="one-shot greedy generation")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=32)
    add_config_arguments(gen, leaf_fields(EngineConfig))
    add_config_arguments(gen, [_leaf(ServerConfig, "log_level")])
    return gen


_BATCH_DESCRIPTION = """\
Run a batch file of OpenAI requests offline, in this process: the Batch API's line format (and
vLLM's run-batch), one request a line:

  {"custom_id": "q1", "method": "POST", "url": "/v1/completions", "body": {"model": ..., ...}}

`url` is /v1/completions or /v1/chat/completions (a file may mix both). Output lines are the Batch
API's ({"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}), in
completion order: join them on custom_id. A line that cannot be run (not JSON, no custom_id or a
duplicate one, another method or url, stream: true, too long) gets an error line; an invalid body
gets its 400 response. Error lines go to --error-file if given, else to the output file.

Resumable: results are fsynced, then recorded in OUT.jsonl.convoy-state. After an interruption
(Ctrl-C, kill -9, power loss) run the same command again: the output files are cut back to what
was recorded, recorded lines are skipped, the rest run; each custom_id is answered exactly once.
The state file is kept when the job completes: a rerun says "nothing to do", and lines appended
to the input later run on the next rerun. Remove both output files and the state to start afresh.

On a Ray cluster (--ray ADDRESS, or --ray local[:N] for a Ray instance in this process): the input
is cut into shards of --shard-lines lines, run by --replicas engine actors; each finished shard is
fsynced to OUT.jsonl.convoy-shards/<shard>.jsonl, a rerun skips the shards found there, and the
parts are merged into the output files (input order) once all are done, each custom_id once.

exit status: 0 every line answered (successes and per-line errors alike); 1 the job could not run
(input unreadable, output unwritable, the model failed to load, the engine stopped: rerun to
resume); 2 refused (bad flags; output, error file and input not distinct; an existing output with
no state file, or a state file of another job); 130 interrupted (rerun to resume).
"""

_SHARD_LINES = 256  # default --shard-lines: a continuous batch or two of lines
# --ray's flags: None when not given, so that giving one without --ray is refused.
_CLUSTER_FLAGS = ("replicas", "replica_cpus", "shard_lines", "fake_engine")

# The server settings `convoy batch` takes too, with their help as this command reads them.
_BATCH_SERVER_LEAVES = {
    "served_model_name": "the `model` the lines' bodies name (default: the model's name)",
    "max_request_bytes": "longer input lines are answered with a line_too_long error line",
    "reasoning_parser": "split a reasoning model's <think> block from chat answers (see serve)",
    "log_level": "log level",
}


_NOT_OFFLINE = {"model", "batch_max_seqs", "batch_share", "batch_grace"}


def _add_batch_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    batch = sub.add_parser(
        "batch",
        help="run a JSONL file of requests offline (resumable)",
        description=_BATCH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    batch.add_argument(
        "-i", "--input-file", required=True, type=Path, metavar="IN.jsonl", help="the requests"
    )
    batch.add_argument(
        "-o", "--output-file", required=True, type=Path, metavar="OUT.jsonl",
        help="the answers, appended (state: OUT.jsonl.convoy-state beside it)",
    )  # fmt: skip
    batch.add_argument(
        "--error-file", type=Path, metavar="ERR.jsonl", help="error lines (default: OUT.jsonl)"
    )
    _add_model_arguments(batch)
    # NOTE: no --batch-max-seqs / --batch-share / --batch-grace: offline, batch lines are the
    # only traffic and may fill the engine (run_batch sets the batch cap to --max-num-seqs).
    add_config_arguments(
        batch, (leaf for leaf in leaf_fields(EngineConfig) if leaf.name not in _NOT_OFFLINE)
    )
    add_config_arguments(
        batch,
        [
            dataclasses.replace(leaf, help=_BATCH_SERVER_LEAVES[leaf.name])
            for leaf in leaf_fields(ServerConfig)
            if leaf.name in _BATCH_SERVER_LEAVES
        ],
    )
    _add_cluster_arguments(batch)
    return batch


def _add_ray_arguments(group: argparse._ArgumentGroup, what: str, ray_default: str) -> None:
    """--ray, --replicas and --replica-cpus, shared by `batch` (actors) and `serve` (replicas)."""
    group.add_argument(
        "--ray", metavar="ADDRESS|local[:N]",
        help="run on the Ray cluster at ADDRESS, or on a Ray instance started in this process"
        f" with N CPUs (local: all of them; default: {ray_default})",
    )  # fmt: skip
    group.add_argument("--replicas", type=_positive, metavar="N", help=f"{what} (default: 1)")
    group.add_argument(
        "--replica-cpus", type=float, metavar="X",
        help=f"CPUs of each of the {what}, its torch threads (default: the cluster's CPUs /"
        " --replicas, whole CPUs, at most one node's)",
    )  # fmt: skip


def _add_cluster_arguments(batch: argparse.ArgumentParser) -> None:
    group = batch.add_argument_group("on a Ray cluster (pip install 'convoy[ray]')")
    _add_ray_arguments(group, "engine actors", "none: in this process")
    group.add_argument(
        "--shard-lines", type=_positive, metavar="N",
        help=f"input lines a shard: the unit of work, retry and resume (default: {_SHARD_LINES})",
    )  # fmt: skip
    # Tests and benches only: actors answer every good line with a function of its custom_id,
    # CAP lines every STEP_MS (cluster/engines.py), so scaling shows without the cores for it.
    group.add_argument("--fake-engine", metavar="STEP_MS:CAP", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convoy")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    _add_serve_parser(sub)
    _add_batch_parser(sub)
    return parser


def _settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServerConfig:
    """The ServerConfig of the leaf flags `args` has (the others keep their defaults)."""
    values = {
        leaf.name: getattr(args, leaf.name)
        for leaf in leaf_fields(ServerConfig)
        if hasattr(args, leaf.name)
    }
    values["model"] = args.model_flag or args.model
    if args.command == "serve":
        values["api_key"] = _api_key(args, parser)
    try:
        return ServerConfig.from_kwargs(**values)
    except ConfigError as e:
        parser.error(str(e))


def parse_serve_args(argv: Sequence[str] = ()) -> ServerConfig:
    """The settings `convoy serve ARGV...` would run with, without starting anything."""
    parser = build_parser()
    return _settings(parser.parse_args(["serve", *argv]), parser)


def uvicorn_options(settings: ServerConfig) -> dict[str, Any]:
    """uvicorn.run's keywords for `convoy serve`.

    NOTE: the event loop and HTTP parser are named, not "auto": the ray extra installs uvloop
    and httptools (uvicorn[standard]), and "auto" would switch to them, so installing it would
    change the single-machine server. uvicorn handles SIGINT/SIGTERM: stop accepting, let
    in-flight requests finish (up to the grace period), then the lifespan shuts the engine
    down. Our own middleware logs requests.
    """
    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "access_log": False,
        "timeout_graceful_shutdown": 30,
        "loop": "asyncio",
        "http": "h11",
    }


def _serve(settings: ServerConfig) -> None:
    import uvicorn

    from convoy.api.server import build_app

    uvicorn.run(build_app(settings), **uvicorn_options(settings))


def _serve_replicas(args: argparse.Namespace, settings: ServerConfig) -> None:
    """`convoy serve --replicas N` / `--ray`: convoy.cluster, which imports Ray, only here."""
    from convoy.batch.offline_state import JobError
    from convoy.cluster import serve_replicas

    try:
        serve_replicas(settings, args.ray or "local", args.replicas or 1, args.replica_cpus)
    except JobError as e:
        print(f"convoy serve: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


def _generate(args: argparse.Namespace) -> None:
    from convoy import LLM, SamplingParams

    llm = LLM(**{leaf.name: getattr(args, leaf.name) for leaf in leaf_fields(EngineConfig)})
    out = llm.generate([args.prompt], SamplingParams(temperature=0, max_tokens=args.max_tokens))
    print(args.prompt + out[0].outputs[0].text)


def _batch(args: argparse.Namespace, settings: ServerConfig) -> None:
    from convoy.batch.offline import JobError, OfflineJob, run_batch

    job = OfflineJob(args.input_file, args.output_file, args.error_file, settings)
    try:
        summary = run_batch(job) if args.ray is None else _run_on_ray(args, job)
    except JobError as e:
        print(f"convoy batch: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("convoy batch: interrupted; run the same command again to resume", file=sys.stderr)
        sys.exit(130)
    print(f"convoy batch: {summary.describe(job)}", file=sys.stderr)


def _run_on_ray(args: argparse.Namespace, job: OfflineJob) -> BatchSummary:
    """`convoy batch --ray`: convoy.cluster, which imports Ray, is imported only here."""
    from convoy.cluster import ClusterJob, run_cluster_batch

    cluster = ClusterJob(
        job, args.ray, args.shard_lines or _SHARD_LINES, args.replicas or 1, args.replica_cpus,
        args.fake_engine,
    )  # fmt: skip
    return run_cluster_batch(cluster)


def main(argv: list[str] | None = None) -> None:
    try:
        _main(argv)
    finally:
        # NOTE: at exit the interpreter's collector walks every object torch, transformers and
        # the model made (2.7 s of each `convoy` command on a 2-core host); frozen, it skips them.
        # The server freezes once its engine is up, which also keeps its full collections short.
        gc.freeze()


def _main(argv: list[str] | None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        on_ray = args.ray is not None or (args.replicas or 1) > 1
        if args.replica_cpus is not None and not on_ray:
            parser.error("--replica-cpus needs --replicas or --ray")
        if on_ray:
            _serve_replicas(args, _settings(args, parser))
        else:
            _serve(_settings(args, parser))
    elif args.command == "batch":
        given = [f for f in _CLUSTER_FLAGS if getattr(args, f) is not None]
        if args.ray is None and given:
            parser.error(f"--{given[0].replace('_', '-')} needs --ray")
        _batch(args, _settings(args, parser))
    else:
        _generate(args)


if __name__ == "__main__":
    main()
