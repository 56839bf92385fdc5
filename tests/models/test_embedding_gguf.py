"""An embedding model's GGUF names its pooling (`{arch}.pooling_type`, llama.cpp's enum): mean
and last are kept in the converted config (what `--pooling auto` follows), the others are not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, PoolingType

from tests.models.gguf_from_hf import resolved_gguf, write_gguf


@pytest.mark.parametrize(
    ("kind", "expected"),
    [(PoolingType.MEAN, "mean"), (PoolingType.LAST, "last"), (PoolingType.CLS, None),
     (None, None)],  # fmt: skip
)
def test_gguf_pooling_type_reaches_the_config(
    kind: PoolingType | None, expected: str | None, tmp_path: Path
) -> None:
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    path = tmp_path / "tiny.gguf"
    write_gguf(model, "llama", path, GGMLQuantizationType.F32,
               metadata=None if kind is None else lambda w: w.add_pooling_type(kind))  # fmt: skip
    assert resolved_gguf(path, tmp_path / "converted").config.pooling_type == expected
