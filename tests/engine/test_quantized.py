"""The quantized modes: a GGUF file's blocks kept (the default for GGUF in dtype auto), and bf16/
fp32 weights quantized at load (int8 / int4), all run by csrc/quant_linear.cpp.

Accuracy is stated against the dequantized fp32 path (perplexity of a fixed text), and greedy
output must not depend on what else is in the batch.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from convoy import LLM, SamplingParams
from convoy.kernels.linear import QuantLinear
from tests.engine.conftest import prompts16

TEXT = (
    "The history of the lighthouse begins in the ancient world, when fires were lit on hilltops "
    "to guide ships into harbour. The most famous of these was the Pharos of Alexandria, built in "
    "the third century BC, which stood for more than a thousand years. In the modern era, "
    "lighthouses were fitted with lenses that could project a beam of light many miles out to sea. "
    "The Fresnel lens, invented in France in the 1820s, replaced heavy mirrors with rings of glass "
    "prisms that bent the light into a single horizontal beam, and it made coastal lights visible "
    "for twenty miles or more. Keepers lived in small cottages beside the towers with their "
    "families. Every evening they climbed the spiral stairs to light the lamp, wound the clockwork "
    "that turned the lens, and trimmed the wicks through the night so that the flame never "
    "smoked. In storms they stayed awake until dawn, logging passing ships and watching for "
    "signals of distress. Supplies came by boat once a month, and on remote rocks a change of "
    "weather could leave a station cut off for weeks. During the twentieth century electric lamps "
    "replaced oil, and automatic switches made the keepers unnecessary; the last of them left "
    "their posts in the 1990s. Many towers are now museums, and a few still guide ships, their "
    "beams controlled by computers on the mainland while satellites and radar do most of the "
    "work their keepers once did by hand."
)


@pytest.fixture(scope="module")
def quantized(cpu_kernels: None) -> LLM:
    # The default (the embedded GGUF, dtype auto) without the prefix cache: a prompt run alone
    # first would be a cache hit in the batch after it (the same bits: test_speculative.py
    # tests that; here batches alone are compared).
    return LLM(enable_prefix_caching=False)


def _perplexity(llm: LLM) -> float:
    out = llm.generate([TEXT], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.prompt_logprobs is not None
    ids = out.prompt_token_ids
    lps = [pos[t] for pos, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True) if pos]
    return math.exp(-sum(lps) / len(lps))


def test_the_default_keeps_every_linear_of_the_gguf_quantized(quantized: LLM) -> None:
    worker = quantized.core.worker
    assert worker.quantization == "gguf"
    assert worker.dtype == torch.float32  # activations around the quantized weights
    cfg = worker.model_config
    assert worker.quantized_linears == 4 * cfg.num_layers + 1  # qkv, o, gate_up, down + head
    assert not any(isinstance(m, torch.nn.Linear) for m in worker.model.modules())


def test_perplexity_within_one_percent_of_the_dequantized_path(quantized: LLM, llm: LLM) -> None:
    exact, quant = _perplexity(llm), _perplexity(quantized)
    assert abs(quant / exact - 1) < 0.01, (exact, quant)


def test_batched_equals_alone(quantized: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = prompts16()[:8]
    alone = [quantized.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    batch = quantized.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in batch] == alone


def test_the_thread_count_changes_no_bit(quantized: LLM) -> None:
    """`make test` runs with OMP_NUM_THREADS=1 (two test workers on two cores): here the same
    steps at 1, 2 and 3 threads (every kernel's split of the work) give the same tokens and
    logprobs, batched and alone, with a prompt long enough to be prefilled in chunks."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [*prompts16()[:5], " ".join(prompts16()) * 3]
    saved = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs = [*quantized.generate(prompts, params), quantized.generate(prompts[:1], params)[0]]
            runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    finally:
        torch.set_num_threads(saved)
    assert runs[0] == runs[1] == runs[2]


def test_seeded_sampling_is_batch_invariant(quantized: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    prompts = prompts16()[8:14]
    alone = [quantized.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    batch = quantized.generate(prompts, [params] * len(prompts))
    assert [o.outputs[0].token_ids for o in batch] == alone


def test_explicit_dtype_is_the_dequantized_exact_mode(llm: LLM) -> None:
    assert llm.core.worker.quantization is None
    assert not any(isinstance(m, QuantLinear) for m in llm.core.worker.model.modules())


@pytest.mark.parametrize(("mode", "tol"), [("int8", 0.01), ("int4", 0.02)])
def test_hf_weights_quantized_at_load(cpu_kernels: None, llm: LLM, mode: str, tol: float) -> None:
    """The converted fp32 folder of the default model is a Hugging Face folder: quantized at
    load to Q8_0 (int8) or Q4_1 with a Q8_0 head (int4); the default model was Q4_1, so int4
    lands near its grid again."""
    folder = llm.core.worker.model_dir
    q = LLM(model=str(folder), quantization=mode)
    worker = q.core.worker
    assert worker.quantization == mode
    assert worker.quantized_linears == 4 * worker.model_config.num_layers + 1
    exact, quant = _perplexity(llm), _perplexity(q)
    assert abs(quant / exact - 1) < tol, (exact, quant)


@pytest.mark.slow  # Gemma 3 loaded twice, quantized and fp32 (~60 s): not in make test-fast
def test_gemma_mixed_block_types_run_quantized(
    cpu_kernels: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3's GGUF mixes Q5_0, Q8_0, Q4_K and Q6_K (its fused qkv is Q5_0 + Q5_0 + Q8_0):
    every linear runs quantized, within 1.5% of the dequantized path, batch invariant; its fused
    decode layers (q/k norms, four (1 + w) norms, GELU) give the bits of the per-op path."""
    quant = LLM(model="gemma3-270m", enable_prefix_caching=False)
    worker = quant.core.worker
    assert worker.quantized_linears == 4 * worker.model_config.num_layers + 1
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = prompts16()[:4]
    alone = [quant.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in quant.generate(prompts, params)] == alone
    _assert_fused_layers_equal_per_op(quant, monkeypatch)
    ppl_quant = _perplexity(quant)
    del quant
    exact = _perplexity(LLM(model="gemma3-270m", dtype="float32"))
    # NOTE: the int8 activations set this distance, not the weights: since the K-quants keep the
    # file's scales their dequantized rows are the file's bits (fp16-rounded d * sc before), yet
    # the perplexity moved from 0.18% to 1.04% off, the mean |logprob difference| per token from
    # 0.048 to 0.052 (how the activations' rounding errors add up); 1.5% keeps that margin.
    assert abs(ppl_quant / exact - 1) < 0.015, (exact, ppl_quant)


def test_fused_decode_layer_gives_the_bits_of_the_per_op_path(
    quantized: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a decode step every layer of the default mode runs as one kernel call
    (csrc/decoder_layer.cpp); the same kernels in the same order as the per-op path, so the
    same hidden states, bit for bit, at one sequence and at several. (Gemma 3: below.)"""
    _assert_fused_layers_equal_per_op(quantized, monkeypatch)


def _assert_fused_layers_equal_per_op(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    from convoy.models import llama

    model = llm.core.worker.runner.model
    layers = [m for m in model.modules() if isinstance(m, llama.FusedDecodeLayer)]
    assert layers and all(layer.native and layer.fused_weights() is not None for layer in layers)
    steps: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
    forward = model.forward

    def capture(ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        if meta.all_decode:
            steps.append((ids.clone(), positions.clone(), meta))
        return forward(ids, positions, meta)

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    model.forward = capture
    # steps of decode rows only: no draft to verify (a verification step runs the per-op path)
    mode, llm.core.scheduler.drafts.mode = llm.core.scheduler.drafts.mode, "off"
    try:
        llm.generate(prompts16()[:1], params)
        llm.generate(prompts16()[:5], params)
    finally:
        del model.forward
        llm.core.scheduler.drafts.mode = mode
    assert {int(ids.shape[0]) for ids, _, _ in steps} >= {1, 5}
    calls = []
    fused_layer = llama.kernels.decode_layer

    def counted(*args: Any) -> torch.Tensor:
        calls.append(1)
        return fused_layer(*args)

    monkeypatch.setattr(llama.kernels, "decode_layer", counted)
    with torch.inference_mode():
        for ids, positions, meta in steps:
            # Re-running a step rewrites its K/V slots with the same values.
            calls.clear()
            fused = model(ids, positions, meta)
            assert len(calls) == len(layers)
            try:
                for layer in layers:
                    layer.native = False  # its sublayers keep their own native kernels
                per_op = model(ids, positions, meta)
            finally:
                for layer in layers:
                    layer.native = True
            assert torch.equal(fused, per_op)
