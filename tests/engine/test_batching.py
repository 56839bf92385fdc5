"""Batch invariance, seeds, prefix caching, preemption and chunked prefill with the real model."""

from __future__ import annotations

import pytest

from convoy import LLM, SamplingParams
from tests.engine.conftest import prompts16

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(llm: LLM) -> list[list[int]]:
    """Each prompt generated on its own: the reference for batch invariance."""
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts16()]


def test_batch_equals_alone(llm: LLM, alone: list[list[int]]) -> None:
    outs = llm.generate(prompts16(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert [o.prompt for o in outs] == prompts16()


def test_batch_equals_alone_under_preemption_and_chunked_prefill(alone: list[list[int]]) -> None:
    # 24 blocks of 16 tokens cannot hold 16 sequences of ~50 tokens: preemption by recompute.
    # A 24-token budget splits every longer prompt into chunks and mixes them with decodes.
    small = LLM(dtype="float32", num_kv_blocks=24, max_num_batched_tokens=24)
    outs = small.generate(prompts16(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert small.core.scheduler.num_preemptions > 0
    assert small.core.block_manager.num_used_blocks == 0


def test_seed_is_reproducible_alone_and_in_a_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["Tell me a story about a cat."], params)[0].outputs[0].text
    again = llm.generate(["Tell me a story about a cat."], params)[0].outputs[0].text
    others = SamplingParams(temperature=1.0, max_tokens=20)
    batch = llm.generate(
        ["Hello there", "Tell me a story about a cat.", "Why is the sky blue?"],
        [others, params, others],
    )
    assert alone == again == batch[1].outputs[0].text
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True)
    assert llm.generate(["Tell me a story about a cat."], other_seed)[0].outputs[0].text != alone


def test_shared_header_is_computed_once(llm: LLM) -> None:
    header = " ".join(
        f"Example {i}: the quick brown fox jumps over the lazy dog." for i in range(16)
    )
    prompts = [f"{header}\nQuestion {i}: what comes next?" for i in range(32)]
    header_len = len(llm.tokenizer.encode(header))
    assert header_len >= 200
    before = llm.core.stats().num_prompt_tokens
    params = SamplingParams(temperature=0, max_tokens=2)
    computed_before = llm.core.scheduler.num_computed_tokens
    outs = llm.generate(prompts, params)
    computed = llm.core.scheduler.num_computed_tokens - computed_before
    prompt_tokens = llm.core.stats().num_prompt_tokens - before
    cached = sum(o.num_cached_tokens for o in outs)
    # All but the first prompt reuse the header's full blocks.
    assert cached >= 31 * (header_len // 16 * 16)
    # Header computed once: at most one header plus the 32 tails (+ one decode each) were run.
    assert computed <= prompt_tokens - cached + 32
    assert computed < header_len * 2 + 32 * 40
