"""Convoy: an OpenAI-compatible LLM server built around continuous batching."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from convoy.llm import LLM
    from convoy.outputs import CompletionOutput, FinishReason, RequestOutput
    from convoy.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "FinishReason",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
__version__ = "0.1.0"

# NOTE: imported on first use (PEP 562): `convoy.llm` pulls in torch and transformers (~4 s on a
# 2-core host), which the command line's argument checks and `--help` do not need.
_HOMES = {
    "LLM": "convoy.llm",
    "CompletionOutput": "convoy.outputs",
    "FinishReason": "convoy.outputs",
    "RequestOutput": "convoy.outputs",
    "RequestOutputKind": "convoy.sampling_params",
    "SamplingParams": "convoy.sampling_params",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'convoy' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
