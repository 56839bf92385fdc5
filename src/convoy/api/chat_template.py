"""Chat messages (and tools) -> the text the chat template makes of them.

A template with its own tool support in the `<tool_call>` format (it mentions `tools` and
`<tool_call>`, as Qwen 2.5 / 3 and Hermes templates do) gets the tools as `tools=` and the
history in Hugging Face's shape (assistant `tool_calls` with their arguments as objects,
`role: "tool"` messages). Any other template (SmolLM2's and Gemma 3's among them) gets the
generic rendering of tool_format: the tools section in the system message, assistant calls
written out as the model writes them, and tool results as a user turn of `<tool_response>`
blocks. Either way the model is asked for the format that tools_grammar constrains and
parse_tool_calls reads.

An assistant message's `reasoning_content` (or `reasoning`) reaches a native template as
`reasoning_content` (Qwen3's renders it within the turn still calling tools); the generic path
drops it.

`chat_template_kwargs` (vLLM's field: more variables for the template, e.g. Qwen3's
`enable_thinking`) reach the template on both paths; names the render itself sets (the
messages, tools, add_generation_prompt, the special tokens, the template's helpers) are refused
by `check_template_kwargs`, as is a key that is no template name or an oversized value.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from convoy.api.protocol_tools import ChatMessageParam
from convoy.api.tool_format import (
    CALL_SEPARATOR,
    OPEN,
    call_text,
    tool_response_text,
    tools_prompt,
)
from convoy.sampling_params import SamplingParamsError

if TYPE_CHECKING:
    from convoy.engine.tokenizer import Tokenizer


TEMPLATE_KWARGS_PARAM = "chat_template_kwargs"
MAX_TEMPLATE_KWARGS = 32  # keys
MAX_TEMPLATE_KWARGS_BYTES = 16 << 10  # all values, as compact JSON
# What the render sets itself: transformers' apply_chat_template arguments, the tokenizer's
# special tokens, the helpers templates call. A client's value would replace them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
    "cls_token", "mask_token", "additional_special_tokens", "raise_exception", "strftime_now",
})  # fmt: skip
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """400 naming `chat_template_kwargs.<key>` (or the field) for what the render must refuse."""
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise SamplingParamsError(
            f"at most {MAX_TEMPLATE_KWARGS} chat_template_kwargs are allowed", TEMPLATE_KWARGS_PARAM
        )
    for key in kwargs:
        param = f"{TEMPLATE_KWARGS_PARAM}.{key}"
        if not _NAME.fullmatch(key):
            raise SamplingParamsError(f"{key[:64]!r} is not a template variable name", param)
        if key in RESERVED_TEMPLATE_KWARGS:
            raise SamplingParamsError(f"{key!r} is set by the server, not by the request", param)
    try:
        size = len(json.dumps(kwargs, separators=(",", ":")).encode())
    except (ValueError, RecursionError):
        size = MAX_TEMPLATE_KWARGS_BYTES + 1
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise SamplingParamsError(
            f"chat_template_kwargs is larger than {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON",
            TEMPLATE_KWARGS_PARAM,
        )


def has_tool_support(template: str | None) -> bool:
    """Does the template render tools itself, in the `<tool_call>` format?"""
    return template is not None and "tools" in template and OPEN in template


def check_continuation(continue_final: bool | None, add_generation_prompt: bool | None) -> None:
    """vLLM's rule: a prompt cannot both end inside the last message and open a new turn."""
    if continue_final and add_generation_prompt is not False:
        raise SamplingParamsError(
            "continue_final_message needs add_generation_prompt false", "continue_final_message"
        )


def apply_template(
    tokenizer: Tokenizer,
    messages: list[ChatMessageParam],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> str:
    """The prompt text of `messages` (TemplateError -> 400); `tools` as tools_for_prompt()
    gives them; `template_kwargs` checked by check_template_kwargs; `continue_final_message`:
    the text ends inside the last message."""
    if has_tool_support(tokenizer.chat_template):
        native = [_native(m) for m in messages]
        return tokenizer.apply_chat_template(
            native, add_generation_prompt, tools=tools or None, template_kwargs=template_kwargs,
            continue_final_message=continue_final_message,
        )  # fmt: skip
    generic = _generic(messages, tools)
    return tokenizer.apply_chat_template(
        generic, add_generation_prompt, template_kwargs=template_kwargs,
        continue_final_message=continue_final_message,
    )  # fmt: skip


def _role(message: ChatMessageParam) -> str:
    return "system" if message.role == "developer" else message.role


def _native(message: ChatMessageParam) -> dict[str, Any]:
    out: dict[str, Any] = {"role": _role(message), "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in message.tool_calls
        ]  # fmt: skip
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning_content or message.reasoning
    if reasoning and message.role == "assistant":
        out["reasoning_content"] = reasoning  # Qwen3's template reads this name
    return out


def _arguments(text: str) -> Any:
    """Arguments as templates expect them: the JSON object, or the text if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _generic(
    messages: list[ChatMessageParam], tools: list[dict[str, Any]] | None
) -> list[dict[str, str]]:
    """Plain role/content messages: tool results folded into user turns, calls into text."""
    out: list[dict[str, str]] = []
    results: list[str] = []  # consecutive tool results, handed back in one user turn
    for m in messages:
        if m.role == "tool":
            results.append(m.text())
            continue
        if results:
            out.append({"role": "user", "content": tool_response_text(results)})
            results = []
        text = m.text()
        if m.tool_calls:
            calls = CALL_SEPARATOR.join(
                call_text(c.function.name, c.function.arguments) for c in m.tool_calls
            )
            text = f"{text}\n{calls}" if text else calls
        out.append({"role": _role(m), "content": text})
    if results:
        out.append({"role": "user", "content": tool_response_text(results)})
    if tools:
        section = tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}"
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
