"""The tool-call format without a model: text split into content and calls (whole, and streamed
in pieces of every size), text that is not complete calls left alone, and the grammar walked
token by token with the default model's tokenizer (what it allows and refuses)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from convoy.api.tool_format import (
    CLOSE,
    OPEN,
    ParsedCall,
    ToolCallStream,
    call_text,
    is_complete,
    parse_tool_calls,
    split_reply,
    tools_grammar,
)
from convoy.engine.tokenizer import Tokenizer
from convoy.models.resolve import resolve_model
from convoy.structured.compiler import GrammarCompiler
from convoy.structured.matcher import GrammarMatcher, allowed_token_ids, fill_bitmasks
from convoy.structured.params import StructuredOutputsParams

EOS = 2  # SmolLM2's <|im_end|>
TRICKY_ARGS = '{"q": "a } b \\" ] { <tool_call> é", "n": [1, {"m": []}]}'
TWO_CALLS = "Let me check.  \n" + call_text("search", TRICKY_ARGS) + "\n" + call_text("noop", "{}")


def test_text_then_calls_parse_with_their_arguments_as_generated() -> None:
    content, calls = parse_tool_calls(TWO_CALLS) or (None, [])
    assert content == "Let me check."  # the whitespace before the first marker goes
    assert calls == [ParsedCall("search", TRICKY_ARGS), ParsedCall("noop", "{}")]
    assert json.loads(calls[0].arguments)["q"] == 'a } b " ] { <tool_call> é'
    assert parse_tool_calls("\n " + call_text("noop", "{}")) == (None, [ParsedCall("noop", "{}")])


@pytest.mark.parametrize(
    "text",
    [
        "No call here.",
        TWO_CALLS[:-1],  # cut inside the last CLOSE
        TWO_CALLS[: TWO_CALLS.index('"noop"') + 3],  # cut inside a name
        TWO_CALLS[: TWO_CALLS.index("[1,")],  # cut inside the arguments
        TWO_CALLS + " and some text after",
        call_text("f", '"not an object"'),
        f'{OPEN}\n{{"arguments": {{}}, "name": "f"}}\n{CLOSE}',  # not the format's order
        f'{OPEN}\n{{"name": "f", "arguments": {{}}}}',  # no CLOSE
    ],
)
def test_text_that_is_not_complete_calls_is_left_alone(text: str) -> None:
    assert parse_tool_calls(text) is None


def _stream(text: str, size: int) -> tuple[str, dict[int, list[str]], ToolCallStream]:
    """Feed `text` in pieces of `size`: the content, and each call's [name, arguments]."""
    parser = ToolCallStream()
    content, calls = "", {}
    for i in range(0, len(text), size):
        piece, deltas = parser.feed(text[i : i + size])
        content += piece
        for d in deltas:
            if d.name is not None:
                assert d.index == len(calls) and d.arguments == ""  # a call's first delta
                calls[d.index] = [d.name, ""]
            else:
                calls[d.index][1] += d.arguments
    return content + parser.finish(), calls, parser


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 1000])
def test_streamed_pieces_reassemble_into_the_parsed_calls(size: int) -> None:
    content, calls, _ = _stream(TWO_CALLS, size)
    assert content == "Let me check."
    assert calls == {0: ["search", TRICKY_ARGS], 1: ["noop", "{}"]}


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_stream_hands_back_text_that_never_became_a_call(size: int) -> None:
    for text in ["5 < 6 and 7 > 2", "cut at <tool_", "x " + OPEN + '\n{"na', "trailing  \n"]:
        content, calls, _ = _stream(text, size)
        assert (content, calls) == (text, {})


def test_a_call_cut_short_keeps_its_partial_arguments_in_a_stream() -> None:
    text = call_text("search", TRICKY_ARGS)[:-20]
    content, calls, parser = _stream(text, 3)
    assert content == "" and calls == {0: ["search", TRICKY_ARGS[:-6]]}
    assert parse_tool_calls(parser.text) is None  # not complete calls: finish is not tool_calls


def test_a_whole_reply_splits_as_its_stream_does_at_every_cut() -> None:
    """split_reply (a non-streamed reply) against the stream fed in pieces, for the reply cut
    at every character (max_tokens or a stop string can end it anywhere)."""
    for end in range(len(TWO_CALLS) + 1):
        text = TWO_CALLS[:end]
        content, calls = split_reply(text)
        streamed, pieces, _ = _stream(text, 3)
        assert content == (streamed or None), end
        assert [[c.name, c.arguments] for c in calls] == list(pieces.values()), end
        if (whole := parse_tool_calls(text)) is not None:
            assert (content, calls) == whole, end  # complete calls: the parsed answer
    assert split_reply(TWO_CALLS) == parse_tool_calls(TWO_CALLS)


