"""Wire types of /v1/responses: the request, and its translation into a chat request.

A Responses request runs as a chat completion (serving_responses.py): `input` items become chat
messages (function_call items an assistant message's tool_calls, function_call_output items tool
messages), `instructions` a system message first, the flat function tools chat's nested ones,
`text.format` chat's response_format. Fields that would change the output and cannot be honoured
are a 400 naming them (`check_supported`). `reasoning.effort` turns a thinking model's thinking
off (`none`, `minimal`) or on (the others) through chat_template_kwargs' enable_thinking;
a reasoning item in `input` (a previous turn's output) becomes the reasoning_content of the
assistant turn after it, which a thinking template renders or drops as it does its own.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any, Literal

from pydantic import Field

from convoy.api.protocol_base import OpenAIModel, RequestModel
from convoy.api.protocol_chat import ChatCompletionRequest
from convoy.api.protocol_common import MAX_INT32
from convoy.api.reasoning import effort_thinks
from convoy.sampling_params import MAX_LOGPROBS, SamplingParamsError

Item = dict[str, Any]
_TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"
ENCRYPTED_REASONING = "reasoning.encrypted_content"
# OpenAI's `include` values: these two are honoured; the others name parts of items this server
# never makes (built-in tools' calls, input images: refused where asked for), so nothing is added
_INCLUDABLE = {LOGPROBS, ENCRYPTED_REASONING, "file_search_call.results",
               "web_search_call.results", "web_search_call.action.sources",
               "message.input_image.image_url", "computer_call_output.output.image_url",
               "code_interpreter_call.outputs"}  # fmt: skip
# A reasoning item's `encrypted_content` here: its text, base64 after this tag. Not encrypted
# (the item's content already shows the text); it lets a client that keeps no server state
# (`store: false`) send the reasoning back as OpenAI's clients do.
_SEALED = "convoy-reasoning:"


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[Item] = Field(default="")
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[Item] | None = None
    tool_choice: str | Item | None = None
    parallel_tool_calls: bool | None = True
    text: Item | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    stream: bool | None = False
    reasoning: Item | None = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    conversation: str | Item | None = None
    prompt: Item | None = None  # a stored prompt template: none are stored here (a 400)
    truncation: Literal["auto", "disabled"] | None = None

    def check_supported(self) -> None:
        """400 naming each field this server cannot honour."""
        if self.conversation is not None:  # ignored, a client would think its turns were kept
            raise SamplingParamsError(
                "conversation is not supported (there is no Conversations API here); chain"
                " responses with previous_response_id",
                "conversation",
            )
        if self.prompt is not None:  # ignored, the reply would answer an empty input
            raise SamplingParamsError(
                "prompt (a stored prompt template) is not supported; send its text as"
                " instructions and input",
                "prompt",
            )
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise SamplingParamsError(
                    f"tool type {tool.get('type')!r} is not supported; only function tools are",
                    f"tools[{i}].type",
                )
        if (self.reasoning or {}).get("summary") is not None:
            raise SamplingParamsError(
                "reasoning summaries are not supported (the reasoning item carries the text)",
                "reasoning.summary",
            )
        if self.background and self.store is False:
            raise SamplingParamsError("a background response must be stored", "store")
        if self.background and self.stream:
            raise SamplingParamsError("a background response cannot be streamed", "stream")
        for value in self.include or []:
            if value not in _INCLUDABLE:
                raise SamplingParamsError(f"include value {value!r} is not supported", "include")

    def wants_logprobs(self) -> bool:
        """`include` asks for the message text's logprobs (`top_logprobs` alone does not, as in
        OpenAI's API: it sets how many alternatives each token lists)."""
        return LOGPROBS in (self.include or [])

    def wants_encrypted_reasoning(self) -> bool:
        return ENCRYPTED_REASONING in (self.include or [])

    def thinking(self) -> bool | None:
        """`reasoning.effort` as enable_thinking (None when not set)."""
        effort = (self.reasoning or {}).get("effort")
        if effort is None:
            return None
        return effort_thinks(effort, "reasoning.effort")

    def input_items(self) -> list[Item]:
        """`input` as normalised items, each with an id (as GET .../input_items lists them)."""
        if isinstance(self.input, str):
            return [_message_item("user", self.input)]
        return [_normalise(i, item) for i, item in enumerate(self.input)]

    def to_chat(self, items: list[Item], thinking: bool | None = None) -> ChatCompletionRequest:
        """The chat request that runs this one, over the whole conversation `items`;
        `thinking`: enable_thinking for the template, if set."""
        messages: list[Item] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages += items_to_messages(items)
        # logprobs: a whole response too runs as a stream (responses_stream.py)
        streamed = bool(self.stream) or self.wants_logprobs()
        body: Item = {"messages": messages, "stream": streamed}
        if streamed:
            body["stream_options"] = {"include_usage": True}
        for name in ("model", "temperature", "top_p", "user", "parallel_tool_calls"):
            if (value := getattr(self, name)) is not None:
                body[name] = value
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.wants_logprobs():
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        if self.tools:
            body["tools"] = [_chat_tool(t) for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if (fmt := (self.text or {}).get("format")) is not None:
            body["response_format"] = _chat_format(fmt)
        if thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": thinking}
        return ChatCompletionRequest.model_validate(body)

    def echo(self) -> Item:
        """The request fields the response object repeats."""
        fmt = (self.text or {}).get("format") or {"type": "text"}
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "tool_choice": self.tool_choice or "auto",
            "tools": [_echo_tool(t) for t in self.tools or []],
            "text": {"format": fmt},
            "user": self.user,
            "store": self.store is not False,
            "background": False,
            "reasoning": {"effort": (self.reasoning or {}).get("effort"), "summary": None},
            "truncation": self.truncation or "disabled",
            "top_logprobs": self.top_logprobs or 0,
        }


def _message_item(role: str, text: str) -> Item:
    kind = "output_text" if role == "assistant" else "input_text"
    part: Item = {"type": kind, "text": text}
    if role == "assistant":
        part["annotations"] = []
    return {"id": new_item_id("msg"), "type": "message", "role": role,
            "status": "completed", "content": [part]}  # fmt: skip


def _normalise(index: int, item: Item) -> Item:
    param = f"input[{index}]"
    item_id = item.get("id")
    if item_id is not None and not (isinstance(item_id, str) and 0 < len(item_id) <= 256):
        raise SamplingParamsError("an item id is a string of 1 to 256 characters", f"{param}.id")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise SamplingParamsError(f"unknown message role {role!r}", f"{param}.role")
        content = item.get("content")
        if isinstance(content, str):
            return {**_message_item(role, content), **({"id": item["id"]} if "id" in item else {})}
        if not isinstance(content, list):
            raise SamplingParamsError("content must be a string or a list of parts", param)
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                kind_name = part.get("type") if isinstance(part, dict) else part
                raise SamplingParamsError(
                    f"content part type {kind_name!r} is not supported; only text parts are",
                    f"{param}.content[{j}].type",
                )
        text = "\n".join(str(p.get("text") or "") for p in content)
        return {**_message_item(role, text), **({"id": item["id"]} if "id" in item else {})}
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise SamplingParamsError(f"a function_call item needs {key}", f"{param}.{key}")
        return {"id": item.get("id") or new_item_id("fc"), "type": "function_call",
                "call_id": item["call_id"], "name": item["name"],
                "arguments": item["arguments"], "status": "completed"}  # fmt: skip
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
            raise SamplingParamsError("a function_call_output needs call_id and output", param)
        return {"id": item.get("id") or new_item_id("fco"), "type": "function_call_output",
                "call_id": item["call_id"], "output": item["output"],
                "status": "completed"}  # fmt: skip
    if kind == "reasoning":
        return _reasoning_item(param, item)
    if kind == "item_reference":  # a stored item by its id: the serving puts it in its place
        if not isinstance(item_id, str):
            raise SamplingParamsError("an item_reference needs the item's id", f"{param}.id")
        return {"type": "item_reference", "id": item_id}
    raise SamplingParamsError(f"input item type {kind!r} is not supported", f"{param}.type")


def seal_reasoning(text: str) -> str:
    """A reasoning item's `encrypted_content` (include reasoning.encrypted_content)."""
    return _SEALED + base64.b64encode(text.encode()).decode()


def _unsealed(param: str, sealed: object) -> list[str]:
    """The reasoning text of an `encrypted_content` this server wrote; nothing from one it did
    not (another server's blob: the item adds no reasoning, as a reply without it)."""
    if not isinstance(sealed, str) or not sealed.startswith(_SEALED):
        return []
    try:
        return [base64.b64decode(sealed[len(_SEALED) :], validate=True).decode()]
    except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
        raise SamplingParamsError("encrypted_content does not decode",
                                  f"{param}.encrypted_content") from None  # fmt: skip


def _reasoning_item(param: str, item: Item) -> Item:
    """A reasoning item sent back (a previous output): its text parts kept (or, without them,
    the text its encrypted_content holds), nothing else."""
    content = item.get("content") or []
    if not isinstance(content, list) or not all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in content
    ):
        raise SamplingParamsError("a reasoning item's content is a list of text parts",
                                  f"{param}.content")  # fmt: skip
    if not isinstance(item.get("summary", []), list):
        raise SamplingParamsError("a reasoning item's summary is a list", f"{param}.summary")
    texts = [p["text"] for p in content] or _unsealed(param, item.get("encrypted_content"))
    parts = [{"type": "reasoning_text", "text": t} for t in texts]
    return {"id": item.get("id") or new_item_id("rs"), "type": "reasoning", "summary": [],
            "content": parts, "status": "completed"}  # fmt: skip


def items_to_messages(items: list[Item]) -> list[Item]:
    """Chat messages of normalised items; consecutive function calls share one assistant turn,
    and a reasoning item is the reasoning_content of the assistant turn that follows it."""
    messages: list[Item] = []
    reasoning: list[str] = []  # reasoning items waiting for their assistant turn
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning += [p["text"] for p in item["content"]]
            continue
        if kind == "message":
            text = "\n".join(p.get("text") or "" for p in item["content"])
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = "\n".join(reasoning)
        reasoning = []  # one not followed by its assistant turn is dropped
    return messages


def _chat_tool(tool: Item) -> Item:
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _echo_tool(tool: Item) -> Item:
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}  # fmt: skip


def _chat_tool_choice(choice: str | Item) -> str | Item:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "allowed_tools":  # its function tools, as chat names them
        tools = choice.get("tools")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise SamplingParamsError("allowed_tools lists tools", "tool_choice.tools")
        for i, tool in enumerate(tools):
            if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                raise SamplingParamsError("only function tools are supported",
                                          f"tool_choice.tools[{i}]")  # fmt: skip
        named = [{"type": "function", "function": {"name": t["name"]}} for t in tools]
        return {"type": "allowed_tools",
                "allowed_tools": {"mode": choice.get("mode"), "tools": named}}  # fmt: skip
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise SamplingParamsError("tool_choice must name a function", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _chat_format(fmt: Item) -> Item:
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise SamplingParamsError(f"text.format type {kind!r} is not supported", "text.format")


class InputTokenCount(OpenAIModel):
    """POST /v1/responses/input_tokens's answer."""

    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


class ResponseBody(OpenAIModel):
    """A response object (or event) built as a dict, sent as JSON as is."""

    model_config = {"extra": "allow"}
