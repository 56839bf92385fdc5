"""IQ4_NL, IQ4_XS, Q2_K and Q3_K GGUFs (#25) load with every linear kept in its blocks (the IQ4
codebook panels, or 4-bit panels with a scale and an offset per half), and the quantized mode's
accuracy against the exact mode (the same file dequantized) is stated per type: top-1 agreement
and perplexity of the prompts' next tokens. A tiny random Llama whose weights were quantized by
tests/models/quantize_more.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from convoy.kernels.linear import QuantLinear
from convoy.kernels.ops import QUANT_KIND_I4, QUANT_KIND_Q3, QUANT_KIND_Q4D, QUANT_TYPES
from convoy.models.loader import load_model
from tests.models.gguf_from_hf import resolved_gguf, write_gguf
from tests.models.harness import convoy_greedy

pytestmark = pytest.mark.usefixtures("cpu_kernels")

KIND = {Q.IQ4_NL: QUANT_KIND_I4, Q.IQ4_XS: QUANT_KIND_I4, Q.Q2_K: QUANT_KIND_Q4D,
        Q.Q3_K: QUANT_KIND_Q3}  # fmt: skip
# Measured (seeded): top-1 IQ4_NL 0.983, IQ4_XS 0.992, Q2_K 0.975, Q3_K 0.983; perplexity ratios
# 0.9999-1.0009
TOP1_FLOOR = 0.9
PPL_CEILING = 1.01  # quantized / exact perplexity


def _tiny_llama() -> Any:
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).eval()


def _nll(logits: list[torch.Tensor], prompts: list[list[int]]) -> float:
    """Mean negative log-likelihood of each prompt's next tokens (logits row i predicts i + 1)."""
    total, count = 0.0, 0
    for lg, p in zip(logits, prompts, strict=True):
        logp = torch.log_softmax(lg.double(), -1)
        nxt = torch.tensor(p[1:])
        total -= float(logp[torch.arange(len(nxt)), nxt].sum())
        count += len(nxt)
    return total / count


@pytest.mark.parametrize("qtype", list(KIND), ids=lambda t: t.name)
def test_kept_in_their_blocks_with_stated_accuracy(qtype: Q, tmp_path: Path) -> None:
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(_tiny_llama(), "llama", path, qtype)
    resolved = resolved_gguf(path, tmp_path / "converted")
    cfg, cpu = resolved.config, torch.device("cpu")
    quant = load_model(resolved, torch.float32, cpu, QUANT_TYPES)
    linears = [m for m in quant.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 4 * 2 + 2  # qkv, o, gate_up, down a layer; the head; the embedding
    assert {m.panel_kind for m in linears} == {KIND[qtype]}
    assert all(m.qtypes == (int(qtype),) * len(m.qtypes) for m in linears)
    exact = load_model(resolved, torch.float32, cpu)
    assert not any(isinstance(m, QuantLinear) for m in exact.modules())
    quant.use_native_kernels(True)

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 23, 57)]
    e_logits, _ = convoy_greedy(exact, cfg, prompts, steps=1)
    q_logits, q_tokens = convoy_greedy(quant, cfg, prompts, steps=6)
    agree = sum(
        int((e.argmax(-1) == q.argmax(-1)).sum()) for e, q in zip(e_logits, q_logits, strict=True)
    )
    top1 = agree / sum(len(p) for p in prompts)
    ratio = math.exp(_nll(q_logits, prompts) - _nll(e_logits, prompts))
    print(f"{qtype.name}: top-1 {top1:.3f}, perplexity quantized / exact {ratio:.4f}")
    assert top1 >= TOP1_FLOOR
    assert ratio <= PPL_CEILING

    # batch invariance through the model: the middle prompt alone gives the same bits
    alone_logits, alone_tokens = convoy_greedy(quant, cfg, prompts[1:2], steps=6)
    assert torch.equal(alone_logits[0], q_logits[1])
    assert alone_tokens[0] == q_tokens[1]
