"""GrammarCompiler over the default model's tokenizer (no model): what does not compile is a
StructuredOutputsError naming the field, hostile regexes and grammars fail here in milliseconds,
the cache answers a spec seen before (failures too), and a matcher walks a choice to its end."""

from __future__ import annotations

import time
from typing import Any

import pytest

from convoy.engine.tokenizer import Tokenizer
from convoy.models.resolve import resolve_model
from convoy.structured.compiler import GrammarCompiler
from convoy.structured.matcher import allowed_token_ids, fill_bitmasks
from convoy.structured.params import StructuredOutputsError, StructuredOutputsParams

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model("smollm2-135m-instruct").model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    compiler = GrammarCompiler(tokenizer.hf_tokenizer, 49152, {EOS})
    compiler.load()
    return compiler


# 3,000 alternatives of one rule: past llguidance's 2,000 items a row (found by the probe token)
WIDE = "start: " + " | ".join(f'"w{i}" r' for i in range(3000)) + '\nr: "x"'
DO_NOT_COMPILE = [
    {"regex": "a(b"},
    {"regex": "(a{1000}){1000}"},  # passes llguidance's check; blows the lexer at the 1st token
    {"regex": "((a{100}){100}){100}"},
    {"regex": r"[^\s\S]"},  # matches nothing
    {"grammar": "start: foo"},
    {"grammar": "root ::= ("},  # GBNF
    {"grammar": WIDE},
    {"json": {"type": "nosuch"}},
    {"json": {"type": "string", "format": "no-such-format"}},
    {"json": {"$ref": "#/nowhere"}},
]


@pytest.mark.parametrize("spec", DO_NOT_COMPILE)
def test_what_does_not_compile_names_its_field(
    compiler: GrammarCompiler, spec: dict[str, Any]
) -> None:
    start = time.monotonic()
    with pytest.raises(StructuredOutputsError) as info:
        compiler.compile(StructuredOutputsParams(**spec, param="guided_grammar"))
    assert info.value.param == "guided_grammar"
    assert "does not compile" in str(info.value)
    assert time.monotonic() - start < 1.0  # bounded by the limits, not by the input's appetite


def test_the_cache_answers_a_spec_seen_before(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    hits, misses = compiler.num_hits, compiler.num_misses
    first = compiler.compile(StructuredOutputsParams(json=schema, param="response_format"))
    again = compiler.compile(StructuredOutputsParams(json='{"type": "object", "properties": '
                                                     '{"n": {"type": "integer"}}, "required": '
                                                     '["n"]}'))  # fmt: skip
    assert again is first
    bad = {"regex": "(unclosed"}
    with pytest.raises(StructuredOutputsError):
        compiler.compile(StructuredOutputsParams(**bad))
    with pytest.raises(StructuredOutputsError) as info:  # the failure is cached too
        compiler.compile(StructuredOutputsParams(**bad, param="guided_regex"))
    assert info.value.param == "guided_regex"
    assert (compiler.num_hits - hits, compiler.num_misses - misses) == (2, 2)


@pytest.mark.parametrize(
    "spec",
    [
        {"choice": ["yes", "no"]},
        {"grammar": 'start: "yes" | "no"'},  # Lark
        {"grammar": 'root ::= "yes" | "no"'},  # GBNF
        {"regex": "yes|no"},
    ],
)
def test_a_matcher_walks_to_the_end(
    compiler: GrammarCompiler, tokenizer: Tokenizer, spec: dict[str, Any]
) -> None:
    compiled = compiler.compile(StructuredOutputsParams(**spec))
    matcher, other = compiled.matcher("structured_outputs"), compiled.matcher("x")
    masks = fill_bitmasks([matcher, other], compiler.num_words)
    first = allowed_token_ids(masks[0])
    assert first == allowed_token_ids(masks[1])
    no = tokenizer.encode("no", add_special_tokens=False)
    assert no[0] in first and EOS not in first
    for token in no:
        assert matcher.accept(token)
    assert matcher.is_finished and not matcher.is_failed
    assert not other.is_finished  # each sequence its own copy
    assert not other.accept(tokenizer.encode("maybe", add_special_tokens=False)[0])
    assert other.is_failed and other.error().param == "x"
