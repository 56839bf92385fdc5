"""Mixture of experts without downloads: tiny random Qwen2-MoE (shared expert), Qwen3-MoE (a
dense layer among the MoE ones) and Mixtral built by transformers from a config, loaded as a
Hugging Face folder and as a GGUF written from it (tests/models/gguf_from_hf.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from convoy.kernels.ops import QUANT_TYPES
from convoy.models.loader import load_model
from convoy.models.moe import Experts, QuantExperts, SparseMoe
from convoy.models.resolve import resolve_model
from tests.models.gguf_from_hf import resolved_gguf, write_gguf
from tests.models.harness import convoy_greedy, reference_greedy

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
)
GGUF_ARCH = {"qwen2moe": "qwen2moe", "qwen3moe": "qwen3moe", "mixtral": "llama"}
LOGIT_ATOL = 1e-4


def _config(kind: str, gguf: bool = False):
    import transformers as tf

    if kind == "qwen2moe":
        return tf.Qwen2MoeConfig(
            **COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=96,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        )  # fmt: skip
    if kind == "qwen3moe":
        return tf.Qwen3MoeConfig(
            **COMMON, head_dim=32, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[] if gguf else [1],
        )  # fmt: skip
    if kind == "mixtral":
        return tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    raise AssertionError(kind)


def _reference(kind: str, gguf: bool = False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = _config(kind, gguf)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]


def _assert_parity(ref, model, cfg, native: bool = False) -> None:
    prompts = _prompts()
    logits, tokens = convoy_greedy(model, cfg, prompts, steps=24, native_decode=native)
    for prompt, our_logits, our_tokens in zip(prompts, logits, tokens, strict=True):
        ref_logits, ref_tokens = reference_greedy(ref, prompt, steps=24)
        assert (our_logits - ref_logits).abs().max().item() < LOGIT_ATOL
        assert our_tokens == ref_tokens


@pytest.mark.parametrize("kind", ["qwen2moe", "qwen3moe", "mixtral"])
def test_moe_folder_parity(kind: str, tmp_path: Path) -> None:
    """The Hugging Face folder, fp32: transformers' logits and greedy tokens."""
    ref = _reference(kind)
    ref.save_pretrained(tmp_path)
    resolved = resolve_model(str(tmp_path))
    model = load_model(resolved, torch.float32, torch.device("cpu"))
    moe = [m for m in model.modules() if isinstance(m, SparseMoe)]
    assert len(moe) == (2 if kind == "qwen3moe" else 3)  # Qwen3's layer 1 is dense here
    assert all(isinstance(m.experts, Experts) for m in moe)
    assert (moe[0].shared_expert is not None) == (kind == "qwen2moe")
    _assert_parity(ref, model, resolved.config)


@pytest.mark.parametrize("kind", ["qwen2moe", "qwen3moe", "mixtral"])
def test_moe_gguf_parity(kind: str, tmp_path: Path) -> None:
    """A GGUF of F32 tensors written from the same model (experts as 3-D tensors, llama's
    permuted Q/K for Mixtral), dequantized load: transformers' logits and greedy tokens."""
    ref = _reference(kind, gguf=True)
    path = tmp_path / f"{kind}.gguf"
    write_gguf(ref, GGUF_ARCH[kind], path, Q.F32)
    resolved = resolved_gguf(path, tmp_path / "converted")
    assert resolved.config.architecture == type(ref).__name__
    model = load_model(resolved, torch.float32, torch.device("cpu"))
    _assert_parity(ref, model, resolved.config)


def _top1_and_ppl(exact, quant, cfg) -> tuple[float, float, float]:
    """Top-1 agreement of the quantized model's prefill logits with the exact one's, and the
    perplexity of the exact model's own greedy text under each."""
    prompts = _prompts()
    e_logits, _ = convoy_greedy(exact, cfg, prompts, steps=1)
    q_logits, _ = convoy_greedy(quant, cfg, prompts, steps=1)
    agree = total = 0
    nll_e = nll_q = 0.0
    for p, le, lq in zip(prompts, e_logits, q_logits, strict=True):
        agree += int((le.argmax(-1) == lq.argmax(-1)).sum())
        total += len(le)
        target = torch.tensor(p[1:])
        nll_e += float(torch.nn.functional.cross_entropy(le[:-1], target, reduction="sum"))
        nll_q += float(torch.nn.functional.cross_entropy(lq[:-1], target, reduction="sum"))
    n = sum(len(p) - 1 for p in prompts)
    return agree / total, float(torch.exp(torch.tensor(nll_e / n))), float(
        torch.exp(torch.tensor(nll_q / n))
    )


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize(("kind", "qtype", "min_top1"), [
    ("qwen2moe", Q.Q8_0, 0.9), ("qwen3moe", Q.Q4_0, 0.9), ("mixtral", Q.Q4_1, 0.9),
])  # fmt: skip
def test_moe_gguf_quantized(kind: str, qtype: Q, min_top1: float, tmp_path: Path) -> None:
    """The experts kept in their GGUF blocks (QuantExperts, one panel buffer for all experts):
    top-1 agreement with the exact load and perplexity of the same text close to it."""
    ref = _reference(kind, gguf=True)
    path = tmp_path / f"{kind}.gguf"
    write_gguf(ref, GGUF_ARCH[kind], path, qtype)
    resolved = resolved_gguf(path, tmp_path / "converted")
    cpu = torch.device("cpu")
    quant = load_model(resolved, torch.float32, cpu, QUANT_TYPES)
    experts = [m.experts for m in quant.modules() if isinstance(m, SparseMoe)]
    assert experts and all(isinstance(e, QuantExperts) for e in experts)
    exact = load_model(resolved, torch.float32, cpu)
    quant.use_native_kernels(True)
    top1, ppl_exact, ppl_quant = _top1_and_ppl(exact, quant, resolved.config)
    print(f"{kind} {qtype.name}: top-1 {top1:.3f}, ppl exact {ppl_exact:.2f} quant {ppl_quant:.2f}")
    assert top1 >= min_top1
    assert abs(ppl_quant / ppl_exact - 1) < 0.05


