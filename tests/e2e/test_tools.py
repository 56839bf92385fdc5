"""Tool calling through the real server with the official client: `required`, a named function
and `parallel_tool_calls: false` give calls whose arguments validate against their schemas
(`parse` with a pydantic tool too); a stream reassembles into the same call as the whole
response; `auto` answers in text, or calls once the opening marker is out (forced here with
logit_bias: the tiny model does not open it on its own); a round trip (call, tool result,
answer); a call cut by max_tokens is the same whole and streamed (text before its name is out,
then a call with truncated arguments); a Batch API line; each bad field a 400 naming
it; one call on Gemma 3.

The generating requests run concurrently, in one batch (the `replies` fixture), so the file
costs about one request's time on one thread."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field

from tests.e2e.conftest import Server
from tests.e2e.helpers import API_KEY, GEMMA, MODEL, error_object
from tests.e2e.test_batches import results, submit, wait


class GetWeather(BaseModel):
    """Today's weather in a city."""

    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


WEATHER = openai.pydantic_function_tool(GetWeather, name="get_weather")
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.",
                                         "parameters": TIME_PARAMS, "strict": True}}  # fmt: skip
FAN_PARAMS = {
    "type": "object",
    "properties": {"mode": {"enum": ["fast", "slow"]},
                   "level": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["mode", "level"],
    "additionalProperties": False,
}  # fmt: skip
FAN = {"type": "function", "function": {"name": "set_fan", "parameters": FAN_PARAMS}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME_PARAMS,
           "set_fan": FAN_PARAMS}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SINGLE: dict[str, Any] = {
    "model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
    "parallel_tool_calls": False, "temperature": 0, "max_tokens": 60,
}  # fmt: skip


def assert_valid_calls(choice: Any, names: set[str] | None = None) -> list[Any]:
    """The choice's calls, each naming a given function with arguments valid for it."""
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    for call in calls:
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return list(calls)


async def _stream(aclient: AsyncOpenAI) -> tuple[Any, list[Any]]:
    """SINGLE, streamed through the client's own accumulator: its final completion and the
    raw chunks."""
    chunks = []
    async with aclient.chat.completions.stream(**SINGLE) as stream:
        async for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
        return await stream.get_final_completion(), chunks


async def _reassembled(aclient: AsyncOpenAI, body: dict[str, Any]) -> tuple[Any, Any, Any]:
    """A raw stream (no accumulator: it refuses a cut reply with a pydantic tool) summed up:
    (content, [[name, arguments] per call], finish_reason)."""
    content, calls, finish = "", {}, None
    async for chunk in await aclient.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, ["", ""])
                call[0] += d.function.name or ""
                call[1] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.fixture(scope="module")
def replies(server: Server) -> dict[str, Any]:
    """Every generating request of this file but the round trip's answer and the batch,
    at once."""
    aclient = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                          timeout=120)  # fmt: skip
    create = aclient.chat.completions.create
    marker = httpx.post(
        f"{server.base_url}/tokenize",
        headers=server.headers,
        json={"prompt": "<tool_call>", "add_special_tokens": False},
    ).json()
    fan = {"model": MODEL, "messages": [{"role": "user", "content": "Fan to fast, level 3."}],
           "tools": [FAN], "temperature": 0}  # fmt: skip
    named = {"type": "function", "function": {"name": "get_time"}}
    only_time = [{"type": "function", "function": {"name": "get_time"}}]
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": only_time}}
    allowed_auto = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": only_time}}

    async def run() -> list[Any]:
        return await asyncio.gather(
            create(**SINGLE),
            _stream(aclient),
            create(**{**SINGLE, "tool_choice": named, "parallel_tool_calls": True,
                      "max_tokens": 120}),
            aclient.chat.completions.parse(**{**SINGLE, "tools": [WEATHER]}),
            create(**fan, parallel_tool_calls=False, max_tokens=40,
                   logit_bias={str(t): 100 for t in marker["tokens"]}),
            create(**fan, max_tokens=8),
            create(**{**SINGLE, "max_tokens": 12}),
            create(**{**SINGLE, "max_tokens": 20}),
            _reassembled(aclient, {**SINGLE, "max_tokens": 20}),
            create(**{**SINGLE, "tool_choice": allowed}),
            create(**{**SINGLE, "tool_choice": allowed_auto,
                      "logit_bias": {str(t): 100 for t in marker["tokens"]}}),
        )  # fmt: skip

    names = ["single", "streamed", "named", "parsed", "auto_forced", "auto_text", "cut",
             "cut_args", "cut_args_streamed", "allowed", "allowed_auto"]  # fmt: skip
    return dict(zip(names, asyncio.run(run()), strict=True))


def test_required_and_named_calls_match_their_schemas(replies: dict[str, Any]) -> None:
    (single,) = assert_valid_calls(replies["single"].choices[0])  # parallel false: one call
    assert replies["single"].choices[0].message.content is None
    named = assert_valid_calls(replies["named"].choices[0], {"get_time"})
    assert len({c.id for c in named}) == len(named)
    parsed = replies["parsed"].choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, GetWeather) and single.function.name == "get_weather"