def test_cut_arguments_are_not_complete() -> None:
    content, calls = split_reply(call_text("search", TRICKY_ARGS)[:-20])
    assert content is None and [c.arguments for c in calls] == [TRICKY_ARGS[:-6]]
    assert not is_complete(calls[0].arguments) and not is_complete("")
    assert is_complete(TRICKY_ARGS) and is_complete("{}")
    content, calls = split_reply("Sure. " + call_text("noop", "{}")[:-3])  # cut in the CLOSE
    assert content == "Sure." and calls == [ParsedCall("noop", "{}")]
    assert split_reply("plain text  ") == ("plain text  ", [])


# -- the grammar, walked with the default model's tokenizer ------------------------------------

CITY = {
    "type": "object",
    "properties": {"city": {"$ref": "#/$defs/City"}, "days": {"type": "integer", "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
    "$defs": {"City": {"enum": ["Paris", "Rome"], "description": 'a "}\n%json { brace'}},
}
FUNCTIONS: list[tuple[str, dict[str, Any]]] = [
    ("get_weather", CITY),
    ("get_weather_now", {"type": "object", "properties": {}, "additionalProperties": False}),
]
CALL = call_text("get_weather", '{"city": "Rome", "days": 3}')


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model("smollm2-135m-instruct").model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf_tokenizer, 49152, {EOS})


def _matcher(
    compiler: GrammarCompiler, mode: str, parallel: bool, functions: Any = FUNCTIONS
) -> GrammarMatcher:
    spec = StructuredOutputsParams(grammar=tools_grammar(functions, mode, parallel), param="tools")
    return compiler.compile(spec).matcher("tools")


def _walk(matcher: GrammarMatcher, tokenizer: Tokenizer, text: str) -> bool:
    """Does the grammar take `text` (token by token)?"""
    return all(matcher.accept(t) for t in _ids(tokenizer, text))


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _allowed(compiler: GrammarCompiler, matcher: GrammarMatcher) -> list[int]:
    return allowed_token_ids(fill_bitmasks([matcher], compiler.num_words)[0])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_allows_calls_only_and_ends_where_parallel_says(
    compiler: GrammarCompiler, tokenizer: Tokenizer, parallel: bool
) -> None:
    matcher = _matcher(compiler, "required", parallel)
    assert EOS not in _allowed(compiler, matcher)  # no empty reply
    assert _walk(matcher, tokenizer, CALL)
    if parallel:  # another call, or the end
        assert set(_allowed(compiler, matcher)) == {EOS, *_ids(tokenizer, "\n")}
        assert _walk(matcher, tokenizer, "\n" + call_text("get_weather_now", "{}"))
    assert matcher.is_finished is not parallel
    assert not _matcher(compiler, "required", parallel).accept(_ids(tokenizer, "Sure")[0])


@pytest.mark.parametrize(
    "bad",
    [
        call_text("get_weather", '{"city": "Oslo", "days": 3}'),  # not in the $ref'd enum
        call_text("get_weather", '{"city": "Rome", "days": 10}'),  # over the maximum
        call_text("get_weather", '{"city": "Rome"}'),  # a required property missing
        call_text("get_time", "{}"),  # no such function
        call_text("get_weather_now", '{"x": 1}'),  # no parameters at all
    ],
)
def test_calls_off_their_schema_are_refused(
    compiler: GrammarCompiler, tokenizer: Tokenizer, bad: str
) -> None:
    assert not _walk(_matcher(compiler, "required", True), tokenizer, bad)


def test_a_named_function_is_the_only_call_allowed(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    named = _matcher(compiler, "required", False, FUNCTIONS[1:])
    assert not _walk(named, tokenizer, CALL)
    assert _walk(_matcher(compiler, "required", False, FUNCTIONS[1:]), tokenizer,
                 call_text("get_weather_now", "{}"))  # fmt: skip


def test_auto_allows_free_text_until_the_marker_then_a_call(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    text_only = _matcher(compiler, "auto", False)
    assert EOS in _allowed(compiler, text_only)  # may answer nothing at all, or text
    assert _walk(text_only, tokenizer, "5 < 6, and a <tool> or tool_call is fine")
    assert EOS in _allowed(compiler, text_only)
    calling = _matcher(compiler, "auto", False)
    assert _walk(calling, tokenizer, "Let me check. " + OPEN)
    assert _allowed(compiler, calling) == _ids(tokenizer, "\n")  # the call is constrained
    assert _walk(calling, tokenizer, CALL.removeprefix(OPEN)) and calling.is_finished
    off_schema = _matcher(compiler, "auto", False)
    assert not _walk(off_schema, tokenizer, "Sure: " + call_text("get_weather", '{"city": 1}'))
