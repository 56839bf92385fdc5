"""SamplingParams: how one prompt is continued. Validated on construction.

The list bounds below exist because stop strings, stop token ids and biases are scanned per token
per sequence: an unbounded list in one request would slow every step of every other request.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from convoy.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16  # OpenAI allows 4; eval harnesses send vLLM more
MAX_STOP_CHARS = 1024  # per stop string; a stream holds back this many characters at most
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range: [-100, 100]
MAX_PREDICTION_TOKENS = 32768  # predicted output, searched when drafting after a miss
MAX_REPETITION_PENALTY = 2.0  # (0, 2]: above 2 a repeated token is all but banned already


class SamplingParamsError(ValueError):
    """A sampling value is out of range; `param` names the OpenAI request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Pooling(enum.Enum):
    """How an embedding request reduces its prompt's final hidden states to one vector."""

    LAST = "last"  # the last prompt token's (what decoder-only embedding models are trained for)
    MEAN = "mean"  # the mean over every prompt token


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every output carries the whole text so far
    DELTA = "delta"  # every output carries only what is new (streaming)
    FINAL_ONLY = "final_only"  # one output, when the request ends


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # generate best_of, return the n with the highest cumulative logprob
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per generated token (the sampled one always too)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (echo / scoring)
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Prefix-cache isolation: only requests with the same salt share cached prompt blocks.
    cache_salt: str | None = None
    # What the output must match (a JSON schema, regex, choice, grammar); None = free text.
    structured_outputs: StructuredOutputsParams | None = None
    # Embeddings: compute the prompt only (max_tokens 0), no logits, and return its final hidden
    # states pooled this way and L2-normalised (RequestOutput.embedding); None = generate.
    pooling: Pooling | None = None
    # Predicted output (OpenAI's `prediction`), as token ids: drafts for speculative decoding
    # (never changes what is generated, only how fast); None = none
    prediction: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    @property
    def num_seqs(self) -> int:
        """Sequences generated for one prompt: best_of when set, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    def _validate(self) -> None:
        for name in _FLOAT_FIELDS:
            _check(math.isfinite(getattr(self, name)), f"{name} must be a finite number", name)
        _check(self.n >= 1, "n must be at least 1", "n")
        if self.best_of is not None:
            _check(self.best_of >= self.n, "best_of must be greater than or equal to n", "best_of")
        _check(self.temperature >= 0, "temperature must be non-negative", "temperature")
        _check(0 < self.top_p <= 1, "top_p must be in (0, 1]", "top_p")
        _check(self.top_k >= 0, "top_k must be -1 (off) or a positive integer", "top_k")
        _check(0 <= self.min_p <= 1, "min_p must be in [0, 1]", "min_p")
        _check(
            -2 <= self.presence_penalty <= 2,
            "presence_penalty must be in [-2, 2]",
            "presence_penalty",
        )
        _check(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty must be in [-2, 2]",
            "frequency_penalty",
        )
        _check(
            0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
            f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]",
            "repetition_penalty",
        )
        self._validate_lists()
        if self.max_tokens is not None:
            _check(self.max_tokens >= 0, "max_tokens must be non-negative", "max_tokens")
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens must not exceed max_tokens",
                "min_tokens",
            )
        _check(self.min_tokens >= 0, "min_tokens must be non-negative", "min_tokens")
        if self.pooling is not None:
            _check(
                self.max_tokens == 0 and self.num_seqs == 1 and self.prompt_logprobs is None,
                "an embedding request computes its prompt only (max_tokens 0, one sequence)",
                "max_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(0 <= value <= MAX_LOGPROBS, f"{name} must be in [0, {MAX_LOGPROBS}]", name)

    def _validate_lists(self) -> None:
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            f"stop may hold at most {MAX_STOP_STRINGS} strings",
            "stop",
        )
        _check(
            all(len(s) <= MAX_STOP_CHARS for s in self.stop),
            f"each stop string may be at most {MAX_STOP_CHARS} characters",
            "stop",
        )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids",
            "stop_token_ids",
        )
        _check(
            self.prediction is None or len(self.prediction) <= MAX_PREDICTION_TOKENS,
            f"prediction may hold at most {MAX_PREDICTION_TOKENS} tokens",
            "prediction",
        )
        bias = self.logit_bias or {}
        _check(
            len(bias) <= MAX_LOGIT_BIAS,
            f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries",
            "logit_bias",
        )
        for token_id, value in bias.items():
            _check(
                -MAX_LOGIT_BIAS_VALUE <= value <= MAX_LOGIT_BIAS_VALUE,  # also rejects NaN
                f"logit_bias for {token_id} must be in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}]",
                "logit_bias",
            )


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise SamplingParamsError(message, param)
