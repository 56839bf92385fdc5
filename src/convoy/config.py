"""Configuration dataclasses: the single source of every engine and server setting.

Defaults live only in the dataclass fields below. Each field's `metadata` carries its command-line
help (and, where needed, a parser `kind` and `choices`); cli.py generates the `convoy serve` and
`convoy generate` flags from them, and `from_kwargs` builds a nested config from flat leaf names
(`EngineConfig.from_kwargs(block_size=8)`). Validation lives here too.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self


class ConfigError(ValueError):
    """A configuration value is missing or out of range."""


_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_size(text: str | int) -> int:
    """Bytes from "2GiB", "512MiB", "1.5G" or a plain number of bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmg]i?)?b?\s*", text.lower())
    if match is None:
        raise ConfigError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])


def format_size(num_bytes: int) -> str:
    """The shortest exact binary form: 2 << 30 -> "2GiB", 32 << 20 -> "32MiB", 1000 -> "1000"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return str(num_bytes)


def setting(
    default: Any, help: str, *, kind: str | None = None, choices: Sequence[str] | None = None
) -> Any:
    """A config field with its command-line metadata.

    kind: "size" (bytes, parsed by parse_size) or "positive" (an int > 0, checked on construction).
    Other fields parse by their annotated type; bools become --flag/--no-flag.
    """
    meta = {"help": help, "kind": kind, "choices": tuple(choices) if choices else None}
    return field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class ConfigField:
    """One leaf setting of a (possibly nested) config dataclass, as the CLI generator sees it."""

    name: str  # unique across the nested configs: also the flat keyword and the --flag name
    type: type  # int, str or bool (Optional stripped)
    default: Any
    help: str
    kind: str | None
    choices: tuple[str, ...] | None


def _is_config(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


_LEAVES: dict[type, tuple[ConfigField, ...]] = {}


def leaf_fields(cls: type) -> tuple[ConfigField, ...]:
    """The leaf settings of a config dataclass, depth first (nested configs are flattened)."""
    if cls not in _LEAVES:
        leaves: list[ConfigField] = []
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if _is_config(hint):
                leaves.extend(leaf_fields(hint))
                continue
            args = typing.get_args(hint)
            base = next((a for a in args if a is not type(None)), hint)
            factory: Any = f.default_factory
            default = factory() if f.default is dataclasses.MISSING else f.default
            leaves.append(
                ConfigField(
                    f.name,
                    base,
                    default,
                    f.metadata.get("help", ""),
                    f.metadata.get("kind"),
                    f.metadata.get("choices"),
                )
            )
        names = [leaf.name for leaf in leaves]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise TypeError(f"{cls.__name__}: leaf field names must be unique, repeated: {dupes}")
        _LEAVES[cls] = tuple(leaves)
    return _LEAVES[cls]


def _build(cls: type, flat: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if _is_config(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], flat)
        elif f.name in flat:
            kwargs[f.name] = flat[f.name]
    return cls(**kwargs)


class _Config:
    """Shared behaviour of the nested config dataclasses: flat construction, range checks."""

    __slots__ = ()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> Self:
        """Build from flat leaf names, e.g. `EngineConfig.from_kwargs(block_size=8, dtype="bf16")`;
        each goes to the sub-config that declares it, the rest keep their defaults."""
        unknown = sorted(set(kwargs) - {leaf.name for leaf in leaf_fields(cls)})
        if unknown:
            raise TypeError(f"{cls.__name__}: unknown setting(s) {', '.join(unknown)}")
        result: Self = _build(cls, kwargs)
        return result

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.metadata.get("kind") in ("positive", "size") and value is not None and value <= 0:
                raise ConfigError(f"{f.name} must be positive, got {value}")
        self._validate()

    def _validate(self) -> None:
        """Checks beyond positivity; overridden where needed."""


DTYPES = ("auto", "float32", "bfloat16")
_DTYPE_ALIASES = ("fp32", "bf16")
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")
POOLINGS = ("auto", "last", "mean")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
SPECULATIVE_MODES = ("auto", "off", "ngram")
REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek_r1")


@dataclass(slots=True)
class CacheConfig(_Config):
    block_size: int = setting(16, "tokens per KV-cache block", kind="positive")
    kv_cache_memory: int | None = setting(
        None,
        "KV pool budget (512MiB, 2GiB, or bytes); the block pool is sized from it (default:"
        " half the memory left after the weights, 64MiB to 2GiB; the log says what it chose)",
        kind="size",
    )
    num_kv_blocks: int | None = setting(
        None,
        "KV blocks in the pool, overriding --kv-cache-memory (default: from the budget)",
        kind="positive",
    )
    enable_prefix_caching: bool = setting(
        True, "reuse the KV blocks of prompt prefixes shared between requests"
    )
    kv_cache_dtype: str = setting(
        "auto",
        "K/V storage dtype (auto: float16 in a quantized mode, else the model's); bfloat16 or"
        " float16 under fp32 activations halve the bytes per cached token, computing in fp32",
        choices=KV_CACHE_DTYPES,
    )

    def _validate(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"unsupported kv_cache_dtype {self.kv_cache_dtype!r}")


@dataclass(slots=True)
class SchedulerConfig(_Config):
    max_num_seqs: int = setting(256, "sequences in one engine step", kind="positive")
    max_num_batched_tokens: int = setting(
        2048, "tokens in one engine step (prefill chunks + decodes)", kind="positive"
    )
    max_model_len: int | None = setting(
        None, "longest prompt + completion (default: the model's context length)", kind="positive"
    )
    step_target_ms: float = setting(
        0.0,
        "latency over throughput (0: off): when a step of every running sequence is measured"
        " to take longer than this, a new request's prompt runs in a step of its own (never two"
        " in a row) and decode steps are cut to fewer rows, taken in turn, where that costs at"
        " most ~15% more per row, so a new request gets its first token sooner beside many"
        " streams (150 measured: TTFT beside 256 fp32 streams 4.8x idle instead of 11-15x;"
        " 0.89-0.95x the tokens a second at 64 streams of a 1B file)",
    )
    side_step_ms: float = setting(
        100.0,
        "a new request that finds a step in flight with at least this long left (extrapolated"
        " from its layers so far) runs its prompt in a side step between two of that step's"
        " layers, one a step, if the whole prompt fits a step and free KV blocks; so its first"
        " token does not wait for the step (0: off; the server only)",
    )
    batch_max_seqs: int = setting(
        64,
        "most Batch API sequences in one step, interactive traffic or not: it bounds the step"
        " an interactive request can find in flight (batch steps also carry at most"
        " --batch-share of --max-num-batched-tokens in prompt chunks)",
        kind="positive",
    )
    batch_share: float = setting(
        0.25,
        "share of --batch-max-seqs that Batch API lines keep while interactive requests wait or"
        " run (with as many prompt tokens a step); their other running sequences pause",
    )
    speculative: str = setting(
        "auto",
        "speculative decoding without a draft model, from a request's `prediction` and by"
        " prompt lookup: auto runs a draft token only when its chance of being kept beats what"
        " one more row costs the step (measured), ngram always drafts, off never does (and"
        " ignores `prediction`)",
        choices=SPECULATIVE_MODES,
    )
    num_speculative_tokens: int = setting(
        16, "most draft tokens a sequence verifies in one step", kind="positive"
    )
    prompt_lookup_min: int = setting(
        1, "shortest suffix n-gram prompt lookup matches", kind="positive"
    )
    prompt_lookup_max: int = setting(
        4,
        "longest suffix n-gram prompt lookup matches (it tries the longest first)",
        kind="positive",
    )
    batch_grace: float = setting(
        2.0,
        "seconds after the last interactive request during which Batch API lines keep only"
        " their share, so the next request of a conversation finds a short step in flight",
    )

    def _validate(self) -> None:
        if self.speculative not in SPECULATIVE_MODES:
            raise ConfigError(f"unsupported speculative mode {self.speculative!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError("prompt_lookup_min must not exceed prompt_lookup_max")
        if not 0 < self.batch_share <= 1:
            raise ConfigError(f"batch_share must be in (0, 1], got {self.batch_share}")
        if not 0 <= self.step_target_ms < math.inf:
            raise ConfigError(
                f"step_target_ms must be a finite number >= 0, got {self.step_target_ms}"
            )
        if not 0 <= self.side_step_ms < math.inf:
            raise ConfigError(f"side_step_ms must be a finite number >= 0, got {self.side_step_ms}")
        if not 0 <= self.batch_grace < math.inf:
            raise ConfigError(f"batch_grace must be a finite number >= 0, got {self.batch_grace}")


@dataclass(slots=True)
class EngineConfig(_Config):
    model: str | None = setting(
        None, "short name, .gguf file or HF folder (default: smollm2-135m-instruct)"
    )
    dtype: str = setting(
        "auto",
        "weights and activations; auto: fp32 activations over quantized weights for a GGUF file"
        " on the CPU, else bf16 on CUDA and AVX512-BF16 CPUs, else fp32",
        choices=DTYPES,
    )
    device: str = setting("auto", "auto, cpu, cuda or cuda:N")
    prepack_linears: bool = setting(
        True,
        "CPU: prepack linear weights once (fp32: Convoy's kernel; bf16: Convoy's kernel without "
        "native bf16, oneDNN with it)",
    )
    cpu_kernels: bool = setting(
        True,
        "CPU: decode attention by Convoy's compiled kernel (the torch path if it is not built)",
    )
    quantization: str = setting(
        "auto",
        "CPU linear weights: gguf keeps a GGUF file's blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/"
        "Q6_K; others dequantized), int8/int4 quantize bf16/fp32 weights at load, none dequantizes;"
        " auto: gguf for a GGUF file in dtype auto, else none",
        choices=QUANTIZATIONS,
    )
    pooling: str = setting(
        "auto",
        "/v1/embeddings: the prompt's final hidden states pooled by its last token or their mean,"
        " then L2-normalised; auto: the GGUF's pooling type where the file names mean or last,"
        " else last",
        choices=POOLINGS,
    )
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def _validate(self) -> None:
        if self.dtype not in DTYPES + _DTYPE_ALIASES:
            raise ConfigError(f"unsupported dtype {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"unsupported device {self.device!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"unsupported quantization {self.quantization!r}")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"unsupported pooling {self.pooling!r}")


@dataclass(slots=True)
class ServerConfig(_Config):
    """Everything `convoy serve` configures."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = setting(
        None, "the `model` name clients send; others answer 404 (default: the model's name)"
    )
    api_key: str | None = setting(
        None,
        "require `Authorization: Bearer KEY` on every route but /health (default: $CONVOY_API_KEY)",
    )
    max_prompts_per_request: int = setting(
        1024, "longest `prompt` list in one request (more: 400)", kind="positive"
    )
    max_seqs_per_request: int = setting(
        4096,
        "most sequences one request may start: prompts x max(n, best_of) (more: 400 naming n)",
        kind="positive",
    )
    max_queue_seqs: int = setting(
        8192,
        "sequences admitted and not finished, all requests together; a request that would pass"
        " it answers 429 with Retry-After (at least --max-seqs-per-request)",
        kind="positive",
    )
    max_logprobs_in_flight: int = setting(
        1_000_000,
        "logprob entries the responses that are not streamed may hold at once (each costs a few"
        " KB until it is sent): a request that could hold more answers 400, one that would pass"
        " it beside those in flight 429 with Retry-After; streams are not counted",
        kind="positive",
    )
    max_request_bytes: int = setting(32 << 20, "larger request bodies answer 413", kind="size")
    request_body_timeout: int = setting(
        60,
        "seconds a request body may send no bytes before the server answers 408 and closes the"
        " connection",
        kind="positive",
    )
    data_dir: str | None = setting(
        None,
        "folder for /v1/files and /v1/batches state (default: $CONVOY_DATA_DIR, else"
        " ~/.local/share/convoy); one server per folder",
    )
    max_file_bytes: int = setting(
        200 << 20, "largest upload to /v1/files (larger: 413)", kind="size"
    )
    batch_window: int = setting(
        86400,
        "seconds a batch may run before it expires (what completion_window '24h' means here;"
        " shorter for tests)",
        kind="positive",
    )
    batch_retention: int | None = setting(
        None,
        "seconds a finished batch's output and error files are kept before they are deleted"
        " (default: until deleted, as OpenAI; a batch's output_expires_after overrides it)",
        kind="positive",
    )
    reasoning_parser: str = setting(
        "auto",
        "split a reasoning model's <think> block from its replies (chat reasoning_content, a"
        " Responses reasoning item); auto: when the chat template mentions <think>; qwen3: a"
        " block the reply opens; deepseek_r1: the reply starts in one; none: never",
        choices=REASONING_PARSERS,
    )
    log_level: str = setting(
        "info", "server log level (info: one line per request)", choices=LOG_LEVELS
    )

    def _validate(self) -> None:
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"unsupported reasoning_parser {self.reasoning_parser!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queue_seqs < self.max_seqs_per_request:  # else a valid request never fits
            raise ConfigError(
                f"max_queue_seqs ({self.max_queue_seqs}) must be at least max_seqs_per_request"
                f" ({self.max_seqs_per_request})"
            )
