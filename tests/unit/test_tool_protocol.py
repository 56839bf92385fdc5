"""Tool fields on the wire without a model: modes and their constraint, every bad field a 400
naming it, the delta shape the official client accumulates; and the prompt each kind of chat
template gets (the embedded models' tokenizers, and a template with its own tool support)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from pydantic import ValidationError

from convoy.api.chat_template import apply_template, has_tool_support
from convoy.api.protocol_chat import ChatCompletionRequest
from convoy.api.protocol_tools import MAX_TOOLS, DeltaFunctionCall, DeltaToolCall
from convoy.api.tool_format import call_text
from convoy.engine.tokenizer import Tokenizer
from convoy.models.gemma3 import GEMMA_TEMPLATE
from convoy.models.resolve import resolve_model
from convoy.sampling_params import SamplingParamsError

USER = [{"role": "user", "content": "Weather in Paris?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def tool(name: str = "get_weather", parameters: Any = PARAMS, **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters, **function}}


def request(**body: Any) -> ChatCompletionRequest:
    req = ChatCompletionRequest.model_validate({"messages": USER, **body})
    req.check()
    return req


def test_modes_and_the_constraint_each_sets() -> None:
    plain = request()
    assert plain.tool_mode == "none" and plain.to_sampling_params().structured_outputs is None
    auto = request(tools=[tool(), tool("noop", None)])
    assert auto.tool_mode == "auto"
    spec = auto.to_sampling_params().structured_outputs
    assert spec is not None and spec.param == "tools" and "prefix[lazy]" in (spec.grammar or "")
    named = request(tools=[tool(), tool("noop", None)],
                    tool_choice={"type": "function", "function": {"name": "noop"}})  # fmt: skip
    assert named.tool_mode == "required"
    assert [name for _, name, _ in named.constrained_functions()] == ["noop"]
    none = request(tools=[tool()], tool_choice="none", response_format={"type": "json_object"})
    assert none.to_sampling_params().structured_outputs.param == "response_format"  # type: ignore[union-attr]
    assert "strict" not in json.dumps(request(tools=[tool(strict=True)]).tools_for_prompt())


def _bad_tools(change: dict[str, Any]) -> str:
    """The param a 400 names (a ValidationError names the top-level field in its loc)."""
    try:
        request(**change).to_sampling_params()
    except SamplingParamsError as e:
        return e.param
    except ValidationError as e:
        return str(e.errors()[0]["loc"][0])
    raise AssertionError(f"accepted: {change}")


def _deep(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


BIG = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1500)}}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [tool()], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": [tool()], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [tool(), tool()]}, "tools"),  # two of one name
        ({"tools": [tool(f"f{i}") for i in range(MAX_TOOLS + 1)]}, "tools"),
        ({"tools": [tool("get weather")]}, "tools"),  # a name off the pattern
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools"),
        ({"tools": [tool(parameters={"type": "string"})]}, "tools"),
        ({"tools": [tool(parameters=_deep(70))]}, "tools"),
        ({"tools": [tool(parameters={"type": "object", "default": float("nan")})]}, "tools"),
        ({"tools": [tool(f"f{i}", BIG) for i in range(4)]}, "tools"),  # too large together
        ({"tools": [tool()], "response_format": {"type": "json_object"}}, "tools"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # no tool_call_id
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages"),
    ],
)  # fmt: skip
def test_bad_tool_fields_name_the_field(change: dict[str, Any], param: str) -> None:
    assert _bad_tools(change) == param


def test_later_deltas_of_a_call_omit_id_type_and_name() -> None:
    """The client's accumulator concatenates strings and overwrites `type`: a null or repeated
    value would corrupt the call it builds."""
    first = DeltaToolCall(index=0, id="call_1", type="function",
                          function=DeltaFunctionCall(name="f", arguments=""))  # fmt: skip
    later = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"a"'))
    assert json.loads(first.model_dump_json()) == {
        "index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""},
    }  # fmt: skip
    assert json.loads(later.model_dump_json()) == {"index": 0, "function": {"arguments": '{"a"'}}


# -- rendering ---------------------------------------------------------------------------------

HISTORY = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "rain"}]},
]  # fmt: skip
CALLS = (call_text("get_weather", '{"city": "Paris"}') + "\n"
         + call_text("get_weather", '{"city": "Rome"}'))  # fmt: skip
RESULTS = "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer(resolve_model("smollm2-135m-instruct").model_dir)


def _render(tokenizer: Tokenizer, messages: list[dict[str, Any]], **body: Any) -> str:
    req = request(messages=messages, **body)
    tools = req.tools_for_prompt() if req.tools else None
    return apply_template(tokenizer, req.messages, True, tools)


def test_smollm2_gets_the_generic_format(smollm2: Tokenizer) -> None:
    assert not has_tool_support(smollm2.chat_template)
    text = _render(smollm2, HISTORY, tools=[tool(description="Today's weather.")])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(request(tools=[tool(description="Today's weather.")]).tools_for_prompt()[0])\
        in system  # fmt: skip
    assert "SmolLM" not in text  # the tools' system message replaces the default one
    assert f"<|im_start|>assistant\n{CALLS}<|im_end|>" in text
    assert f"<|im_start|>user\n{RESULTS}<|im_end|>\n<|im_start|>assistant\n" in text
    no_tools = _render(smollm2, HISTORY)  # a history of calls renders without tools too
    assert "# Tools" not in no_tools and CALLS in no_tools and RESULTS in no_tools


def _with_template(tokenizer: Tokenizer, template: str) -> Tokenizer:
    """The tokenizer with another chat template (rendering only reads the template)."""
    other = copy.copy(tokenizer)
    other.chat_template = template
    return other


def test_gemma_gets_it_in_its_first_user_turn(smollm2: Tokenizer) -> None:
    assert not has_tool_support(GEMMA_TEMPLATE)
    text = _render(_with_template(smollm2, GEMMA_TEMPLATE), HISTORY, tools=[tool()])
    # (BOS is SmolLM2's here)
    assert text.startswith("<|im_start|><start_of_turn>user\nBe brief.\n\n# Tools\n")
    assert f"<start_of_turn>model\n{CALLS}<end_of_turn>" in text
    assert text.endswith(f"<start_of_turn>user\n{RESULTS}<end_of_turn>\n<start_of_turn>model\n")


# A template with its own tool support in the <tool_call> format (written for this test, in
# the shape of Qwen 2.5's): tools listed from `tools`, calls from `tool_calls` objects.
NATIVE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
    "{% for m in messages %}[{{ m.role }}]"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}"
    "({{ c.function.arguments.city }}){% endfor %}{% endif %}"
    "{% if m.role == 'tool' %}{{ m.tool_call_id }}={% endif %}{{ m.content }}\n{% endfor %}"
)


def test_a_template_with_tool_support_renders_them_itself(smollm2: Tokenizer) -> None:
    assert has_tool_support(NATIVE)
    text = _render(_with_template(smollm2, NATIVE), HISTORY, tools=[tool(), tool("noop", None)])
    assert text == (
        "TOOLS:get_weather;noop;[system]Be brief.\n[user]Weather in Paris and Rome?\n"
        "[assistant]<tool_call>get_weather(Paris)<tool_call>get_weather(Rome)\n"
        "[tool]c1=sunny\n[tool]c2=rain\n"
    )
