"""Wire types of the info routes: /v1/models, /tokenize and /detokenize (vLLM's shapes)."""

from __future__ import annotations

from typing import Any, Literal

from convoy.api.protocol_base import OpenAIModel, RequestModel
from convoy.api.protocol_common import TokenId
from convoy.api.protocol_tools import ChatMessageParam


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "convoy"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    """vLLM's shape: either `prompt` (completions) or `messages` (chat template applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # as chat's (messages only)
    continue_final_message: bool = False  # as chat's (messages only)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    return_token_strs: bool = False


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIModel):
    prompt: str
