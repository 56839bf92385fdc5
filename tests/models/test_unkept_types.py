"""A GGUF whose linears have types Convoy does not keep quantized still loads, with one warning
line naming a count per type and a few of the tensors (#25)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from convoy.models.gguf_quant import quantized_linears
from tests.models.gguf_from_hf import resolved_gguf, write_gguf


def _tiny_llama() -> torch.nn.Module:
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).eval()


def test_one_warning_names_the_linears_left_dequantized(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(_tiny_llama(), "llama", path, Q.Q8_0)
    resolved = resolved_gguf(path, tmp_path / "converted")
    with caplog.at_level(logging.WARNING, logger="convoy.models.gguf_quant"):
        quant = quantized_linears(path, resolved.model_dir, {int(Q.Q4_0)})  # Q8_0 not wanted
    assert quant == {}
    lines = [r.getMessage() for r in caplog.records if r.name == "convoy.models.gguf_quant"]
    assert len(lines) == 1, lines
    # 7 linears of the layer + output; the token embedding is not a linear here (untied)
    assert "8 linear tensors" in lines[0] and "8 Q8_0" in lines[0], lines[0]
    assert "blk.0." in lines[0] and "(Q8_0)" in lines[0] and "5 more" in lines[0], lines[0]
    with caplog.at_level(logging.WARNING, logger="convoy.models.gguf_quant"):
        caplog.clear()
        kept = quantized_linears(path, resolved.model_dir, {int(Q.Q8_0)})
    assert kept and not caplog.records
