"""Chat messages (and tools) -> the text the chat template makes of them.

A template with its own tool support in the `<tool_call>` format (it mentions `tools` and
`<tool_call>`, as Qwen 2.5 / 3 and Hermes templates do) gets the tools as `tools=` and the
history in Hugging Face's shape (assistant `tool_calls` with their arguments as objects,
`role: "tool"` messages). Any other template (SmolLM2's and Gemma 3's among them) gets the
generic rendering of tool_format: the tools section in the system message, assistant calls
written out as the model writes them, and tool results as a user turn of `<tool_response>`
blocks. Either way the model is asked for the format that tools_grammar constrains and
parse_tool_calls reads.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from convoy.api.protocol_tools import ChatMessageParam
from convoy.api.tool_format import (
    CALL_SEPARATOR,
    OPEN,
    call_text,
    tool_response_text,
    tools_prompt,
)

if TYPE_CHECKING:
    from convoy.engine.tokenizer import Tokenizer


def has_tool_support(template: str | None) -> bool:
    """Does the template render tools itself, in the `<tool_call>` format?"""
    return template is not None and "tools" in template and OPEN in template


def apply_template(
    tokenizer: Tokenizer,
    messages: list[ChatMessageParam],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of `messages` (TemplateError -> 400); `tools` as tools_for_prompt()
    gives them."""
    if has_tool_support(tokenizer.chat_template):
        native = [_native(m) for m in messages]
        return tokenizer.apply_chat_template(native, add_generation_prompt, tools=tools or None)
    return tokenizer.apply_chat_template(_generic(messages, tools), add_generation_prompt)


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
