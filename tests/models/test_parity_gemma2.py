"""Gemma 2 without downloads: a tiny random Gemma2ForCausalLM (4 layers: sliding on the even ones,
window 8; small caps so soft-capping changes the results; query_pre_attn_scalar != head_dim),
loaded as a Hugging Face folder and as a GGUF written from it (tests/models/gguf_from_hf.py).
transformers runs eager attention: its SDPA path ignores the attention cap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from convoy.kernels.ops import QUANT_TYPES
from convoy.model_config import ModelConfig
from convoy.models.attention import Attention
from convoy.models.gemma2 import Gemma2ForCausalLM
from convoy.models.loader import load_model
from convoy.models.resolve import resolve_model
from tests.models.gguf_from_hf import resolved_gguf, write_gguf
from tests.models.harness import convoy_greedy, reference_greedy

LOGIT_ATOL = 1e-4
STEPS = 24
ATTN_CAP, FINAL_CAP = 2.0, 3.0


def _reference(query_pre_attn_scalar: int = 24) -> Any:
    """The model; a GGUF has no query_pre_attn_scalar (llama.cpp takes head_dim): 32 for those."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Gemma2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        initializer_range=0.2, sliding_window=8, query_pre_attn_scalar=query_pre_attn_scalar,
        attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=FINAL_CAP,
    )  # fmt: skip
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # Gemma's norms start at 0 (a scale of 1): make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model


def test_gemma2_config_facts() -> None:
    """google/gemma-2-2b's config.json (no layer_types: even layers slide) and llama.cpp's GGUF
    rules (query_pre_attn_scalar: head_dim, or hidden / heads for the 46-layer 27B)."""
    raw = {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000,
        "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "rope_theta": 10000.0, "hidden_activation":
        "gelu_pytorch_tanh", "tie_word_embeddings": True, "max_position_embeddings": 8192,
    }  # fmt: skip
    cfg = ModelConfig.from_dict(raw)
    assert [cfg.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    assert not cfg.qk_norm and cfg.rope_local_theta is None
    for layers, hidden, heads, want in ((26, 2304, 8, 256), (46, 4608, 32, 144)):
        gguf = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
                "head_dim": 128 if layers == 46 else 256}  # fmt: skip
        Gemma2ForCausalLM.gguf_config("gemma2", gguf, lambda key, default=None: default)
        assert gguf["query_pre_attn_scalar"] == want
        assert (gguf["attn_logit_softcapping"], gguf["final_logit_softcapping"]) == (50.0, 30.0)
        assert gguf["layer_types"][:2] == ["sliding_attention", "full_attention"]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    # lengths straddle the block size (4) and the window (8)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]


def _assert_parity(ref: Any, model: Any, cfg: Any, native: bool) -> None:
    """Batched (all prompts in one step, then decoded together) and alone (the last prompt by
    itself): transformers' prefill logits within LOGIT_ATOL and its greedy tokens."""
    prompts = _prompts()
    batched = convoy_greedy(model, cfg, prompts, steps=STEPS, native_decode=native)
    alone = convoy_greedy(model, cfg, prompts[-1:], steps=STEPS, native_decode=native)
    runs = [*zip(prompts, *batched, strict=True), (prompts[-1], alone[0][0], alone[1][0])]
    for prompt, our_logits, our_tokens in runs:
        ref_logits, ref_tokens = reference_greedy(ref, prompt, steps=STEPS)
        assert (our_logits - ref_logits).abs().max().item() < LOGIT_ATOL
        assert our_tokens == ref_tokens


def _assert_caps_matter(ref: Any, model: Any, cfg: Any) -> None:
    """Without either cap the same prefill logits are far off transformers': the parity checks
    above would catch a path that skipped one."""
    prompt = _prompts()[-1]
    ref_logits, _ = reference_greedy(ref, prompt, steps=1)
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    for attn in attns:
        attn.softcap = None
    try:
        (logits,), _ = convoy_greedy(model, cfg, [prompt], steps=1)
    finally:
        for attn in attns:
            attn.softcap = ATTN_CAP
    assert (logits - ref_logits).abs().max().item() > 1e-2
    model.cfg.final_logit_softcapping = None
    try:
        (logits,), _ = convoy_greedy(model, cfg, [prompt], steps=1)
    finally:
        model.cfg.final_logit_softcapping = FINAL_CAP
    assert (logits - ref_logits).abs().max().item() > 1e-2


