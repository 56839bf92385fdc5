"""A reasoning model through the real server with the official client: a tiny scripted Qwen3
with a thinking template (thinking_model.py), whose greedy reply is a think block then
content, its `</think>` arriving over five deltas (`.<`, `/`, `thin`, `k`, `>`).

Chat: reasoning_content apart from content, whole and streamed (the same text, the same
usage, reasoning tokens counted), enable_thinking false through chat_template_kwargs (the
prompt grows by the closed block, the reply is content), a json_schema constraint and tools
`required` applied after the think block (the call parsed from the content), a regex
spelling the block constraining the whole reply. Responses:
a reasoning item before the message, streamed as reasoning_text events, effort `minimal` as
thinking off, a reasoning item sent back. Batch API chat lines: the same. Hostile chat_template_kwargs and reasoning fields:
400 naming the field, and the server keeps serving.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server, start_server, stop_server
from tests.e2e.helpers import API_KEY, counts, error_object
from tests.e2e.test_batches import results, submit, wait
from tests.e2e.thinking_model import CONTENT, PLAIN, REASONING, Script, build_thinking_model

HI = [{"role": "user", "content": "Hi"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Script]]:
    folder = tmp_path_factory.mktemp("thinking") / "model"
    return folder, build_thinking_model(folder)


@pytest.fixture(scope="module")
def tserver(
    built: tuple[Path, dict[str, Script]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    args = [str(built[0]), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "32MiB"]
    server = start_server(args, tmp_path_factory.mktemp("tserver"))
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def model(tserver: Server) -> str:
    return str(httpx.get(f"{tserver.base_url}/v1/models", headers=tserver.headers).json()
               ["data"][0]["id"])  # fmt: skip


@pytest.fixture(scope="module")
def tclient(tserver: Server) -> OpenAI:
    return OpenAI(base_url=f"{tserver.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def script(built: tuple[Path, dict[str, Script]]) -> Script:
    return built[1]["thinking"]


def _chat(client: OpenAI, model: str, **kwargs: Any) -> Any:
    args = {"temperature": 0, "max_tokens": 40, **kwargs}
    return client.chat.completions.create(model=model, messages=HI, **args)  # type: ignore[arg-type]


def test_chat_splits_the_think_block(tclient: OpenAI, model: str, script: Script) -> None:
    r = _chat(tclient, model)
    message = r.choices[0].message
    assert message.content == CONTENT and r.choices[0].finish_reason == "stop"
    assert message.reasoning_content == REASONING  # type: ignore[attr-defined]
    assert message.reasoning == REASONING  # type: ignore[attr-defined]  # vLLM's newer name
    assert r.usage.completion_tokens == len(script.token_ids) + 1  # and EOS
    details = r.usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == script.num_reasoning_tokens == 13


def test_streamed_split_equals_whole(tclient: OpenAI, model: str) -> None:
    whole = _chat(tclient, model)
    chunks = list(_chat(tclient, model, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [getattr(d, "reasoning_content", None) for d in deltas]
    content = [d.content for d in deltas]
    assert "".join(r for r in reasoning if r) == whole.choices[0].message.reasoning_content
    assert "".join(c for c in content if c) == whole.choices[0].message.content
    last_reasoning = max(i for i, r in enumerate(reasoning) if r)
    assert all(not c for c in content[: last_reasoning + 1])  # reasoning first, then content
    assert all("<" not in (r or "") and "/" not in (r or "") for r in reasoning)  # no marker
    assert counts(chunks[-1].usage) == counts(whole.usage)
    assert chunks[-1].usage.completion_tokens_details == whole.usage.completion_tokens_details


def test_a_block_cut_by_max_tokens_is_all_reasoning(tclient: OpenAI, model: str) -> None:
    r = _chat(tclient, model, max_tokens=7, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        assert choice.finish_reason == "length" and choice.message.content is None
        assert choice.message.reasoning_content == "'Hi' is a"  # type: ignore[attr-defined]
    details = r.usage.completion_tokens_details
    assert r.usage.completion_tokens == 14 and details and details.reasoning_tokens == 14
    chunks = list(_chat(tclient, model, max_tokens=7, stream=True))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                       for c in chunks)  # fmt: skip
    assert streamed == "'Hi' is a" and not any(c.choices[0].delta.content for c in chunks)


def test_enable_thinking_false(tclient: OpenAI, model: str, tserver: Server) -> None:
    r = _chat(tclient, model, extra_body=OFF)
    message = r.choices[0].message
    assert message.content == PLAIN and getattr(message, "reasoning_content", None) is None
    assert r.usage.completion_tokens_details is None  # thinking off: nothing to count
    on = _chat(tclient, model)
    assert r.usage.prompt_tokens > on.usage.prompt_tokens
    url = f"{tserver.base_url}/tokenize"
    body = {"messages": HI, "return_token_strs": True}
    plain = httpx.post(url, json=body, headers=tserver.headers).json()
    off = httpx.post(url, json={**body, **OFF}, headers=tserver.headers).json()
    assert off["count"] == r.usage.prompt_tokens and plain["count"] == on.usage.prompt_tokens
    assert "think" in off["token_strs"] and "think" not in plain["token_strs"]
    # OpenAI's reasoning_effort: none / minimal as enable_thinking false, the others true
    minimal = _chat(tclient, model, reasoning_effort="minimal")
    assert minimal.choices[0].message.content == PLAIN
    assert minimal.usage.prompt_tokens == r.usage.prompt_tokens
    high = _chat(tclient, model, reasoning_effort="high")
    assert high.choices[0].message.reasoning_content == REASONING  # type: ignore[attr-defined]
    assert high.choices[0].message.content == CONTENT


def test_json_schema_applies_after_the_think_block(tclient: OpenAI, model: str) -> None:
    schema = {"type": "integer", "enum": [42]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    r = _chat(tclient, model, response_format=fmt)
    message = r.choices[0].message
    assert message.reasoning_content == REASONING  # type: ignore[attr-defined]
    assert json.loads(message.content or "") == 42


def test_a_regex_that_spells_the_block_constrains_the_whole_reply(
    tclient: OpenAI, model: str
) -> None:
    regex = {"structured_outputs": {"regex": "<think>Mine\\.</think>\n\nYes"}}
    r = _chat(tclient, model, extra_body=regex)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == ("Mine.", "Yes")  # type: ignore[attr-defined]


def test_tool_calls_parse_from_the_content(tclient: OpenAI, model: str) -> None:
    """Tools `required`: the call grammar starts after the think block; the script's content
    is refused there, so the grammar writes the call (the function takes no arguments)."""
    tools = [{"type": "function", "function": {"name": "greet", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]  # fmt: skip
    r = _chat(tclient, model, tools=tools, tool_choice="required")
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.reasoning_content == REASONING  # type: ignore[attr-defined]
    calls = message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == [("greet", "{}")]
    chunks = list(_chat(tclient, model, tools=tools, tool_choice="required", stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    arguments = "".join(t.function.arguments for d in deltas for t in d.tool_calls or [])
    assert (streamed, arguments) == (REASONING, "{}")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_batch_chat_lines(tclient: OpenAI, model: str) -> None:
    """Batch API chat lines run through the same serving object: kwargs and the split too."""
    body = {"model": model, "messages": HI, "max_tokens": 40, "temperature": 0}
    lines = [
        {"custom_id": "on", "method": "POST", "url": "/v1/chat/completions", "body": body},
        {"custom_id": "off", "method": "POST", "url": "/v1/chat/completions",
         "body": {**body, **OFF}},
    ]  # fmt: skip
    batch = wait(tclient, submit(tclient, lines, "/v1/chat/completions").id)
    assert batch.status == "completed"
    out = {k: v["response"]["body"]["choices"][0]["message"]
           for k, v in results(tclient, batch.output_file_id).items()}  # fmt: skip
    assert (out["on"]["reasoning_content"], out["on"]["content"]) == (REASONING, CONTENT)
    assert "reasoning_content" not in out["off"] and out["off"]["content"] == PLAIN


# -- Responses ---------------------------------------------------------------------------------


def test_responses_reasoning_item(
    tclient: OpenAI, model: str, script: Script, tserver: Server
) -> None:
    r = tclient.responses.create(model=model, input="Hi", temperature=0, max_output_tokens=40)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    item = r.output[0]
    assert item.id.startswith("rs_") and item.summary == [] and item.status == "completed"
    assert item.content is not None and [(c.type, c.text) for c in item.content] == [
        ("reasoning_text", REASONING)
    ]
    assert r.output_text == CONTENT
    assert r.usage is not None
    assert r.usage.output_tokens_details.reasoning_tokens == script.num_reasoning_tokens
    off = tclient.responses.create(model=model, input="Hi", temperature=0,
                                   reasoning={"effort": "minimal"})  # fmt: skip
    assert [item.type for item in off.output] == ["message"] and off.output_text == PLAIN
    assert off.reasoning is not None and off.reasoning.effort == "minimal"
    # logprobs: none for a reply that thinks (as OpenAI's reasoning models), a 400 before it
    # runs; with thinking off the message's tokens, as for any model
    include = ["message.output_text.logprobs"]
    url, headers = f"{tserver.base_url}/v1/responses", tserver.headers
    for background in (False, True):
        refused = httpx.post(url, headers=headers, json={"model": model, "input": "Hi",
                                                         "include": include,
                                                         "background": background})  # fmt: skip
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "include"
    scored = tclient.responses.create(model=model, input="Hi", temperature=0, include=include,  # type: ignore[list-item]
                                      reasoning={"effort": "minimal"})  # fmt: skip
    assert scored.output_text == PLAIN
    assert "".join(lp.token for lp in scored.output[0].content[0].logprobs) == PLAIN
    # the reasoning item back as input (a follow-up), and the stored conversation holding it
    follow = tclient.responses.create(
        model=model,
        temperature=0,
        max_output_tokens=40,
        input=[*r.output, {"role": "user", "content": "Bye"}],
    )  # type: ignore[list-item]
    again = tclient.responses.create(model=model, previous_response_id=r.id, input="Bye",
                                     temperature=0, max_output_tokens=40)  # fmt: skip
    assert follow.output_text == again.output_text == CONTENT
    # include reasoning.encrypted_content: the reasoning item carries its text sealed (whole
    # and streamed), and a client that keeps no state sends the item back with only that
    include = ["reasoning.encrypted_content"]
    sealed = tclient.responses.create(model=model, input="Hi", temperature=0, store=False,
                                      max_output_tokens=40, include=include)  # type: ignore[list-item]  # fmt: skip
    blob = sealed.output[0].encrypted_content  # type: ignore[union-attr]
    assert isinstance(blob, str) and REASONING not in blob
    assert r.output[0].encrypted_content is None  # type: ignore[union-attr]  # not asked for
    events = list(tclient.responses.create(model=model, input="Hi", temperature=0, stream=True,
                                           max_output_tokens=40, include=include))  # type: ignore[list-item]  # fmt: skip
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done[0].type == "reasoning" and done[0].encrypted_content == blob  # type: ignore[union-attr]
    back = {"type": "reasoning", "id": sealed.output[0].id, "summary": [], "encrypted_content": blob}
    stateless = tclient.responses.create(
        model=model, temperature=0, max_output_tokens=40, store=False,
        input=[{"role": "user", "content": "Hi"}, back, sealed.output[1],  # type: ignore[list-item]
               {"role": "user", "content": "Bye"}],
    )  # fmt: skip
    assert stateless.output_text == CONTENT
    broken = httpx.post(url, headers=headers, json={
        "model": model, "input": [{**back, "encrypted_content": "convoy-reasoning:%%%"}]})
    assert broken.status_code == 400
    assert broken.json()["error"]["param"] == "input[0].encrypted_content"


def test_responses_stream_reasoning_events(tclient: OpenAI, model: str) -> None:
    whole = tclient.responses.create(model=model, input="Hi", temperature=0)
    with tclient.responses.stream(model=model, input="Hi", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    reasoning = [e for e in events if e.type.startswith("response.reasoning_text")]
    assert {e.output_index for e in reasoning} == {0}
    assert "".join(e.delta for e in reasoning if e.type.endswith(".delta")) == REASONING
    assert [e.text for e in reasoning if e.type.endswith(".done")] == [REASONING]
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning_text.done") < first_text
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    texts = [e for e in events if e.type == "response.output_text.delta"]
    assert {e.output_index for e in texts} == {1} and final.output_text == CONTENT
    # (the stream helper adds `parsed: None` to output_text parts)
    strip = [i.model_dump(exclude={"id"}, exclude_none=True) for i in final.output]
    assert strip == [i.model_dump(exclude={"id"}, exclude_none=True) for i in whole.output]


# -- hostile -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}},
         "chat_template_kwargs.add_generation_prompt"),
        ({"chat_template_kwargs": {"bos_token": ""}}, "chat_template_kwargs.bos_token"),
        ({"chat_template_kwargs": {"x": "y" * 100_000}}, "chat_template_kwargs"),
    ],
)  # fmt: skip
def test_bad_chat_template_kwargs(
    tserver: Server, tclient: OpenAI, model: str, body: dict[str, Any], param: str
) -> None:
    url = f"{tserver.base_url}/v1/chat/completions"
    chat = {"model": model, "messages": HI, "max_tokens": 4, **body}
    assert error_object(httpx.post(url, json=chat, headers=tserver.headers), 400)["param"] == param
    tokenize = {"messages": HI, **body}
    response = httpx.post(f"{tserver.base_url}/tokenize", json=tokenize, headers=tserver.headers)
    assert error_object(response, 400)["param"] == param
    assert _chat(tclient, model).choices[0].message.content == CONTENT  # still serving


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": [{"type": "reasoning", "content": [{"text": 5}]}]}, "input[0].content"),
    ],
)
def test_bad_reasoning_fields(
    tserver: Server, model: str, body: dict[str, Any], param: str
) -> None:
    url = f"{tserver.base_url}/v1/responses"
    response = httpx.post(url, json={"model": model, "input": "Hi", **body},
                          headers=tserver.headers)  # fmt: skip
    assert error_object(response, 400)["param"] == param
