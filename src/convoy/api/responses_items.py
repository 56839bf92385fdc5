"""The pieces of a response object: output items, content parts, usage, a finished chat
completion recast as output (serving_responses.py, responses_background.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from convoy.api.errors import APIError
from convoy.api.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from convoy.api.protocol_common import UsageInfo
from convoy.api.protocol_responses import Item, new_item_id, seal_reasoning
from convoy.api.reasoning import ThinkStart
from convoy.api.tool_format import is_complete
from convoy.sampling_params import SamplingParamsError
from convoy.structured.params import StructuredOutputsError

# Chat's fields, as the Responses request names them (400s name the field the client sent).
_CHAT_PARAMS = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
}


def responses_param(chat_param: str) -> str:
    """The Responses field a chat field came from."""
    return _CHAT_PARAMS.get(chat_param, chat_param)


def not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"no response with id {response_id!r}", param=param)


def usage_item(u: UsageInfo | None) -> Item | None:
    if u is None:
        return None
    details = u.completion_tokens_details
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": details.reasoning_tokens if details else 0},
        "total_tokens": u.total_tokens,
    }


def part(kind: str, text: str, logprobs: list[Item] | None = None) -> Item:
    """A message's output_text part (its tokens' `logprobs` when asked for, else []), or a
    reasoning item's reasoning_text part."""
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": logprobs or []}  # fmt: skip
    return {"type": "reasoning_text", "text": text}


def text_item(
    item_id: str, text: str, status: str, kind: str = "message",
    logprobs: list[Item] | None = None, sealed: bool = False,
) -> Item:  # fmt: skip
    """A message item, or (kind `reasoning`) a reasoning item: no summary, the text whole (and
    `sealed`: in encrypted_content too)."""
    if kind == "reasoning":
        item = {"id": item_id, "type": "reasoning", "summary": [],
                "content": [part(kind, text)], "status": status}  # fmt: skip
        if sealed:
            item["encrypted_content"] = seal_reasoning(text)
        return item
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [part(kind, text, logprobs)]}  # fmt: skip


def check_logprobs(chat: ChatCompletionRequest, start: ThinkStart) -> None:
    """A reply that may think gets no logprobs (OpenAI's reasoning models refuse them too): a
    400 once its prompt is rendered (`start`: its ThinkStart), before it runs."""
    if chat.logprobs and start != ThinkStart.OFF:
        raise SamplingParamsError(
            "logprobs are not available for a reasoning model's reply (its think block); set"
            " reasoning.effort to none or minimal to answer without thinking",
            "include",
        )


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> Item:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def call_status(arguments: str) -> str:
    """A function_call item's status: incomplete when max_output_tokens cut its arguments."""
    return "completed" if is_complete(arguments) else "incomplete"


def finish_response(response: Item, reason: str | None, usage: UsageInfo | None) -> Item:
    """The response's status (incomplete when cut by max_output_tokens) and usage."""
    if reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"
        response["completed_at"] = int(time.time())
    response["usage"] = usage_item(usage)
    return response


@contextlib.contextmanager
def responses_params() -> Iterator[None]:
    """Chat's 400s renamed to the Responses field they came from."""
    try:
        yield
    except (SamplingParamsError, StructuredOutputsError) as e:
        e.param = responses_param(e.param)
        raise
    except APIError as e:  # e.g. a conversation past the context
        if e.param is not None:
            e.param = responses_param(e.param)
        raise


def completed(response: Item, result: ChatCompletionResponse, sealed: bool = False) -> Item:
    """A finished chat completion as the response's output items, status and usage; `sealed`:
    reasoning items carry encrypted_content (include reasoning.encrypted_content)."""
    choice = result.choices[0]
    message = choice.message
    output: list[Item] = []
    if message.reasoning_content is not None:
        output.append(text_item(new_item_id("rs"), message.reasoning_content,
                                "completed", "reasoning", sealed=sealed))  # fmt: skip
    if message.content or not message.tool_calls:
        output.append(text_item(new_item_id("msg"), message.content or "", "completed"))
    for call in message.tool_calls or []:
        output.append(call_item(new_item_id("fc"), call.id, call.function.name,
                                call.function.arguments,
                                call_status(call.function.arguments)))  # fmt: skip
    response["output"] = output
    return finish_response(response, choice.finish_reason, result.usage)


