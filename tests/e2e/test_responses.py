"""/v1/responses through the real server with the official client: a string and an item list,
instructions, max_output_tokens (incomplete), a stream whose deltas make the final text,
parse with a pydantic model, a function-tool round trip over previous_response_id, a call cut
by max_output_tokens (incomplete, whole and streamed), the stored
response's retrieve / input_items / delete, previous_response_id after a restart, and the 400s
naming the field."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.responses import Response
from pydantic import BaseModel

from tests.e2e.conftest import Server, running_server, start_server, stop_server
from tests.e2e.helpers import API_KEY, MODEL

ARGS = [MODEL, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "128MiB"]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Today's weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("responses")


@pytest.fixture(scope="module")
def rserver(data_dir: Path) -> Iterator[Server]:
    with running_server(ARGS, data_dir) as server:
        yield server


@pytest.fixture(scope="module")
def rclient(rserver: Server) -> OpenAI:
    return OpenAI(base_url=f"{rserver.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_string_input(rclient: OpenAI) -> None:
    r = rclient.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8,
                                 temperature=0)  # fmt: skip
    assert isinstance(r, Response) and r.id.startswith("resp_") and r.object == "response"
    assert r.output[0].type == "message" and r.output[0].id.startswith("msg_")
    assert r.output_text
    assert (
        r.usage is not None and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    )


def test_item_list_and_instructions(rclient: OpenAI) -> None:
    items = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Bye"}]},
    ]
    r = rclient.responses.create(model=MODEL, input=items, instructions="Be brief.",  # type: ignore[arg-type]
                                 max_output_tokens=6, temperature=0)  # fmt: skip
    assert r.instructions == "Be brief." and r.output_text
    plain = rclient.responses.create(model=MODEL, input=items, instructions="Be brief. Use one short sentence, always.", max_output_tokens=6,  # type: ignore[arg-type]
                                     temperature=0)  # fmt: skip
    assert r.usage is not None and plain.usage is not None
    assert (
        plain.usage.input_tokens > r.usage.input_tokens
    )  # longer instructions, a longer system message


def test_max_output_tokens_incomplete(rclient: OpenAI) -> None:
    r = rclient.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3,
                                 temperature=0)  # fmt: skip
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3


def test_stream(rclient: OpenAI) -> None:
    kwargs = {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 64, "temperature": 0}
    whole = rclient.responses.create(**kwargs)  # type: ignore[call-overload]
    deltas: list[str] = []
    seqs: list[int] = []
    types: list[str] = []
    with rclient.responses.stream(**kwargs) as stream:
        for event in stream:
            seqs.append(event.sequence_number)
            types.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert seqs == list(range(len(seqs)))
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert "".join(deltas) == final.output_text == whole.output_text
    raw = list(rclient.responses.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert raw[-1].response.output_text == whole.output_text


LOGPROBS = {"model": MODEL, "input": "Name three colours.", "max_output_tokens": 16,
            "temperature": 0, "include": ["message.output_text.logprobs"], "top_logprobs": 3}  # fmt: skip


def _entries(items: list[object]) -> list[dict[str, object]]:
    return [i.model_dump() for i in items]  # type: ignore[attr-defined]


def test_output_text_logprobs(rclient: OpenAI) -> None:
    """include message.output_text.logprobs: each token of the message with its top_logprobs
    (greedy: the token is the first of them), the same whole, streamed, stored and in the
    background; the deltas' logprobs are their own tokens and add up to the done event's."""
    whole = rclient.responses.create(**LOGPROBS)  # type: ignore[call-overload]
    assert whole.top_logprobs == 3
    logprobs = whole.output[0].content[0].logprobs
    assert logprobs and "".join(lp.token for lp in logprobs) == whole.output_text
    for lp in logprobs:
        tops = lp.top_logprobs
        assert len(tops) == 3 and lp.logprob <= 0 and lp.bytes == list(lp.token.encode())
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].token == lp.token and tops[0].logprob == lp.logprob
    deltas, pieces = [], []
    for event in rclient.responses.create(stream=True, **LOGPROBS):  # type: ignore[call-overload]
        if event.type == "response.output_text.delta":
            assert "".join(lp.token for lp in event.logprobs) == event.delta
            deltas += event.logprobs
            pieces.append(event.delta)
        elif event.type == "response.output_text.done":
            done = event.logprobs
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert len(pieces) > 1 and "".join(pieces) == whole.output_text
    assert _entries(deltas) == _entries(done) == _entries(logprobs)
    assert _entries(final.output[0].content[0].logprobs) == _entries(logprobs)
    stored = rclient.responses.retrieve(whole.id)
    assert _entries(stored.output[0].content[0].logprobs) == _entries(logprobs)
    queued = rclient.responses.create(background=True, **LOGPROBS)  # type: ignore[call-overload]
    for _ in range(600):
        if (queued := rclient.responses.retrieve(queued.id)).status not in ("queued",
                                                                            "in_progress"):  # fmt: skip
            break
        time.sleep(0.1)
    assert queued.status == whole.status
    assert _entries(queued.output[0].content[0].logprobs) == _entries(logprobs)
    # top_logprobs alone asks for none (as OpenAI's); 0 lists no alternatives
    plain = rclient.responses.create(**{**LOGPROBS, "include": []})  # type: ignore[call-overload]
    assert plain.output_text == whole.output_text and plain.output[0].content[0].logprobs == []
    bare = rclient.responses.create(**{**LOGPROBS, "top_logprobs": 0})  # type: ignore[call-overload]
    assert [lp.token for lp in bare.output[0].content[0].logprobs] == [
        lp.token for lp in logprobs
    ] and all(lp.top_logprobs == [] for lp in bare.output[0].content[0].logprobs)


def test_allowed_tools(rclient: OpenAI, rserver: Server) -> None:
    """tool_choice allowed_tools narrows the calls to its functions (every tool in the
    prompt); its tools must be function tools in `tools`."""
    time_tool = {**WEATHER, "name": "get_time"}
    body = {"model": MODEL, "input": "What is the weather in Paris?", "temperature": 0,
            "tools": [WEATHER, time_tool], "max_output_tokens": 80}  # fmt: skip
    free = rclient.responses.create(**body, tool_choice="required")  # type: ignore[call-overload]
    assert "get_weather" in {item.name for item in free.output}  # type: ignore[union-attr]
    only = {"type": "allowed_tools", "mode": "required",
            "tools": [{"type": "function", "name": "get_time"}]}  # fmt: skip
    narrowed = rclient.responses.create(**body, tool_choice=only)  # type: ignore[call-overload]
    assert narrowed.output and {item.name for item in narrowed.output} == {"get_time"}  # type: ignore[union-attr]
    assert narrowed.tool_choice.type == "allowed_tools"  # type: ignore[union-attr]
    url = f"{rserver.base_url}/v1/responses"
    for tools, param in (([{"type": "function", "name": "nope"}], "tool_choice"),
                         ([{"type": "mcp", "server_label": "x"}], "tool_choice.tools[0]"),
                         (5, "tool_choice.tools")):  # fmt: skip
        bad = httpx.post(url, headers=rserver.headers,
                         json={**body, "tool_choice": {**only, "tools": tools}})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_logprobs_of_a_tool_call_reply(rclient: OpenAI) -> None:
    """A reply that is a call: no message, so no logprobs, whole and streamed alike."""
    body = {**LOGPROBS, "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 60,
            "input": "What is the weather in Paris?"}  # fmt: skip
    whole = rclient.responses.create(**body)  # type: ignore[call-overload]
    assert whole.output and all(item.type == "function_call" for item in whole.output)
    events = list(rclient.responses.create(stream=True, **body))  # type: ignore[call-overload]
    assert not [e for e in events if e.type.startswith("response.output_text")]
    streamed = events[-1].response.output
    assert [c.arguments for c in streamed] == [c.arguments for c in whole.output]  # type: ignore[union-attr]


class City(BaseModel):
    name: str
    country: str


def test_parse_json_schema(rclient: OpenAI) -> None:
    r = rclient.responses.parse(model=MODEL, input="A city in France, as JSON.", text_format=City,
                                max_output_tokens=60, temperature=0)  # fmt: skip
    assert isinstance(r.output_parsed, City)


def test_function_tool_round_trip(rclient: OpenAI, rserver: Server) -> None:
    first = rclient.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
        max_output_tokens=200,
    )  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls, first.output
    assert calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert calls[0].id is not None and calls[0].id.startswith("fc_")
    follow = rclient.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER],  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": '{"temperature": 21}'}],
        max_output_tokens=10, temperature=0,
    )  # fmt: skip
    assert follow.output[0].type == "message" and follow.previous_response_id == first.id
    # retrieve, input items (newest first), delete, then 404
    got = rclient.responses.retrieve(follow.id)
    assert got.output_text == follow.output_text
    items = rclient.responses.input_items.list(follow.id)
    assert [i.type for i in items.data][:2] == ["function_call_output", "function_call"]
    asc = rclient.responses.input_items.list(follow.id, order="asc", limit=1)
    assert asc.data[0].type == "message" and asc.has_more
    rest = rclient.responses.input_items.list(follow.id, order="asc", after=asc.data[0].id)
    assert [i.id for i in rest.data] == [i.id for i in reversed(items.data)][1:]
    assert rclient.responses.delete(follow.id) is None
    with pytest.raises(openai.NotFoundError) as e:
        rclient.responses.retrieve(follow.id)
    assert e.value.body["param"] == "response_id"  # type: ignore[index]
    store_off = rclient.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        rclient.responses.retrieve(store_off.id)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # SmolLM2 does not think
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"background": True, "store": False}, "store"),
        ({"background": True, "stream": True}, "stream"),
        ({"include": ["file_search_call.nope"]}, "include"),
        ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
        ({"include": ["message.output_text.logprobs"], "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": "2"}, "top_logprobs"),
        ({"include": "message.output_text.logprobs"}, "include"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"previous_response_id": "resp_nope"}, "previous_response_id"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
            "text.format",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "bogus"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": "hi", "id": 5}]}, "input[0].id"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": "hi there"}] * 20000}, "input"),  # past the context
        ({"input": 5}, "input"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"conversation": {"id": "conv_1"}}, "conversation"),
        ({"prompt": {"id": "pmpt_1", "version": "2"}}, "prompt"),
    ],
)
def test_unsupported_fields(rserver: Server, extra: dict[str, object], param: str) -> None:
    body = {"model": MODEL, "input": "Hi", **extra}
    r = httpx.post(f"{rserver.base_url}/v1/responses", json=body, headers=rserver.headers)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_input_tokens_count_what_create_reports(rclient: OpenAI, rserver: Server) -> None:
    """POST /v1/responses/input_tokens (the SDK's responses.input_tokens.count): the
    usage.input_tokens a create with the same fields reports, a chain and tools included; its
    400s and 404s name the field."""
    first_body = {"model": MODEL, "input": "Hi", "instructions": "Be brief.", "tools": [WEATHER]}
    count = rclient.responses.input_tokens.count(**first_body)  # type: ignore[arg-type]
    assert count.object == "response.input_tokens"
    first = rclient.responses.create(**first_body, max_output_tokens=4, temperature=0)  # type: ignore[call-overload]
    assert first.usage is not None and count.input_tokens == first.usage.input_tokens
    chained = {"model": MODEL, "previous_response_id": first.id, "input": "And you?"}
    count = rclient.responses.input_tokens.count(**chained)  # type: ignore[arg-type]
    follow = rclient.responses.create(**chained, max_output_tokens=4, temperature=0)  # type: ignore[call-overload]
    assert follow.usage is not None and count.input_tokens == follow.usage.input_tokens
    url = f"{rserver.base_url}/v1/responses/input_tokens"
    for body, status, param in (({"input": "hi", "tools": [{"type": "web_search"}]}, 400,
                                 "tools[0].type"),
                                ({"input": "hi", "previous_response_id": "resp_nope"}, 404,
                                 "previous_response_id"),
                                ({"input": 5}, 400, "input")):  # fmt: skip
        r = httpx.post(url, json=body, headers=rserver.headers)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_item_references(rclient: OpenAI, rserver: Server) -> None:
    """An item_reference input item is the stored item of that id (an input or an output of a
    stored response): the same prompt as the item sent whole; an unknown id (or one of a
    deleted response) is a 404 naming it."""
    first = rclient.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    asked = rclient.responses.input_items.list(first.id).data[0]
    said = first.output[0]
    refs = [{"type": "item_reference", "id": asked.id}, {"type": "item_reference", "id": said.id},
            {"role": "user", "content": "Bye"}]  # fmt: skip
    whole = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "Bye"}]  # fmt: skip
    body = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    by_ref = rclient.responses.create(**body, input=refs)  # type: ignore[call-overload]
    inline = rclient.responses.create(**body, input=whole)  # type: ignore[call-overload]
    assert by_ref.usage is not None and inline.usage is not None
    assert by_ref.usage.input_tokens == inline.usage.input_tokens
    assert by_ref.output_text == inline.output_text
    stored = rclient.responses.input_items.list(by_ref.id, order="asc").data
    assert [i.id for i in stored[:2]] == [asked.id, said.id]  # kept as the items themselves
    url = f"{rserver.base_url}/v1/responses"
    for item, status, param in (({"type": "item_reference", "id": "msg_nope"}, 404, "input[0].id"),
                                ({"type": "item_reference"}, 400, "input[0].id")):  # fmt: skip
        r = httpx.post(url, headers=rserver.headers, json={**body, "input": [item]})
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert rclient.responses.delete(first.id) is None
    gone = httpx.post(url, headers=rserver.headers, json={**body, "input": refs[1:]})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "input[0].id"


def test_a_deleted_previous_response_is_a_404(rclient: OpenAI) -> None:
    first = rclient.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert rclient.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError) as err:
        rclient.responses.create(model=MODEL, input="And?", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        rclient.responses.retrieve(first.id)


def test_stream_function_call(rclient: OpenAI) -> None:
    with rclient.responses.stream(
        model=MODEL, input="Weather in Rome?", tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required", temperature=0, max_output_tokens=200,
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    done = {e.item_id: e.arguments for e in events
            if e.type == "response.function_call_arguments.done"}  # fmt: skip
    deltas: dict[str, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            deltas[e.item_id] = deltas.get(e.item_id, "") + e.delta
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and done == deltas == {c.id: c.arguments for c in calls}
    assert calls[0].name == "get_weather"


def test_a_call_cut_by_max_output_tokens_is_incomplete(rclient: OpenAI) -> None:
    """Cut inside its arguments, the call is a function_call item with the arguments generated
    so far and status incomplete, in an incomplete response; whole and streamed alike."""
    kwargs = {"model": MODEL, "input": "Weather in Rome?", "tools": [WEATHER],
              "tool_choice": "required", "temperature": 0, "max_output_tokens": 20}  # fmt: skip
    whole = rclient.responses.create(**kwargs)  # type: ignore[call-overload]
    events = list(rclient.responses.create(**kwargs, stream=True))  # type: ignore[call-overload]
    assert events[-1].type == "response.incomplete"  # the SDK's stream helper wants completed
    streamed = events[-1].response
    for r in (whole, streamed):
        assert r.status == "incomplete" and r.incomplete_details is not None
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.status == "incomplete" and call.arguments.startswith('{"city"')
    assert streamed.output[0].arguments == whole.output[0].arguments  # type: ignore[union-attr]
    (done,) = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.status == "incomplete"


# NOTE: last: it stops the module's server.
def test_previous_response_after_restart(rclient: OpenAI, rserver: Server, data_dir: Path) -> None:
    first = rclient.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4,
                                     temperature=0)  # fmt: skip
    stop_server(rserver)
    again = start_server(ARGS, data_dir)
    try:
        client = OpenAI(base_url=f"{again.base_url}/v1", api_key=API_KEY, max_retries=0)
        follow = client.responses.create(
            model=MODEL,
            previous_response_id=first.id,
            input="What is my name?",
            max_output_tokens=4,
        )
        assert follow.usage is not None and first.usage is not None
        assert follow.usage.input_tokens > first.usage.input_tokens
        assert client.responses.retrieve(first.id).id == first.id
    finally:
        stop_server(again)