@pytest.mark.parametrize("native", [False, True])
def test_gemma2_folder_parity(native: bool, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The Hugging Face folder, fp32, torch ops or the CPU kernels (decode attention with the
    cap in csrc/paged_attention.cpp): transformers' logits and greedy tokens."""
    if native:
        request.getfixturevalue("cpu_kernels")
    ref = _reference()
    ref.save_pretrained(tmp_path)
    resolved = resolve_model(str(tmp_path))
    cfg = resolved.config
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (ATTN_CAP, FINAL_CAP)
    assert [cfg.layer_window(i) for i in range(4)] == [8, None, 8, None]
    model = load_model(resolved, torch.float32, torch.device("cpu"))
    assert isinstance(model, Gemma2ForCausalLM)
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    assert all(a.softcap == ATTN_CAP and a.scale == 24**-0.5 for a in attns)
    assert all(getattr(m, "q_norm", None) is None for m in model.modules())
    _assert_parity(ref, model, cfg, native)
    if not native:
        _assert_caps_matter(ref, model, cfg)


def test_gemma2_gguf_parity(tmp_path: Path) -> None:
    """A GGUF of F32 tensors (llama.cpp's names, norms stored as 1 + w, the caps and window as
    metadata), dequantized load: transformers' logits and greedy tokens."""
    ref = _reference(query_pre_attn_scalar=32)
    path = tmp_path / "gemma2.gguf"
    write_gguf(ref, "gemma2", path, Q.F32)
    resolved = resolved_gguf(path, tmp_path / "converted")
    cfg = resolved.config
    assert cfg.architecture == "Gemma2ForCausalLM" and cfg.tie_word_embeddings
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (ATTN_CAP, FINAL_CAP)
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar) == (8, 32)
    assert [cfg.layer_window(i) for i in range(4)] == [8, None, 8, None]
    model = load_model(resolved, torch.float32, torch.device("cpu"))
    _assert_parity(ref, model, cfg, native=False)


def _decode_steps(model: Any, cfg: Any, prompts: list[list[int]], steps: int) -> list[Any]:
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
def test_gemma2_gguf_q8_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q8_0 linears kept in their blocks: top-1 agreement of the prefill logits with the exact
    load; each decode step's layer is one kernels.decode_layer call (the cap passed on) with the
    per-op path's bits, close to the torch decode attention's, and a sequence's hidden states are
    the same bits alone and batched."""
    from convoy import kernels
    from convoy.kernels.linear import QuantLinear
    from convoy.models import llama

    ref = _reference(query_pre_attn_scalar=32)
    path = tmp_path / "gemma2.gguf"
    write_gguf(ref, "gemma2", path, Q.Q8_0)
    resolved = resolved_gguf(path, tmp_path / "converted")
    cfg, cpu = resolved.config, torch.device("cpu")
    quant = load_model(resolved, torch.float32, cpu, QUANT_TYPES)
    assert isinstance(quant.lm_head, QuantLinear)
    exact = load_model(resolved, torch.float32, cpu)
    quant.use_native_kernels(True)
    prompts = _prompts()
    e_logits, _ = convoy_greedy(exact, cfg, prompts, steps=1)
    q_logits, _ = convoy_greedy(quant, cfg, prompts, steps=1)
    agree = sum(
        int((e.argmax(-1) == q.argmax(-1)).sum()) for e, q in zip(e_logits, q_logits, strict=True)
    )
    top1 = agree / sum(len(p) for p in prompts)
    print(f"gemma2 Q8_0: top-1 {top1:.3f}")
    assert top1 >= 0.9
    assert all(lg.abs().max() < FINAL_CAP for lg in q_logits)

    layers = [m for m in quant.modules() if isinstance(m, llama.FusedDecodeLayer)]
    assert len(layers) == 4 and all(layer.fused_weights() is not None for layer in layers)
    batch = _decode_steps(quant, cfg, prompts[:3], steps=4)
    assert len(batch) == 3
    caps: list[float] = []
    real = kernels.decode_layer

    def counted(*args: Any) -> torch.Tensor:
        caps.append(args[-1])
        return real(*args)

    monkeypatch.setattr(llama.kernels, "decode_layer", counted)
    with torch.inference_mode():
        for ids, positions, meta, _ in batch:
            caps.clear()
            fused = quant(ids, positions, meta)
            assert caps == [ATTN_CAP] * len(layers)
            for layer in layers:
                layer.native = False  # its sublayers keep their native kernels
            try:
                per_op = quant(ids, positions, meta)
            finally:
                for layer in layers:
                    layer.native = True
            assert torch.equal(fused, per_op)
            meta.native_decode = False  # the torch decode path's cap (not the kernel's)
            try:
                torch_attention = quant(ids, positions, meta)
            finally:
                meta.native_decode = True
            assert (fused - torch_attention).abs().max().item() < 1e-4  # uncapped: ~1.7
    alone = _decode_steps(quant, cfg, prompts[1:2], steps=4)
    for (_, _, _, together), (_, _, _, one) in zip(batch, alone, strict=True):
        assert torch.equal(together[1], one[0])
