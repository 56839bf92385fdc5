"""F16 and BF16 GGUF linears (#25) run by csrc/bf16_linear.cpp as stored: 16-bit panels widened
to fp32 in registers, never an fp32 copy of the weight. The kernel against a widen + matmul
reference (row counts 1..300, panel remainders), bit for bit batch invariant; and a tiny Llama
written as an F16 and a BF16 GGUF (tied and untied heads) loads with every linear kept 16-bit and
gives the exact mode's greedy tokens (the same file dequantized to fp32)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from convoy import kernels
from convoy.kernels.linear import Gguf16Linear, QuantLinear
from convoy.kernels.ops import QUANT_TYPES
from convoy.models.loader import load_model
from convoy.worker.memory import weights_bytes
from tests.models.gguf_from_hf import resolved_gguf, write_gguf
from tests.models.harness import convoy_greedy

pytestmark = pytest.mark.usefixtures("cpu_kernels")

DTYPES = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_kernel_matches_widened_matmul_and_is_batch_invariant(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    n, k = 40, 96  # two whole 16-wide panels and a remainder of 8
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    bias = torch.randn(n, generator=g)
    packed = kernels.pack_bf16_weight(w)
    assert packed.dtype == dtype and packed.shape == (3, k, 16)
    x_all = torch.randn(300, k, generator=g)
    ref_all = x_all.double() @ w.double().T + bias.double()
    one = kernels.bf16_linear(x_all[:1], packed, bias, n)
    for m in (1, 2, 5, 6, 7, 13, 64, 300):
        y = kernels.bf16_linear(x_all[:m], packed, bias, n)
        assert y.shape == (m, n) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), ref_all[:m], rtol=1e-5, atol=1e-5)
        assert torch.equal(y[:1], one)  # row 0's bits whatever the batch
    # bf16 activations come back in bf16
    yb = kernels.bf16_linear(x_all[:7].bfloat16(), packed, None, n)
    assert yb.dtype == torch.bfloat16


def _tiny_llama(tied: bool) -> Any:
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("qtype", list(DTYPES), ids=lambda t: t.name)
def test_gguf_linears_stay_16_bit_and_match_the_exact_mode(
    qtype: Q, tied: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(_tiny_llama(tied), "llama", path, qtype)
    resolved = resolved_gguf(path, tmp_path / "converted")
    cfg, cpu = resolved.config, torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="convoy.models.gguf_quant"):
        quant = load_model(resolved, torch.float32, cpu, QUANT_TYPES)
    assert not [r for r in caplog.records if "dequantized" in r.getMessage()]
    sixteen = [m for m in quant.modules() if isinstance(m, Gguf16Linear)]
    assert len(sixteen) == 4 * 2 + 1  # qkv, o, gate_up, down a layer, and the head
    assert all(m.packed.dtype == DTYPES[qtype] for m in sixteen)
    assert not any(isinstance(m, (QuantLinear, torch.nn.Linear)) for m in quant.modules())
    # the embedding loads dense (fp32) either way; no linear holds an fp32 weight
    big_fp32 = [n for n, p in quant.named_parameters() if p.dtype == torch.float32 and p.dim() == 2]
    assert big_fp32 == ["model.embed_tokens.weight"], big_fp32

    exact = load_model(resolved, torch.float32, cpu)
    quant.use_native_kernels(True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (30, 11, 45)]
    e_logits, e_tokens = convoy_greedy(exact, cfg, prompts, steps=8)
    q_logits, q_tokens = convoy_greedy(quant, cfg, prompts, steps=8)
    assert q_tokens == e_tokens
    for e, q in zip(e_logits, q_logits, strict=True):
        torch.testing.assert_close(q, e, rtol=1e-4, atol=1e-4)  # summation order only
    alone_logits, alone_tokens = convoy_greedy(quant, cfg, prompts[1:2], steps=8)
    assert torch.equal(alone_logits[0], q_logits[1]) and alone_tokens[0] == q_tokens[1]

    # the memory plan counts the linears at 2 bytes a weight, the embedding at 4
    plan = weights_bytes(path, torch.float32, set(QUANT_TYPES))
    params = sum(m.packed.numel() for m in sixteen)  # padded to whole panels: >= the weights
    embed = cfg.vocab_size * cfg.hidden_size
    assert plan <= 2 * params + 4 * embed + 64 * 1024
    assert plan < weights_bytes(path, torch.float32, None)
