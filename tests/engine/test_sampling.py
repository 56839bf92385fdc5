"""Stop strings, logprobs against transformers, n / best_of, abort, min_tokens, logit_bias,
penalties, top_k / min_p."""

from __future__ import annotations

import asyncio
import functools
import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from convoy import LLM, FinishReason, RequestOutput, RequestOutputKind, SamplingParams
from convoy.outputs import CompletionOutput

PROMPT = "The capital of France is"
REPETITIVE = "Repeat after me: cat cat cat cat cat cat cat cat"


@pytest.fixture(scope="module")
def reference(llm: LLM) -> nn.Module:
    """transformers' model on the same weights (the HF folder Convoy converted), fp32."""
    from transformers import AutoModelForCausalLM

    model: nn.Module = AutoModelForCausalLM.from_pretrained(
        str(llm.core.worker.model_dir), dtype=torch.float32
    )
    return model


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


def test_logprobs_equal_reference_log_softmax(llm: LLM, reference: nn.Module) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=3)
    out = llm.generate([PROMPT], params)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.inference_mode():
        ref_lp = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)
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
    assert all(len({c.text for c in o.outputs}) == 3 for o in outs)  # n samples differ
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


def test_aborting_waiting_requests_frees_them_and_the_others_finish() -> None:
    """One sequence at a time (max_num_seqs=1): aborting requests still waiting (one alone, one
    of n=3 children) ends them with finish reason abort and no tokens; the running request and
    the one queued behind them run to their end; nothing is left in the scheduler."""
    one = LLM(dtype="float32", max_num_seqs=1)
    params = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    ids = one.tokenizer.encode(PROMPT)
    results: dict[str, RequestOutput] = {}
    for name, n in [("running", 1), ("aborted", 1), ("aborted_n", 3), ("queued", 1)]:
        request = one.frontend.inputs.process(ids, replace(params, n=n), name)
        one.frontend.add(request, functools.partial(results.__setitem__, name))
    one.frontend.step()
    assert one.core.stats().num_running == 1 and one.core.stats().num_waiting == 5
    one.frontend.abort("aborted")
    one.frontend.abort("aborted_n")
    assert one.core.stats().num_waiting == 1
    for name, n in [("aborted", 1), ("aborted_n", 3)]:
        assert results[name].finished and len(results[name].outputs) == n
        assert all(c.finish_reason == FinishReason.ABORT for c in results[name].outputs)
        assert all(c.token_ids == [] for c in results[name].outputs)
    while one.frontend.has_work():
        one.frontend.step()
    for name in ("running", "queued"):
        (choice,) = results[name].outputs
        assert choice.finish_reason == FinishReason.LENGTH and len(choice.token_ids) == 4
    assert results["running"].outputs[0].token_ids == results["queued"].outputs[0].token_ids
    assert one.core.block_manager.num_used_blocks == 0 and one.core.stats().num_waiting == 0


def test_max_tokens_zero_scores_the_prompt_only(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1))[0]
    choice = out.outputs[0]
    assert choice.token_ids == [] and choice.text == ""
    assert choice.finish_reason == FinishReason.LENGTH
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert llm.core.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("prompt", [REPETITIVE, "1, 2, 1, 2, 1, 2, 1, 2,"])
def test_repetition_penalty_equals_transformers(
    llm: LLM, reference: nn.Module, prompt: str
) -> None:
    """Greedy with repetition_penalty 1.3 (over prompt and output tokens) takes transformers'
    tokens (its RepetitionPenaltyLogitsProcessor), and leaves the repetitive greedy text."""
    plain = SamplingParams(temperature=0, max_tokens=12)
    greedy = llm.generate([prompt], plain)[0].outputs[0].token_ids
    out = llm.generate([prompt], replace(plain, repetition_penalty=1.3))[0]
    ids = torch.tensor([out.prompt_token_ids])
    with torch.inference_mode():
        ref = reference.generate(  # type: ignore[operator]
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
            repetition_penalty=1.3,
        )  # fmt: skip
    tokens = out.outputs[0].token_ids
    assert tokens == ref[0, ids.shape[1] :].tolist()[: len(tokens)] and len(tokens) >= 8
    assert tokens[:8] != greedy[:8]