def test_allowed_tools_narrow_the_calls(replies: dict[str, Any]) -> None:
    """tool_choice allowed_tools: SINGLE calls get_weather unnarrowed; allowed only get_time,
    required or auto (the marker forced), its calls name get_time."""
    assert assert_valid_calls(replies["single"].choices[0])[0].function.name == "get_weather"
    assert_valid_calls(replies["allowed"].choices[0], {"get_time"})
    assert_valid_calls(replies["allowed_auto"].choices[0], {"get_time"})


def test_a_streamed_call_reassembles_into_the_whole_response(replies: dict[str, Any]) -> None:
    final, chunks = replies["streamed"]
    (whole,) = assert_valid_calls(replies["single"].choices[0])
    (streamed,) = assert_valid_calls(final.choices[0])
    assert (streamed.function.name, streamed.function.arguments) == (
        whole.function.name, whole.function.arguments,
    )  # fmt: skip
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0, "function", "get_weather", "",
    )  # fmt: skip
    assert first.id and all(d.id is None and d.function.name is None for d in rest)
    assert len(rest) > 3  # the arguments came in pieces
    assert not any(c.choices[0].delta.content for c in chunks)  # the marker never shows


def test_auto_answers_in_text_or_calls_after_the_marker(replies: dict[str, Any]) -> None:
    forced = replies["auto_forced"].choices[0]
    (call,) = assert_valid_calls(forced, {"set_fan"})  # biased into the marker, then held
    assert forced.message.content is None
    text = replies["auto_text"].choices[0]
    assert text.message.tool_calls is None and text.message.content
    assert text.finish_reason in ("stop", "length")


def test_a_call_cut_by_max_tokens_is_what_the_stream_sent(replies: dict[str, Any]) -> None:
    """Cut before its name is out, the reply stays text; cut in its arguments, it is a call
    with the arguments generated so far (as OpenAI's API answers), in a stream and whole."""
    cut = replies["cut"].choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls is None
    assert cut.message.content.startswith('<tool_call>\n{"name": "get_')
    whole = replies["cut_args"].choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # truncated
    content, calls, finish = replies["cut_args_streamed"]
    assert (content, calls, finish) == ("", [["get_weather", call.function.arguments]], "length")


def test_a_round_trip_call_result_answer(client: OpenAI, replies: dict[str, Any]) -> None:
    asked = replies["single"]
    call = asked.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    body = {k: v for k, v in SINGLE.items() if k not in ("messages", "tool_choice", "tools")}
    answer = client.chat.completions.create(**body, messages=history, tools=[WEATHER, TIME])
    grown = answer.usage.prompt_tokens - asked.usage.prompt_tokens
    assert grown > asked.usage.completion_tokens  # the call and its result are in the prompt
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert choice.message.content


def test_batch_lines_call_tools_like_interactive_requests(
    client: OpenAI, replies: dict[str, Any]
) -> None:
    good = {"custom_id": "call", "method": "POST", "url": "/v1/chat/completions", "body": SINGLE}
    bad = {
        **good,
        "custom_id": "bad",
        "body": {**SINGLE, "tool_choice": {"type": "function", "function": {"name": "x"}}},
    }
    batch = wait(client, submit(client, [good, bad], "/v1/chat/completions").id)
    out, err = results(client, batch.output_file_id), results(client, batch.error_file_id)
    message = out["call"]["response"]["body"]["choices"][0]["message"]
    whole = replies["single"].choices[0].message.tool_calls[0].function
    assert message["tool_calls"][0]["function"] == whole.model_dump()  # greedy: the same call
    assert err["bad"]["response"]["body"]["error"]["param"] == "tool_choice"


def _tool(name: str, parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


BIG = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1500)}}
BAD = [
    ({"tool_choice": "required"}, "tool_choice", "requires tools"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tools": [TIME, TIME]}, "tools", "get_time"),
    ({"tools": [TIME], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]}}},
     "tool_choice", "nope"),
    ({"tools": [TIME], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "maybe", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}},
     "tool_choice", "auto"),
    ({"tools": [_tool(f"f{i}", None) for i in range(129)]}, "tools", "128"),
    ({"tools": [TIME, _tool("bad", {"properties": {"a": {"type": "nosuch"}}})]}, "tools",
     "tools[1] (bad): the JSON schema does not compile"),
    ({"tools": [_tool("s", {"type": "string"})]}, "tools", "type object"),
    ({"tools": [_tool(f"f{i}", BIG) for i in range(3)]}, "tools", "too large together"),
    ({"tools": [TIME], "response_format": {"type": "json_object"}}, "tools", "one output"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages", "tool_call_id"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "param", "says"), BAD)
def test_bad_tool_fields_are_400_naming_the_field(
    http: httpx.Client, change: dict[str, Any], param: str, says: str
) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **change}
    error = error_object(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param and says in error["message"], error


def test_gemma_makes_a_required_call(gemma: OpenAI) -> None:
    reply = gemma.chat.completions.create(**{**SINGLE, "model": GEMMA})
    assert_valid_calls(reply.choices[0], {"get_weather", "get_time"})
