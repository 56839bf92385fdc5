"""Convoy: an OpenAI-compatible LLM server built around continuous batching."""

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
