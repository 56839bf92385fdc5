"""Reasoning models without a server: the think-block split (whole, and streamed in pieces of
every size, markers cut anywhere), where a reply starts from the rendered prompt, reasoning
tokens counted, chat_template_kwargs' checks, the constraint compiled after a think block
(walked token by token with the default model's tokenizer), and Responses' reasoning fields."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest

from convoy.api.chat_template import (
    RESERVED_TEMPLATE_KWARGS,
    apply_template,
    check_template_kwargs,
)
from convoy.api.protocol_chat import ChatCompletionRequest
from convoy.api.protocol_responses import ResponsesRequest, items_to_messages, seal_reasoning
from convoy.api.reasoning import (
    ReasoningStream,
    ThinkStart,
    num_reasoning_tokens,
    split_reasoning,
    think_start,
)
from convoy.api.tool_format import call_text, tools_grammar
from convoy.engine.tokenizer import Tokenizer
from convoy.models.resolve import resolve_model
from convoy.sampling_params import SamplingParamsError
from convoy.structured.compiler import GrammarCompiler
from convoy.structured.params import StructuredOutputsError, StructuredOutputsParams

MAYBE, OPEN, OFF = ThinkStart.MAYBE, ThinkStart.OPEN, ThinkStart.OFF
CASES = [  # (start, text, reasoning, content)
    (MAYBE, "<think>\nI add.\n</think>\n\nFour.", "\nI add.\n", "Four."),
    (MAYBE, "\n <think>a</think>b\n\nc", "a", "b\n\nc"),  # whitespace before the block goes
    (MAYBE, "<think>cut by max_tokens </thi", "cut by max_tokens </thi", ""),
    (MAYBE, "Four. <think>x</think>", None, "Four. <think>x</think>"),  # never opened a block
    (MAYBE, "<thinking>no</think>", None, "<thinking>no</think>"),
    (MAYBE, "", None, ""),
    (MAYBE, "<thi", None, "<thi"),  # a marker's start that led nowhere is content
    (OPEN, "still thinking</think>\nDone.", "still thinking", "Done."),
    (OPEN, "never closed", "never closed", ""),
    (OFF, "<think>x</think>y", None, "<think>x</think>y"),
]


@pytest.mark.parametrize(("start", "text", "reasoning", "content"), CASES)
def test_split_whole_and_streamed_in_every_cut(
    start: ThinkStart, text: str, reasoning: str | None, content: str
) -> None:
    assert split_reasoning(start, text)[:2] == (reasoning, content)
    pieces_list = [[text[:i], text[i:j], text[j:]] for i in range(len(text) + 1)
                   for j in range(i, len(text) + 1)]  # fmt: skip
    pieces_list.append(list(text))  # a character a delta
    for pieces in pieces_list:
        stream = ReasoningStream(start)
        parts = [stream.feed(p, is_last=k == len(pieces) - 1) for k, p in enumerate(pieces)]
        assert "".join(p.reasoning for p in parts) == (reasoning or ""), pieces
        assert "".join(p.content for p in parts) == content, pieces
        assert stream.is_reasoning == (reasoning is not None)


def test_a_marker_is_never_sent_in_part() -> None:
    stream = ReasoningStream(MAYBE)
    parts = [stream.feed(p) for p in ("<thi", "nk>abc</", "think>", "\n", "x")]
    assert [(p.reasoning, p.content) for p in parts] == [
        ("", ""), ("abc", ""), ("", ""), ("", ""), ("", "x"),
    ]  # fmt: skip
    stream = ReasoningStream(OPEN)
    first = stream.feed("abc</th")
    assert (first.reasoning, first.content) == ("abc", "")
    second = stream.feed("ink>\n")
    assert (second.reasoning, second.content) == ("", "")  # newlines after the block held
    assert stream.feed("x").content == "x"


@pytest.mark.parametrize(
    ("parser", "template", "prompt", "start"),
    [
        ("auto", "{{ '<think>' }}", "<|im_start|>assistant\n", MAYBE),
        ("auto", "{{ x }}", "<|im_start|>assistant\n", OFF),  # not a thinking template
        ("auto", "<think>", "assistant\n<think>\n\n</think>\n\n", OFF),  # enable_thinking false
        ("auto", "<think>", "<｜Assistant｜><think>\n", OPEN),  # the template opens the block
        ("qwen3", "{{ x }}", "assistant\n", MAYBE),
        ("deepseek_r1", "{{ x }}", "assistant\n", OPEN),
        ("none", "<think>", "assistant\n<think>\n", OFF),
    ],
)
def test_where_a_reply_starts(parser: str, template: str, prompt: str, start: ThinkStart) -> None:
    assert think_start(parser, template, prompt) == start


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model("smollm2-135m-instruct").model_dir)


def test_reasoning_tokens_run_through_the_token_that_closes_the_block(
    tokenizer: Tokenizer,
) -> None:
    block, rest = "<think>Some thought.</think>", "\n\nThe answer."
    ids = tokenizer.encode(block + rest, add_special_tokens=False)
    _, _, split = split_reasoning(MAYBE, block + rest)
    closing = next(n for n in range(1, len(ids) + 1) if "</think>" in tokenizer.decode(ids[:n]))
    assert num_reasoning_tokens(tokenizer, ids, split) == closing < len(ids)
    _, _, unclosed = split_reasoning(MAYBE, "<think>Some thought")
    assert num_reasoning_tokens(tokenizer, [5, 6, 7], unclosed) == 3  # all of a cut block
    _, _, none = split_reasoning(MAYBE, "No block.")
    assert num_reasoning_tokens(tokenizer, [5, 6, 7], none) == 0


# A native template (it renders tools itself) that shows what it is given.
NATIVE = (
    "{% if tools %}<tool_call>{% endif %}{% for m in messages %}[{{ m.role }}]"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}{% endfor %}{% if enable_thinking is false %}<think></think>{% endif %}"
)


def test_template_kwargs_and_history_reasoning_reach_the_template(tokenizer: Tokenizer) -> None:
    native = copy.copy(tokenizer)
    native.chat_template = NATIVE
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "yo", "reasoning_content": "greet"},
               {"role": "user", "content": "bye"}]  # fmt: skip
    messages = ChatCompletionRequest(messages=history).messages
    off = {"enable_thinking": False}
    text = apply_template(native, messages, True, None, off)
    assert text == "[user]hi[assistant]<think>greet</think>yo[user]bye<think></think>"
    generic = apply_template(tokenizer, messages, True, None, off)  # SmolLM2's own template
    assert "greet" not in generic


# -- chat_template_kwargs ----------------------------------------------------------------------


def test_reserved_names_cover_the_renders_own_arguments() -> None:
    from transformers import PreTrainedTokenizerBase

    own = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    own -= {"self", "kwargs"}
    assert own <= RESERVED_TEMPLATE_KWARGS
    assert set(PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES) <= RESERVED_TEMPLATE_KWARGS


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"messages": []}, "chat_template_kwargs.messages"),
        ({"enable_thinking": False, "bos_token": "x"}, "chat_template_kwargs.bos_token"),
        ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
        ({"not a name": 1}, "chat_template_kwargs.not a name"),
        ({f"k{i}": i for i in range(33)}, "chat_template_kwargs"),
        ({"big": "x" * 20000}, "chat_template_kwargs"),
    ],
)
def test_template_kwargs_refused(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(SamplingParamsError) as e:
        check_template_kwargs(kwargs)
    assert e.value.param == param


def test_template_kwargs_allowed() -> None:
    check_template_kwargs({"enable_thinking": False, "custom": {"a": [1, 2]}})


# -- the constraint after the think block ------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf_tokenizer, 49152, [2])


def _takes(compiler: GrammarCompiler, tokenizer: Tokenizer, spec: Any, text: str) -> bool:
    matcher = compiler.compile(spec).matcher(spec.param)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept(t) for t in ids) and matcher.accept(2)  # then EOS


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = call_text("f", '{"x": 1}')


@pytest.mark.parametrize(
    ("spec", "think", "text", "taken"),
    [
        ({"json": SCHEMA}, "maybe", '{"a": 1}', True),
        ({"json": SCHEMA}, "maybe", '<think>\n{"a": </think>\n\n{"a": 2}', True),
        ({"json": SCHEMA}, "maybe", "<think>x</think>\n\nhello", False),
        ({"json": SCHEMA}, "maybe", 'x{"a": 1}', False),
        ({"json": SCHEMA}, "open", 'x</think>{"a": 1}', True),
        ({"json": SCHEMA}, "open", '{"a": 1}', False),  # the block must close first
        ({"regex": "hel+o"}, "maybe", "<think>x</think>hello", True),
        ({"choice": ["yes", "no"]}, "open", "hm</think>\nno", True),
        ({"grammar": 'start: "x" /[0-9]+/'}, "maybe", "<think>a</think>x1", True),
        ({"grammar": tools_grammar([("f", {"type": "object"})], "required", False)}, "maybe",
         f"<think>call f</think>\n{TOOL}", True),
    ],
)  # fmt: skip
def test_the_constraint_applies_after_the_block(
    compiler: GrammarCompiler, tokenizer: Tokenizer, spec: dict[str, Any], think: str,
    text: str, taken: bool,
) -> None:  # fmt: skip
    assert _takes(compiler, tokenizer, StructuredOutputsParams(**spec, think=think), text) == taken


def test_think_mode_is_checked() -> None:
    with pytest.raises(StructuredOutputsError):
        StructuredOutputsParams(regex="a", think="sometimes")


# -- Responses ---------------------------------------------------------------------------------


def test_responses_reasoning_fields() -> None:
    assert ResponsesRequest(reasoning={"effort": "minimal"}).thinking() is False
    assert ResponsesRequest(reasoning={"effort": "high"}).thinking() is True
    assert ResponsesRequest().thinking() is None
    assert ResponsesRequest(reasoning={"effort": "max"}).thinking() is True
    with pytest.raises(SamplingParamsError) as e:
        ResponsesRequest(reasoning={"effort": "maximum"}).thinking()
    assert e.value.param == "reasoning.effort"
    with pytest.raises(SamplingParamsError) as e:
        ResponsesRequest(reasoning={"summary": "auto"}).check_supported()
    assert e.value.param == "reasoning.summary"
    request = ResponsesRequest(input="hi")
    chat = request.to_chat(request.input_items(), thinking=False)
    assert chat.chat_template_kwargs == {"enable_thinking": False}


def test_chat_reasoning_effort() -> None:
    """Chat's reasoning_effort: the template's enable_thinking (and its own name), unless
    chat_template_kwargs set them; an unknown effort is a 400 naming it."""
    hi = [{"role": "user", "content": "hi"}]
    low = ChatCompletionRequest(messages=hi, reasoning_effort="low")
    assert low.template_kwargs() == {"enable_thinking": True, "reasoning_effort": "low"}
    off = ChatCompletionRequest(messages=hi, reasoning_effort="none",
                                chat_template_kwargs={"x": 1})  # fmt: skip
    assert off.template_kwargs() == {"enable_thinking": False, "reasoning_effort": "none", "x": 1}
    mine = ChatCompletionRequest(messages=hi, reasoning_effort="minimal",
                                 chat_template_kwargs={"enable_thinking": True})  # fmt: skip
    assert mine.template_kwargs() == {"enable_thinking": True, "reasoning_effort": "minimal"}
    assert ChatCompletionRequest(messages=hi).template_kwargs() is None
    with pytest.raises(SamplingParamsError) as e:
        ChatCompletionRequest(messages=hi, reasoning_effort="lots").check()
    assert e.value.param == "reasoning_effort"


def test_a_sealed_reasoning_item_comes_back_as_its_text() -> None:
    """encrypted_content this server wrote gives back the text (an item without content, as a
    stateless client sends it); another server's gives none; a malformed one of ours is a 400."""
    hi, yo = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}
    sealed = {"type": "reasoning", "summary": [], "encrypted_content": seal_reasoning("hm é")}
    items = ResponsesRequest(input=[hi, sealed, yo]).input_items()
    assert items[1]["content"] == [{"type": "reasoning_text", "text": "hm é"}]
    assert items_to_messages(items)[1]["reasoning_content"] == "hm é"
    foreign = {**sealed, "encrypted_content": "gAAAAABo-opaque"}
    assert ResponsesRequest(input=[hi, foreign, yo]).input_items()[1]["content"] == []
    with pytest.raises(SamplingParamsError) as e:
        ResponsesRequest(input=[hi, {**sealed, "encrypted_content": "convoy-reasoning:%"}]
                         ).input_items()  # fmt: skip
    assert e.value.param == "input[1].encrypted_content"


def test_reasoning_input_items_go_to_the_next_assistant_turn() -> None:
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "hm"}]}  # fmt: skip
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    items = ResponsesRequest(input=[{"role": "user", "content": "hi"}, reasoning, call,
                                    {"role": "assistant", "content": "yo"}, reasoning,
                                    ]).input_items()  # fmt: skip
    assert items[1] == {**reasoning, "status": "completed"}
    messages = items_to_messages(items)
    # the last reasoning item, with no assistant turn after it, is dropped
    roles = [(m["role"], m.get("reasoning_content")) for m in messages]
    assert roles == [("user", None), ("assistant", "hm"), ("assistant", None)]
    bad = {"type": "reasoning", "content": "not a list"}
    with pytest.raises(SamplingParamsError) as e:
        ResponsesRequest(input=[bad]).input_items()
    assert e.value.param == "input[0].content"
