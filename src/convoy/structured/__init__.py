"""Structured outputs: constrain what a sequence may generate to a JSON schema, a regex, a list
of choices or a grammar, with llguidance.

    params.py    StructuredOutputsParams: the request-side spec, its bounds, its cache key
    compiler.py  GrammarCompiler: spec -> CompiledGrammar (a warmed matcher), LRU-cached;
                 one llguidance tokenizer per served tokenizer
    matcher.py   GrammarMatcher: one sequence's state (a copy of the compiled prototype);
                 fill_bitmasks: a step's allowed-token bitmask rows

A leaf layer: it imports no other part of convoy (common's SamplingParams holds the spec; the
engine and the API use the compiler and matchers). This file imports nothing, so importing the
spec does not load llguidance.
"""
