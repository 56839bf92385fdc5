"""Embeddings through the engine (LLM.embed, SamplingParams.pooling): prefill-only sequences in
the same steps as generation, pooled from the final hidden states. Against transformers' hidden
states (fp32), alone against batched and beside generation, chunked prompts, the prefix cache
(last-token pooling shares it; mean pooling never takes cached blocks), blocks given back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from convoy import LLM
from convoy.sampling_params import Pooling, SamplingParams

TEXTS = [
    "The capital of France is Paris.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "A lighthouse keeper writes a letter to the sea. " * 6,  # several blocks, chunked below
    "Hi",
]


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[torch.Tensor]:
    """transformers' final hidden states (after the last norm) for each text, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llm.core.worker.model_dir), dtype=torch.float32)
    out = []
    with torch.inference_mode():
        for text in TEXTS:
            ids = torch.tensor([llm.tokenizer.encode(text)])
            out.append(model(ids, output_hidden_states=True).hidden_states[-1][0])
    return out


def _unit(v: torch.Tensor) -> np.ndarray:
    v64 = v.double().numpy()
    return v64 / np.linalg.norm(v64)


def test_last_token_pooling_matches_transformers(llm: LLM, reference: list[torch.Tensor]) -> None:
    assert llm.core.pooling is Pooling.LAST  # auto for a generative model
    embeddings = llm.embed(TEXTS)
    assert [e.shape for e in embeddings] == [(576,)] * len(TEXTS)
    for emb, hidden in zip(embeddings, reference, strict=True):
        assert emb.dtype == np.float32
        assert abs(float(np.linalg.norm(emb)) - 1.0) < 1e-5
        np.testing.assert_allclose(emb, _unit(hidden[-1]), atol=2e-5)
    assert llm.core.block_manager.num_used_blocks == 0  # every block given back


def test_alone_batched_and_beside_generation_agree(llm: LLM) -> None:
    """Within fp32 rounding: a step's row count changes the dense matmuls' blocking (and a
    repeated text's later copies take cached prefix blocks), never the result beyond that."""
    alone = [llm.embed([t])[0] for t in TEXTS]
    batched = llm.embed(TEXTS * 16)  # 64 inputs in the same steps
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    embed = SamplingParams(max_tokens=0, pooling=Pooling.LAST)
    mixed = llm.generate(["Once upon a time", *TEXTS, "The weather today"],
                         [greedy, *[embed] * len(TEXTS), greedy])  # fmt: skip
    assert [len(o.outputs[0].token_ids) for o in (mixed[0], mixed[-1])] == [12, 12]
    for i, a in enumerate(alone):
        np.testing.assert_allclose(batched[i], a, atol=1e-5)
        np.testing.assert_allclose(batched[i + 3 * len(TEXTS)], a, atol=1e-5)
        got = mixed[i + 1].embedding
        assert got is not None
        np.testing.assert_allclose(got, a, atol=1e-5)
        assert mixed[i + 1].outputs[0].token_ids == []  # nothing generated


def test_last_pooling_takes_cached_prefix_blocks(llm: LLM) -> None:
    text = TEXTS[2]  # 60+ tokens: full blocks to share
    first = llm.embed([text])[0]
    out = llm.generate([text], SamplingParams(max_tokens=0, pooling=Pooling.LAST))[0]
    assert out.num_cached_tokens >= 16
    assert out.embedding is not None
    np.testing.assert_allclose(out.embedding, first, atol=1e-6)


def test_mean_pooling_chunked_never_cached(reference: list[torch.Tensor]) -> None:
    # prompts computed in chunks of at most 16 tokens beside each other
    llm = LLM(dtype="float32", pooling="mean", max_num_batched_tokens=16, num_kv_blocks=64)
    assert llm.core.pooling is Pooling.MEAN
    for _ in range(2):  # the second time the prompts' blocks are in the prefix cache
        outs = llm.generate(TEXTS, SamplingParams(max_tokens=0, pooling=Pooling.MEAN))
        for out, hidden in zip(outs, reference, strict=True):
            assert out.num_cached_tokens == 0  # a cached block's hidden states are gone
            assert out.embedding is not None
            np.testing.assert_allclose(out.embedding, _unit(hidden.mean(0)), atol=2e-5)
    assert llm.core.block_manager.num_used_blocks == 0


def test_pooling_params_are_checked() -> None:
    from convoy.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError):
        SamplingParams(max_tokens=4, pooling=Pooling.LAST)
    with pytest.raises(SamplingParamsError):
        SamplingParams(max_tokens=0, n=2, pooling=Pooling.MEAN)
