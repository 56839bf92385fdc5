"""Stop strings, logprobs against transformers, n / best_of, abort, min_tokens, logit_bias."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from convoy import LLM, FinishReason, RequestOutputKind, SamplingParams

PROMPT = "The capital of France is"


def test_stop_string_split_across_tokens(llm: LLM) -> None:
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    tokens = [llm.tokenizer.decode([t]) for t in base.token_ids]
    # A stop string that starts inside token 3 and ends inside token 5.
    start = len("".join(tokens[:3])) + len(tokens[3]) // 2
    stop = base.text[start : len("".join(tokens[:5])) + 1]
    assert len(stop) >= 3
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[
        0
    ].outputs[0]
    assert out.text == base.text[: base.text.index(stop)]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == stop
    kept = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == base.text[: base.text.index(stop) + len(stop)]


def test_logprobs_equal_reference_log_softmax(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(llm.core.worker.model_dir), dtype=torch.float32)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=3)
    out = llm.generate([PROMPT], params)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.inference_mode():
        ref_lp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
    n_prompt = len(out.prompt_token_ids)
    for i, entry in enumerate(out.outputs[0].logprobs or []):
        pos = n_prompt - 1 + i
        top = ref_lp[pos].topk(5)
        assert list(entry)[:5] == top.indices.tolist()
        for token_id, lp in entry.items():
            assert lp == pytest.approx(float(ref_lp[pos, token_id]), abs=1e-4)
        assert ids[pos + 1] in entry
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for k, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry is not None and ids[k] in entry
        assert entry[ids[k]] == pytest.approx(float(ref_lp[k - 1, ids[k]]), abs=1e-4)


def test_n_and_best_of_shapes(llm: LLM) -> None:
    outs = llm.generate(
        ["Once upon a time", "Roses are red"],
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
    )
    assert [len(o.outputs) for o in outs] == [3, 3]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert len({c.text for c in outs[0].outputs}) > 1
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=7, max_tokens=8, logprobs=0)
    best = llm.generate(["Once upon a time"], params)[0]
    assert [c.index for c in best.outputs] == [0, 1]
    # Ranked by the mean logprob per generated token of the raw distribution (what the API
    # reports as each token's logprob), not by the sum, which favours short candidates.
    means = []
    for c in best.outputs:
        assert c.logprobs is not None and c.cumulative_logprob is not None
        sampled = [entry[t] for entry, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert c.cumulative_logprob == pytest.approx(sum(sampled), abs=1e-4)
        means.append(c.cumulative_logprob / len(c.token_ids))
    assert means[0] >= means[1]
    # Every candidate's tokens are counted (usage bills them), not only the returned ones.
    alone = llm.generate(["Once upon a time"], replace(params, n=5, best_of=None))[0]
    assert best.num_generated_tokens == sum(len(c.token_ids) for c in alone.outputs)
    # Seeded children are batch-invariant: best_of's candidates are n=5's five choices.
    candidates = [(c.cumulative_logprob or 0.0) / len(c.token_ids) for c in alone.outputs]
    assert means == pytest.approx(sorted(candidates, reverse=True)[:2], abs=1e-5)


def test_min_tokens_logit_bias_and_max_tokens(llm: LLM) -> None:
    eos = llm.tokenizer.eos_token_id
    assert eos is not None
    forced = llm.generate(
        ["Hi"], SamplingParams(temperature=0, max_tokens=5, logit_bias={eos: 100}, min_tokens=3)
    )[0].outputs[0]
    assert len(forced.token_ids) == 4 and forced.token_ids[-1] == eos
    assert forced.finish_reason == FinishReason.STOP
    capped = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert len(capped.token_ids) == 3 and capped.finish_reason == FinishReason.LENGTH


def test_abort_frees_every_block(llm: LLM) -> None:
    from convoy.config import EngineConfig
    from convoy.engine.async_engine import AsyncEngine

    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig(dtype="float32"))
        await engine.start()
        params = SamplingParams(
            temperature=0, max_tokens=500, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        ids = engine.tokenizer.encode("Count to a thousand: 1, 2, 3,")
        requests = [engine.frontend.inputs.process(ids, params, f"r{i}") for i in range(4)]
        streams = [engine.generate(r) for r in requests]
        for s in streams:
            await anext(s)  # every request is running
        assert engine.stats().num_kv_blocks_used > 0
        await engine.abort("r0")
        for s in streams[1:]:
            await s.aclose()  # closing the stream aborts too
        rest = [o async for o in streams[0]]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == FinishReason.ABORT
        for _ in range(200):
            if engine.stats().num_kv_blocks_used == 0 and engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().num_kv_blocks_used == 0
        await engine.shutdown()

    asyncio.run(scenario())


def test_max_tokens_zero_scores_the_prompt_only(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1))[0]
    choice = out.outputs[0]
    assert choice.token_ids == [] and choice.text == ""
    assert choice.finish_reason == FinishReason.LENGTH
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert llm.core.block_manager.num_used_blocks == 0
