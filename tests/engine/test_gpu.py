"""The engine on CUDA (marked `gpu`, skipped without a CUDA device): greedy and prompt logprobs
against the CPU fp32 engine, seeded sampling with every option (reproducible, batch invariant),
top_k=1 equal to greedy. The server on CUDA is tests/e2e/test_gpu.py.

CONVOY_TEST_DEVICE=cpu runs the same tests on the CPU: a check of the tests themselves on a
machine without a GPU, not a CUDA result.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from convoy import LLM, SamplingParams
from convoy.structured.params import StructuredOutputsParams
from tests.engine.conftest import prompts16

DEVICE = os.environ.get("CONVOY_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="no CUDA device"
    ),
]

PROMPT = "Tell me a story about a cat."
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def dev() -> LLM:
    """The default model in fp32 on the device (fp32: comparable with the CPU engine)."""
    return LLM(dtype="float32", device=DEVICE)


def test_model_and_kv_cache_are_on_the_device(dev: LLM) -> None:
    worker = dev.core.worker
    assert worker.device.type == torch.device(DEVICE).type
    assert {p.device.type for p in worker.model.parameters()} == {worker.device.type}
    assert worker.runner.kv_cache.k.device.type == worker.device.type


def test_greedy_equals_the_cpu_engine(dev: LLM, llm: LLM) -> None:
    prompts = prompts16()[:4]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert [o.outputs[0].token_ids for o in dev.generate(prompts, GREEDY)] == want


def test_seeded_sampling_with_every_option(dev: LLM) -> None:
    """temperature, top_p, top_k, min_p, the three penalties, logit_bias and min_tokens in one
    request (every sampling tensor on the device): the same tokens alone, again, and in a batch
    beside unseeded and greedy requests; another seed gives other tokens."""
    first = dev.generate([PROMPT], GREEDY)[0].outputs[0].token_ids[0]
    params = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, min_p=0.02, presence_penalty=0.5,
        frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={first: -100.0}, min_tokens=4,
        seed=1234, max_tokens=16, logprobs=2,
    )  # fmt: skip
    alone = dev.generate([PROMPT], params)[0].outputs[0]
    assert alone.token_ids[0] != first  # banned by its bias
    assert len(alone.token_ids) >= 4 and alone.logprobs is not None
    again = dev.generate([PROMPT], params)[0].outputs[0]
    unseeded = SamplingParams(temperature=1.0, max_tokens=16)
    batch = dev.generate(
        ["Hello there", PROMPT, "Why is the sky blue?", PROMPT],
        [unseeded, params, unseeded, GREEDY],
    )
    assert alone.token_ids == again.token_ids == batch[1].outputs[0].token_ids
    assert batch[3].outputs[0].token_ids == dev.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    other = dev.generate([PROMPT], replace(params, seed=99))[0].outputs[0]
    assert other.token_ids != alone.token_ids


def test_logit_bias_and_top_k_1_on_the_device(dev: LLM) -> None:
    greedy = dev.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    top1 = SamplingParams(n=3, temperature=1.5, top_k=1, seed=7, max_tokens=8, ignore_eos=True)
    assert [c.token_ids for c in dev.generate([PROMPT], top1)[0].outputs] == [greedy] * 3
    forced = SamplingParams(temperature=1.0, seed=3, max_tokens=4, logit_bias={42: 100.0})
    assert dev.generate([PROMPT], forced)[0].outputs[0].token_ids == [42] * 4


def test_prompt_logprobs_equal_the_cpu_engine(dev: LLM, llm: LLM) -> None:
    """A prompt longer than one slice of prompt logits, scored on the device and on the CPU."""
    text = " ".join(f"Line {i}: the keeper counts {i * 7 % 13} ships." for i in range(60))
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    got = dev.generate([text], params)[0].prompt_logprobs
    want = llm.generate([text], params)[0].prompt_logprobs
    assert got is not None and want is not None and len(got) == len(want) > 400
    assert got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g is not None and w is not None
        common = set(g) & set(w)
        assert len(common) >= 2  # the scored token and at least one of the top 2
        for token_id in common:
            assert g[token_id] == pytest.approx(w[token_id], abs=1e-3)


def test_constrained_outputs_equal_the_cpu_engine(dev: LLM, llm: LLM) -> None:
    """Grammar bitmasks applied to device logits (and the constraint winning over min_tokens):
    the same greedy tokens as the CPU engine."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = [
        SamplingParams(temperature=0, max_tokens=30, min_tokens=20,
                       structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        SamplingParams(temperature=0, max_tokens=30,
                       structured_outputs=StructuredOutputsParams(json=schema)),
        GREEDY,
    ]  # fmt: skip
    prompts = [PROMPT] * 3
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    got = dev.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == want
    assert got[0].outputs[0].text in ("yes", "no")
