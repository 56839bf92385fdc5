"""responses_stream.EventStream's logprobs: a reply of text then a tool call, as chat streams it
(one chunk a token; a token whose text the parser holds back comes in a chunk with no delta):
the message's logprobs are the tokens that wrote its text, each delta carries its own, the
tokens of the call and the end-of-sequence token none; whole (assembled) the same."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from convoy.api.protocol_chat import (
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatLogprobToken,
    ChatStreamChoice,
    DeltaMessage,
)
from convoy.api.protocol_tools import DeltaFunctionCall, DeltaToolCall
from convoy.api.responses_stream import EventStream, assemble


def _chunk(token: str, delta: DeltaMessage, finish: str | None = None) -> ChatCompletionChunk:
    entry = ChatLogprobToken(token=token, logprob=-0.5, bytes=list(token.encode()))
    choice = ChatStreamChoice(index=0, delta=delta, finish_reason=finish,
                              logprobs=ChatChoiceLogprobs(content=[entry]))  # fmt: skip
    return ChatCompletionChunk(id="chatcmpl-1", created=0, model="m", choices=[choice])


def _reply() -> list[ChatCompletionChunk]:
    call = DeltaToolCall(index=0, id="call_1", type="function",
                         function=DeltaFunctionCall(name="f", arguments=""))  # fmt: skip
    args = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"a": 1}'))
    return [
        ChatCompletionChunk(id="chatcmpl-1", created=0, model="m",
                            choices=[ChatStreamChoice(index=0, delta=DeltaMessage(
                                role="assistant", content=""))]),  # fmt: skip
        _chunk("Let", DeltaMessage(content="Let")),
        _chunk(" me", DeltaMessage(content=" me")),
        _chunk(" <", DeltaMessage()),  # held: it may begin the marker
        _chunk(" see", DeltaMessage(content=" < see")),  # it did not: both wrote this
        _chunk("\n", DeltaMessage()),  # held, then the call's (whitespace before the marker)
        _chunk("<tool_call>", DeltaMessage()),
        _chunk('{"name": "f", "arguments": ', DeltaMessage(tool_calls=[call])),
        _chunk('{"a": 1}}', DeltaMessage(tool_calls=[args])),
        _chunk("<|im_end|>", DeltaMessage(), finish="tool_calls"),
    ]


async def _chunks() -> AsyncGenerator[ChatCompletionChunk, None]:
    for chunk in _reply():
        yield chunk


def _tokens(entries: list[dict[str, Any]]) -> list[str]:
    return [e["token"] for e in entries]


def test_the_message_logprobs_are_its_own_tokens() -> None:
    async def run() -> list[Any]:
        return [ev async for ev in EventStream({"id": "resp_1"}, logprobs=True).run(_chunks())]

    events = asyncio.run(run())
    deltas = [e.model_dump() for e in events if e.type == "response.output_text.delta"]
    assert [(d["delta"], _tokens(d["logprobs"])) for d in deltas] == [
        ("Let", ["Let"]), (" me", [" me"]), (" < see", [" <", " see"]),
    ]  # fmt: skip
    done = next(e.model_dump() for e in events if e.type == "response.output_text.done")
    assert done["text"] == "Let me < see"
    assert _tokens(done["logprobs"]) == ["Let", " me", " <", " see"]
    final = events[-1].model_dump()["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert _tokens(final["output"][0]["content"][0]["logprobs"]) == _tokens(done["logprobs"])
    whole = asyncio.run(assemble(EventStream({"id": "resp_2"}, logprobs=True, whole=True),
                                 _chunks()))  # fmt: skip
    assert whole["output"][0]["content"][0]["logprobs"] == final["output"][0]["content"][0][
        "logprobs"
    ]


def test_without_logprobs_the_lists_are_empty() -> None:
    async def run() -> list[Any]:
        return [ev async for ev in EventStream({"id": "resp_1"}).run(_chunks())]

    events = [e.model_dump() for e in asyncio.run(run())]
    texts = [e for e in events if e["type"].startswith("response.output_text")]
    assert texts and all(e["logprobs"] == [] for e in texts)
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == []
