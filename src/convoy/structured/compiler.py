"""GrammarCompiler: a StructuredOutputsParams -> a CompiledGrammar, cached per canonical spec.

Compiling runs in the caller's thread (the API's worker thread, the offline LLM's caller),
never on the engine thread: the engine only copies the compiled prototype (`matcher()`).

    spec --grammar text (llguidance: JSON schema / regex / Lark; GBNF converted)--> LLMatcher
         --first mask filled (lexer warmed), one probe token consumed--> CompiledGrammar

A spec that fails any of this raises StructuredOutputsError naming its request field, so the
client gets a 400 before any engine work. Results (failures too) are kept in an LRU cache keyed
by the spec's canonical text: a schema sent again costs a dict lookup.

llguidance matches lazily: lexer states are built as the text advances. GRAMMAR_LIMITS bound
that work per step (fuel) and in total (states, grammar size), so a hostile regex or grammar
fails its step cleanly (its request ends with an error) instead of stalling the engine; the
probe token catches most such grammars here already (measured: `(a{1000}){1000}` failed at its
first token after ~12 ms of fuel; llguidance's default fuel made that ~150 ms per sequence).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark
from llguidance.numpy import fill_next_token_bitmask

from convoy.structured.matcher import GrammarMatcher, allowed_token_ids, error_text
from convoy.structured.params import StructuredOutputsError, StructuredOutputsParams

# llguidance's defaults are 1M / 200k fuel, 250k lexer states, 500k grammar symbols, 50k
# Earley items; every legitimate schema we tried needs far less (largest: 300 properties, a
# 2,000-value enum, 60 nested objects, string formats: <0.2 ms a step).
GRAMMAR_LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=100_000,  # ~2 ms building a lexeme's regex
    step_lexer_fuel=100_000,  # ~7 ms of lexer work per mask
    step_max_items=20_000,  # Earley items per mask (~1 ms)
    max_lexer_states=20_000,  # 1-2 kB each
    max_grammar_size=100_000,
    verbose_errors=False,  # errors go to clients: no parser state dumps
)
# Compact JSON with the spaces most training text has after ':' and ','. Flexible whitespace
# lets a small model loop on newlines until max_tokens; none at all reads less naturally.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 128  # compiled specs kept (failures too)

_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object constraint",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


@dataclass(slots=True, frozen=True)
class CompiledGrammar:
    """A compiled spec: a prototype matcher at the start of the output, its first mask built.
    Never advanced itself; each constrained sequence matches with its own copy."""

    prototype: llguidance.LLMatcher

    def matcher(self, param: str) -> GrammarMatcher:
        """A fresh matcher for one sequence (cheap: a copy); its errors name `param`."""
        return GrammarMatcher(self.prototype.deep_copy(), param)


class GrammarCompiler:
    """One per served tokenizer: llguidance's view of the vocabulary, plus the compile cache.
    Thread-safe: worker threads compile while the engine thread copies prototypes."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        """`vocab_size`: the model's logits width, which may exceed the tokenizer's vocabulary
        (tokens past the tokenizer's are never allowed); `eos_token_ids`: every id that ends a
        sequence, all allowed where the grammar may end."""
        self._hf = hf_tokenizer
        self._eos = sorted(eos_token_ids)
        num_tokens = hf_tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
        self.num_tokens = max(vocab_size, num_tokens)
        self.num_words = (self.num_tokens + 31) // 32  # int32 words in one bitmask row
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str, str], CompiledGrammar | str] = OrderedDict()
        self.num_hits = 0
        self.num_misses = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer, built on first use.

        NOTE: building holds the GIL (0.3 s for SmolLM2's 49k tokens, 3.5 s for Gemma 3's 262k):
        a server builds it at start (`load`), not inside its first constrained request, where it
        would stall the event loop and every stream with it.
        """
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf  # here: it imports transformers (~2 s)

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.num_tokens, eos_token=self._eos
                )
            return self._tokenizer

    def load(self) -> None:
        """Build the tokenizer now."""
        _ = self.tokenizer

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The spec's compiled grammar (cached); raises StructuredOutputsError naming
        `spec.param` when it does not compile."""
        key = (*spec.cache_key, spec.think or "")
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
        if cached is None:
            # NOTE: outside the lock: llguidance drops the GIL while it compiles, so two
            # requests' schemas compile in parallel (the same one twice, at worst).
            cached = self._compile(spec)
            with self._lock:
                self.num_misses += 1
                self._cache[key] = cached
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(cached, str):
            raise StructuredOutputsError(cached, spec.param)
        return cached

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar | str:
        """The compiled grammar, or the message saying why it does not compile."""
        what = _WHAT[spec.kind]
        try:
            grammar = _grammar_text(spec)
            if spec.think is not None:
                grammar = after_think(grammar, spec.think)
        except Exception as e:  # noqa: BLE001 - any failure to convert a client's text is a 400
            return _message(what, str(e))
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=GRAMMAR_LIMITS)
        error = self._warm(matcher)
        if error:
            return _message(what, error)
        return CompiledGrammar(matcher)

    def _warm(self, matcher: llguidance.LLMatcher) -> str:
        """Build the first mask (most of the lexer: copies share it) and consume one allowed
        token in a throwaway copy: grammars that blow a limit mostly do so here, before any
        engine work. Returns the error, '' if none."""
        if matcher.is_error():
            return matcher.get_error()
        bitmask = np.zeros((1, self.num_words), dtype=np.int32)
        fill_next_token_bitmask(matcher, bitmask, 0)
        if matcher.is_error():
            return matcher.get_error()
        allowed = allowed_token_ids(bitmask[0])
        if not allowed:
            return "it allows no output at all"
        probe = matcher.deep_copy()
        token = next((t for t in allowed if t not in self._eos), allowed[0])
        probe.consume_token(token)
        fill_next_token_bitmask(probe, bitmask, 0)
        return probe.get_error()


def _grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for the spec (raises ValueError on malformed input)."""
    lm = llguidance.LLMatcher
    if spec.kind == "json":
        return lm.grammar_from_json_schema(spec.cache_key[1], defaults=JSON_OPTIONS)
    if spec.kind == "json_object":
        return lm.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return lm.grammar_from_regex(spec.cache_key[1])
    if spec.kind == "choice":
        literals = (json.dumps(c, ensure_ascii=False) for c in spec.choice or [])
        return lm.grammar_from_lark("start: " + " | ".join(literals))
    # Lark as is (a `start:` rule or `%llguidance`), else GBNF (`root ::=`) converted to Lark
    return lm.grammar_from_lark(any_to_lark(spec.cache_key[1]))


# The think block before a reasoning model's constrained text (StructuredOutputsParams.think):
# a grammar of its own, the constraint a second one (`@constrained`, with its own lexer, so its
# lexemes never meet the block's). The block is a lazy lexeme: it ends at the first `</think>`;
# one or two newlines may follow it (not more: a model must not loop on them).
_THINK = {  # mode -> (the block's place, its lexeme)
    "maybe": ("think?", '"<think>" TEXT "</think>"'),
    "open": ("think", 'TEXT "</think>"'),
}


def after_think(grammar: str, mode: str) -> str:
    """`grammar` (a top-level grammar's JSON text, or Lark text) after a think block: one
    top-level grammar of the block's grammar, then `grammar`'s, the first named `constrained`."""
    if grammar.lstrip().startswith("{"):
        inner: list[dict[str, Any]] = json.loads(grammar)["grammars"]
    else:
        inner = [{"lark_grammar": grammar}]
    inner[0] = {**inner[0], "name": "constrained"}
    place, block = _THINK[mode]
    lark = (
        f"%llguidance {{}}\nstart: {place} @constrained\nthink: block NL?\n"
        f"block[lazy]: {block}\nNL: /\\n\\n?/\nTEXT: /(.|\\n)*/\n"
    )
    return json.dumps({"grammars": [{"name": "think", "lark_grammar": lark}, *inner]})


def _message(what: str, error: str) -> str:
    return f"the {what} does not compile: {error_text(error)}"