@pytest.mark.parametrize(("presence", "frequency"), [(2.0, 0.0), (0.0, 1.0), (0.5, 0.5)])
def test_presence_and_frequency_penalties_pick_the_penalized_argmax(
    llm: LLM, presence: float, frequency: float
) -> None:
    """Each greedy token is the argmax of logprob - frequency * count - presence * (count > 0)
    over the tokens generated before it (penalties are additive: the raw logprobs the engine
    reports give the penalized argmax), and the penalties change the repetitive greedy text."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=20)
    greedy = llm.generate([REPETITIVE], params)[0].outputs[0]
    out = llm.generate(
        [REPETITIVE], replace(params, presence_penalty=presence, frequency_penalty=frequency)
    )[0].outputs[0]
    assert out.logprobs is not None
    counts: dict[int, int] = {}
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
        top20 = list(entry.items())[:20]  # the raw top 20, then the token if not among them

        def penalized(item: tuple[int, float]) -> float:
            n = counts.get(item[0], 0)
            return item[1] - frequency * n - presence * (n > 0)

        best_id, best_lp = max(top20, key=penalized)
        # Penalties only lower logprobs: beating the 20th raw one makes it the global argmax.
        assert penalized((best_id, best_lp)) >= top20[-1][1]
        assert token_id == best_id
        counts[token_id] = counts.get(token_id, 0) + 1
    assert out.token_ids != greedy.token_ids


def _sampled_ranks(choices: list[CompletionOutput]) -> list[tuple[float, float]]:
    """(sampled token's logprob, the top logprob) at every generated position of every choice."""
    pairs = []
    for c in choices:
        assert c.logprobs is not None
        for token_id, entry in zip(c.token_ids, c.logprobs, strict=True):
            pairs.append((entry[token_id], next(iter(entry.values()))))
    return pairs


SPREAD = SamplingParams(n=16, temperature=2.0, seed=3, max_tokens=3, ignore_eos=True, logprobs=2)


def test_top_k_limits_samples_to_the_k_best(llm: LLM) -> None:
    """Over 16 seeded samples x 3 tokens at temperature 2: top_k=2 only ever yields one of the
    two most likely tokens (and both occur); without it, tokens outside the top 2 occur."""
    free = llm.generate([PROMPT], SPREAD)[0].outputs
    top2 = llm.generate([PROMPT], replace(SPREAD, top_k=2))[0].outputs
    for c in top2:
        assert c.logprobs is not None
        assert all(len(e) == 2 for e in c.logprobs)  # the token is one of the two listed
    assert len({c.token_ids[0] for c in top2}) == 2
    assert any(len(e) == 3 for c in free for e in c.logprobs or [])


def test_min_p_drops_tokens_below_its_share_of_the_top(llm: LLM) -> None:
    """min_p=0.3 at temperature 1: every sampled token has p >= 0.3 * p_max; without it some
    sampled tokens fall below."""
    params = replace(SPREAD, temperature=1.0)
    free = _sampled_ranks(llm.generate([PROMPT], params)[0].outputs)
    kept = _sampled_ranks(llm.generate([PROMPT], replace(params, min_p=0.3))[0].outputs)
    assert all(lp >= math.log(0.3) + top - 1e-5 for lp, top in kept)
    assert any(lp < math.log(0.3) + top for lp, top in free)


@pytest.mark.parametrize("option", [{"top_k": 1}, {"min_p": 1.0}])
def test_top_k_1_and_min_p_1_equal_greedy(llm: LLM, option: dict[str, float]) -> None:
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    params = SamplingParams(n=4, temperature=1.5, seed=11, max_tokens=12, ignore_eos=True)
    sampled = llm.generate([PROMPT], replace(params, **option))[0].outputs  # type: ignore[arg-type]
    assert [c.token_ids for c in sampled] == [greedy[0].outputs[0].token_ids] * 4
