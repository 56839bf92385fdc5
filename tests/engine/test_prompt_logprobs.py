"""Prompt logprobs (`echo` + `logprobs`): computed in bounded slices of the vocabulary x rows,
equal to transformers' for a prompt longer than one slice, the same under chunked prefill and
preemption, and scored once for an `n` fan-out (the other children reuse the prompt's KV)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from convoy import LLM, SamplingParams
from convoy.outputs import PositionLogprobs
from convoy.worker.sampler import PROMPT_LOGITS_BYTES, prompt_logprobs
from tests.engine.conftest import prompts16

SCORE = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)


def _long_prompt(llm: LLM, num_slices: float) -> list[int]:
    """Token ids of a prompt spanning `num_slices` slices of prompt logits."""
    rows = PROMPT_LOGITS_BYTES // (llm.core.worker.model_config.vocab_size * 4)
    text = " ".join(
        f"Line {i}: the lighthouse keeper counts {i * 7 % 13} ships." for i in range(200)
    )
    ids = llm.tokenizer.encode(text)[: int(rows * num_slices)]
    assert len(ids) == int(rows * num_slices)
    return ids


def _assert_close(got: list[PositionLogprobs | None], want: list[PositionLogprobs | None]) -> None:
    """Same positions, the same scored tokens with logprobs equal to 1e-4 (the computation order
    differs between a whole prefill and chunks attending to cached blocks)."""
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g is not None and w is not None
        for token_id, lp in w.items():
            if token_id in g:
                assert g[token_id] == pytest.approx(lp, abs=1e-4)
        # the top 2 may swap only where they are tied to 1e-4
        assert set(g) == set(w) or abs(list(w.values())[0] - list(w.values())[1]) < 1e-4


def test_long_prompt_scored_in_slices_equals_transformers(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    ids = _long_prompt(llm, 1.5)  # one whole slice and half of one
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    ref = AutoModelForCausalLM.from_pretrained(str(llm.core.worker.model_dir), dtype=torch.float32)
    with torch.inference_mode():
        ref_lp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    # fp32 sums over a 768-token context in another order: equal to 3e-4
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry is not None and ids[pos] in entry
        top = ref_lp[pos - 1].topk(3)
        assert entry[ids[pos]] == pytest.approx(float(ref_lp[pos - 1, ids[pos]]), abs=3e-4)
        assert list(entry.values())[:3] == pytest.approx(top.values.tolist(), abs=3e-4)


def test_slices_give_the_unsliced_result(llm: LLM) -> None:
    """The same hidden states scored one row, seven rows or all rows at a time (the real
    lm_head): the same entries."""
    runner = llm.core.worker.runner
    vocab = llm.core.worker.model_config.vocab_size
    hidden = torch.randn(
        50, llm.core.worker.model_config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    targets = torch.randint(vocab, (50,), generator=torch.Generator().manual_seed(1)).tolist()

    def score(max_bytes: int) -> list[PositionLogprobs]:
        return prompt_logprobs(hidden, targets, 4, runner.compute_logits, vocab, max_bytes)

    whole = score(1 << 40)
    for rows in (1, 7):
        sliced = score(rows * vocab * 4)
        assert [list(e) for e in sliced] == [list(e) for e in whole]
        for s, w in zip(sliced, whole, strict=True):
            assert list(s.values()) == pytest.approx(list(w.values()), abs=1e-6)


@pytest.fixture(scope="module")
def unchunked(llm: LLM) -> list[list[PositionLogprobs | None]]:
    """Every prompt scored in one whole prefill (one step holds them all): the reference."""
    outs = llm.generate(prompts16(), replace(SCORE, max_tokens=1))
    return [o.prompt_logprobs or [] for o in outs]


def test_chunked_prefill_and_preemption_score_the_same(
    unchunked: list[list[PositionLogprobs | None]],
) -> None:
    # 24 blocks of 16 tokens cannot hold 16 sequences of ~50 tokens: preemption by recompute
    # (positions already scored are not scored again). A 24-token budget splits the longer
    # prompts into chunks, each scoring its part.
    small = LLM(dtype="float32", num_kv_blocks=24, max_num_batched_tokens=24)
    outs = small.generate(prompts16(), SCORE)
    assert small.core.scheduler.num_preemptions > 0
    assert small.core.block_manager.num_used_blocks == 0
    assert max(len(o.prompt_token_ids) for o in outs) > 24
    for out, want in zip(outs, unchunked, strict=True):
        assert out.prompt_logprobs is not None
        _assert_close(out.prompt_logprobs, want)


def test_n_children_score_the_prompt_once(llm: LLM) -> None:
    """n=4 with prompt logprobs: child 0 scores the prompt, children 1-3 reuse its full blocks
    through the prefix cache (computing only the partial last block), instead of four scorings."""
    ids = _long_prompt(llm, 0.5)
    block = llm.core.block_manager.block_size
    alone = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=2, prompt_logprobs=1)
    before = llm.core.scheduler.num_computed_tokens
    out = llm.generate([ids], params)[0]
    computed = llm.core.scheduler.num_computed_tokens - before
    tail = len(ids) - (len(ids) - 1) // block * block  # what a cache hit leaves to compute
    assert computed <= len(ids) + 3 * tail + 4 * 2
    assert len(out.outputs) == 4 and out.num_generated_tokens == 8
    assert out.prompt_logprobs == alone.prompt_logprobs
    assert llm.core.block_manager.num_used_blocks == 0
