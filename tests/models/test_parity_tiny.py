"""Tiny random-weight Llama, Qwen2, Qwen3, Mistral and Gemma 3 configs written as HF folders (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from convoy.models import attention
from convoy.models.loader import load_model
from convoy.models.resolve import resolve_model
from tests.models.harness import convoy_greedy, reference_greedy

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
)
LOGIT_ATOL = 1e-4


def _config(kind: str):
    import transformers as tf

    if kind == "llama":
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=False)
    if kind == "llama3-rope":
        scaling = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
            rope_theta=500000.0,
        )
        return tf.LlamaConfig(**COMMON, rope_parameters=scaling)
    if kind == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=None, head_dim=16)
    if kind == "qwen2":
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=True)
    if kind == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=32)
    if kind == "gemma3":
        return tf.Gemma3TextConfig(
            **COMMON,
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
    raise AssertionError(kind)


def _check_parity(kind: str, tmp_path: Path, native: bool) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager").eval()
    ref.save_pretrained(tmp_path)
    resolved = resolve_model(str(tmp_path))
    ours = load_model(resolved, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    # Lengths straddle the block size (4) and the Gemma sliding window (8).
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]
    logits, tokens = convoy_greedy(ours, resolved.config, prompts, steps=32, native_decode=native)
    if native:
        assert all(m.native for m in ours.modules() if type(m).__name__ == "RMSNorm")
    for prompt, our_logits, our_tokens in zip(prompts, logits, tokens, strict=True):
        ref_logits, ref_tokens = reference_greedy(ref, prompt, steps=32)
        assert (our_logits - ref_logits).abs().max().item() < LOGIT_ATOL
        assert our_tokens == ref_tokens


@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "mistral", "qwen2", "qwen3", "gemma3"])
def test_tiny_parity(kind: str, tmp_path: Path) -> None:
    _check_parity(kind, tmp_path, native=False)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_tiny_parity_native_kernels(kind: str, tmp_path: Path) -> None:
    """With the CPU kernels on: fused norms, rotary + cache writes, gated activations and decode
    attention still give transformers' greedy tokens."""
    _check_parity(kind, tmp_path, native=True)


def test_tiny_gemma_parity_with_window_tiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sliding-window layers attend a prompt's queries in tiles (each against only the keys
    its window reaches); with tiles of 4 the prompts here span several, and transformers'
    greedy tokens still come out."""
    monkeypatch.setattr(attention, "_WINDOW_TILE", 4)
    _check_parity("gemma3", tmp_path, native=False)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3"])
def test_tiny_fused_decode_layers_give_the_per_op_bits(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linears quantized at load (int8), native kernels: each decode step's layer runs as one
    csrc call (kernels.decode_layer) and gives the same logits and tokens, bit for bit, as the
    per-op path: Qwen2's qkv bias, Qwen3's q/k norms, Gemma 3's (1 + w) norms and windows."""
    from convoy import kernels
    from convoy.kernels.linear import quantize_linears
    from convoy.models import llama

    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager")
    ref.save_pretrained(tmp_path)
    resolved = resolve_model(str(tmp_path))
    model = load_model(resolved, torch.float32, torch.device("cpu"))
    assert quantize_linears(model, 8) > 0
    layers = [m for m in model.modules() if isinstance(m, llama.FusedDecodeLayer)]
    assert layers and all(layer.fused_weights() is not None for layer in layers)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 9, 17)]
    calls = []
    decode_layer = kernels.decode_layer

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return decode_layer(*args)  # type: ignore[arg-type]

    logits: list[torch.Tensor] = []  # every compute_logits call: the prefill's, each step's
    compute_logits = model.compute_logits

    def recorded(hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        result = compute_logits(hidden, out=out)
        logits.append(result.clone())  # `out` is the runner's buffer, reused the next step
        return result

    monkeypatch.setattr(llama.kernels, "decode_layer", counted)
    monkeypatch.setattr(model, "compute_logits", recorded)
    fused = convoy_greedy(model, resolved.config, prompts, steps=12, native_decode=True)
    assert len(calls) == 11 * len(layers)  # every decode step after the prefill
    fused_logits, logits[:] = logits[:], []
    monkeypatch.setattr(llama.FusedDecodeLayer, "fused_weights", lambda self: None)
    per_op = convoy_greedy(model, resolved.config, prompts, steps=12, native_decode=True)
    assert len(calls) == 11 * len(layers)
    assert fused[1] == per_op[1]
    assert len(fused_logits) == len(logits) > 11
    assert all(torch.equal(a, b) for a, b in zip(fused_logits, logits, strict=True))