@pytest.mark.usefixtures("cpu_kernels")
def test_moe_folder_quantized_at_load(tmp_path: Path) -> None:
    """`--quantization int8` on a folder: the experts quantized at load like the linears (the
    comparison includes the weights' own rounding, unlike the GGUF test's; int4 on a random
    64-wide model loses half its top-1 in the dense linears alone, so it is not asserted)."""
    bits = 8
    from convoy.kernels.linear import quantize_linears
    from convoy.models.moe import quantize_experts

    ref = _reference("qwen2moe")
    ref.save_pretrained(tmp_path)
    resolved = resolve_model(str(tmp_path))
    cpu = torch.device("cpu")
    exact = load_model(resolved, torch.float32, cpu)
    quant = load_model(resolved, torch.float32, cpu)
    quantize_linears(quant, bits)
    assert quantize_experts(quant, bits) == 3
    quant.use_native_kernels(True)
    top1, ppl_exact, ppl_quant = _top1_and_ppl(exact, quant, resolved.config)
    print(f"int{bits}: top-1 {top1:.3f}, ppl exact {ppl_exact:.2f} quant {ppl_quant:.2f}")
    assert top1 >= 0.8
    assert abs(ppl_quant / ppl_exact - 1) < 0.05


def _decode_steps(model, cfg, prompts, steps: int) -> list[tuple[Any, ...]]:
    """(ids, positions, meta, hidden out) of every all-decode step of a convoy_greedy run."""
    captured: list[tuple[Any, ...]] = []
    forward = model.forward

    def capture(ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        out = forward(ids, positions, meta)
        if meta.all_decode:
            captured.append((ids.clone(), positions.clone(), meta, out.clone()))
        return out

    model.forward = capture
    try:
        convoy_greedy(model, cfg, prompts, steps=steps, native_decode=True)
    finally:
        del model.forward
    return captured


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize(("kind", "qtype"), [
    ("qwen2moe", Q.Q8_0), ("qwen3moe", Q.Q5_1), ("mixtral", Q.Q4_0),
])  # fmt: skip
def test_moe_fused_decode_layer(kind: str, qtype: Q, tmp_path: Path, monkeypatch) -> None:
    """At a decode step every MoE layer is one kernel call (kernels.decode_moe_layer: attention,
    router, top-k, the routed experts and the shared expert) with the bits of the per-op path,
    and a sequence's hidden states are the same bits alone and beside others (batch invariant)."""
    from convoy import kernels
    from convoy.models import moe

    ref = _reference(kind, gguf=True)
    path = tmp_path / f"{kind}.gguf"
    write_gguf(ref, GGUF_ARCH[kind], path, qtype)
    resolved = resolved_gguf(path, tmp_path / "converted")
    model = load_model(resolved, torch.float32, torch.device("cpu"), QUANT_TYPES)
    model.use_native_kernels(True)
    layers = [m for m in model.modules() if isinstance(m, moe.MoeDecoderLayer)]
    assert layers and all(layer.fused_weights() is not None for layer in layers)
    prompts = _prompts()[:3]
    batch = _decode_steps(model, resolved.config, prompts, steps=4)
    assert len(batch) == 3
    calls: list[int] = []
    real = kernels.decode_moe_layer

    def counted(*args: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(moe.kernels, "decode_moe_layer", counted)
    with torch.inference_mode():
        for ids, positions, meta, _ in batch:
            calls.clear()
            fused = model(ids, positions, meta)
            assert len(calls) == len(layers)
            for layer in layers:
                layer.native = False  # its sublayers keep their native kernels
            try:
                per_op = model(ids, positions, meta)
            finally:
                for layer in layers:
                    layer.native = True
            assert torch.equal(fused, per_op)
    alone = _decode_steps(model, resolved.config, prompts[1:2], steps=4)  # its own KV cache
    for (_, _, _, together), (_, _, _, one) in zip(batch, alone, strict=True):
        assert torch.equal(together[1], one[0])

