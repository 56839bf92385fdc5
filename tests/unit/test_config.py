"""The config dataclasses are the one source of defaults; the CLI flags are generated from them."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from convoy.cli import build_parser, parse_serve_args
from convoy.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    ServerConfig,
    format_size,
    leaf_fields,
    parse_size,
)


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVOY_API_KEY", raising=False)


def _flags(subcommand: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {opt for a in sub.choices[subcommand]._actions for opt in a.option_strings}


def test_server_config_holds_the_engine_config() -> None:
    assert ServerConfig().engine == EngineConfig()


def test_every_leaf_field_has_a_flag() -> None:
    flags = _flags("serve")
    for leaf in leaf_fields(ServerConfig):
        assert "--" + leaf.name.replace("_", "-") in flags, leaf.name
        assert leaf.help, f"{leaf.name} has no help"
    engine_flags = _flags("generate")
    for leaf in leaf_fields(EngineConfig):
        assert "--" + leaf.name.replace("_", "-") in engine_flags, leaf.name


def test_flag_defaults_are_the_dataclass_defaults() -> None:
    assert parse_serve_args([]) == ServerConfig()
    args = build_parser().parse_args(["serve"])
    for leaf in leaf_fields(ServerConfig):
        assert getattr(args, leaf.name) == leaf.default, leaf.name


def test_historical_flag_names_still_parse() -> None:
    s = parse_serve_args(
        [
            "tiny",
            "--dtype=float32",
            "--device=cpu",
            "--served-model-name=m",
            "--api-key=k",
            "--max-num-seqs=3",
            "--max-num-batched-tokens=64",
            "--max-model-len=128",
            "--kv-cache-memory=1GiB",
            "--max-prompts-per-request=5",
            "--max-seqs-per-request=7",
            "--max-queue-seqs=9",
            "--max-request-bytes=1MiB",
            "--log-level=debug",
            "--host=0.0.0.0",
            "--port=9000",
        ]
    )
    assert s.engine.model == "tiny" and s.engine.dtype == "float32" and s.engine.device == "cpu"
    assert s.engine.scheduler == SchedulerConfig(3, 64, 128)
    assert s.engine.cache.kv_cache_memory == 1 << 30
    assert (s.served_model_name, s.api_key, s.max_prompts_per_request) == ("m", "k", 5)
    assert (s.max_seqs_per_request, s.max_queue_seqs) == (7, 9)
    assert (s.max_request_bytes, s.log_level) == (1 << 20, "debug")
    assert (s.host, s.port) == ("0.0.0.0", 9000)
    assert parse_serve_args(["--model", "other"]).engine.model == "other"


def test_new_flags_land_in_their_sub_config() -> None:
    s = parse_serve_args(
        [
            "--block-size",
            "8",
            "--no-enable-prefix-caching",
            "--kv-cache-memory",
            "512MiB",
            "--num-kv-blocks",
            "100",
            "--no-prepack-linears",
            "--no-cpu-kernels",
        ]
    )
    assert s.engine.cache == CacheConfig(
        block_size=8, kv_cache_memory=512 << 20, num_kv_blocks=100, enable_prefix_caching=False
    )
    assert not s.engine.prepack_linears and not s.engine.cpu_kernels
    assert s.engine.scheduler == SchedulerConfig()


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVOY_API_KEY", "secret")
    assert parse_serve_args([]).api_key == "secret"
    assert parse_serve_args(["--api-key", "flag"]).api_key == "flag"


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-num-seqs", "0"],
        ["--block-size", "-1"],
        ["--kv-cache-memory", "lots"],
        ["--dtype", "float16"],
        ["--device", "tpu"],
        ["--log-level", "loud"],
        ["--port", "99999999"],
        ["--max-queue-seqs", "100"],  # below --max-seqs-per-request's default
    ],
)
def test_bad_flags_exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_serve_args(argv)
    assert "error" in capsys.readouterr().err


def test_from_kwargs() -> None:
    config = EngineConfig.from_kwargs(
        model="m", dtype="bf16", block_size=8, max_num_seqs=4, cpu_kernels=False
    )
    assert config.model == "m" and config.dtype == "bf16" and not config.cpu_kernels
    assert config.cache == CacheConfig(block_size=8)
    assert config.scheduler == SchedulerConfig(max_num_seqs=4)
    assert EngineConfig.from_kwargs() == EngineConfig()
    server = ServerConfig.from_kwargs(
        max_seqs_per_request=3, max_queue_seqs=3, enable_prefix_caching=False
    )
    assert server.max_queue_seqs == 3 and not server.engine.cache.enable_prefix_caching
    with pytest.raises(TypeError, match="num_blocks"):
        EngineConfig.from_kwargs(num_blocks=4)
    with pytest.raises(TypeError, match="seed"):
        EngineConfig.from_kwargs(seed=0)


def test_leaf_names_unique_and_validation() -> None:
    names = [leaf.name for leaf in leaf_fields(ServerConfig)]
    assert len(names) == len(set(names))
    assert "seed" not in {f.name for f in dataclasses.fields(EngineConfig)}
    with pytest.raises(ConfigError):
        CacheConfig(num_kv_blocks=0)
    with pytest.raises(ConfigError):
        EngineConfig(device="tpu")
    with pytest.raises(ConfigError):
        ServerConfig(max_request_bytes=0)


def test_queue_bound_holds_at_least_one_request() -> None:
    defaults = ServerConfig()
    assert (defaults.max_seqs_per_request, defaults.max_queue_seqs) == (4096, 8192)
    ServerConfig(max_seqs_per_request=8, max_queue_seqs=8)
    with pytest.raises(ConfigError, match="max_queue_seqs"):
        ServerConfig(max_seqs_per_request=8, max_queue_seqs=7)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 << 30),
        ("512MiB", 512 << 20),
        ("512mib", 512 << 20),
        ("1.5G", 1_500_000_000),
        ("64k", 64_000),
        ("1000000", 1_000_000),
        (" 3 KiB ", 3 << 10),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "2TiB", "-1", "two"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


def test_format_size() -> None:
    assert [format_size(n) for n in (2 << 30, 32 << 20, 3 << 10, 1000, 0)] == [
        "2GiB",
        "32MiB",
        "3KiB",
        "1000",
        "0",
    ]
    assert parse_size(format_size(32 << 20)) == 32 << 20
