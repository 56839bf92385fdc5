"""Quantization gguf holds the GGUF's weights once, in blocks (issue #9): the load never
materialises a dequantized copy of a quantized weight, the tied token embedding looks its rows up
from the head's blocks, and a first start writes no fp32 safetensors. Behavioural: what the
loaded model holds, not timings (bench/memory.py measures the RSS)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from convoy.kernels.linear import QuantLinear
from convoy.kernels.ops import QUANT_TYPES
from convoy.models.gguf_convert import ModelLoadError, field, read_gguf
from convoy.models.gguf_index import read_gguf_index
from convoy.models.layers import CausalLM, QuantEmbedding
from convoy.models.loader import load_model
from convoy.models.resolve import ResolvedModel, embedded_gguf_path, resolve_model

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def loaded(
    cpu_kernels: None, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ResolvedModel, CausalLM]:
    """The default model loaded quantized from a fresh, private cache folder (kernels loaded)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("CONVOY_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    try:
        resolved = resolve_model(MODEL)
        model = load_model(resolved, torch.float32, torch.device("cpu"), QUANT_TYPES)
    finally:
        mp.undo()
    return resolved, model


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the model holds (parameters, buffers, tensor attributes), each storage once;
    not the empty placeholders (the KV cache views before the cache is bound, rope memos)."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for t in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                seen.setdefault(t.untyped_storage().data_ptr(), t)
    return list(seen.values())


def _quantized_tensors(path: Path) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, HF-order shape, bytes) of the GGUF's quantized tensors."""
    reader = read_gguf(path)
    quantized = [gguf.GGMLQuantizationType(q) for q in QUANT_TYPES]
    return [
        (t.name, tuple(int(d) for d in reversed(t.shape)), int(t.n_bytes))
        for t in reader.tensors
        if t.tensor_type in quantized
    ]


def test_first_start_writes_no_dequantized_weights(loaded: tuple[ResolvedModel, CausalLM]) -> None:
    resolved, _ = loaded
    assert (resolved.model_dir / "config.json").is_file()
    assert (resolved.model_dir / "tokenizer.json").is_file()
    assert not list(resolved.model_dir.glob("*.safetensors"))


def test_linears_and_tied_embedding_are_the_blocks(loaded: tuple[ResolvedModel, CausalLM]) -> None:
    resolved, model = loaded
    assert not any(isinstance(m, nn.Linear | nn.Embedding) for m in model.modules())
    embed = model.model.embed_tokens
    assert isinstance(embed, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    assert embed.rows is model.lm_head  # the tied table held once
    assert not any(t.is_meta for t in _tensors(model))


def test_no_float_copy_of_a_quantized_weight(loaded: tuple[ResolvedModel, CausalLM]) -> None:
    resolved, model = loaded
    cfg = resolved.config
    quantized = _quantized_tensors(resolved.weights_path)
    quantized_bytes = sum(n for _, _, n in quantized)
    weight_shapes = {shape for _, shape, _ in quantized}
    floats = [t for t in _tensors(model) if t.is_floating_point()]
    assert not [tuple(t.shape) for t in floats if tuple(t.shape) in weight_shapes]
    assert not [t for t in floats if t.numel() >= cfg.vocab_size * cfg.hidden_size // 8]
    float_bytes = sum(t.numel() * t.element_size() for t in floats)
    assert float_bytes < 0.05 * quantized_bytes, (float_bytes, quantized_bytes)
    held = sum(t.numel() * t.element_size() for t in _tensors(model))
    assert held <= 1.3 * resolved.weights_path.stat().st_size  # issue #9's bound, tensors alone


def test_embedding_rows_are_the_gguf_rows(loaded: tuple[ResolvedModel, CausalLM]) -> None:
    """Looked up from the packed head, the rows are exactly gguf's dequantization of token_embd."""
    resolved, model = loaded
    reader = read_gguf(resolved.weights_path)
    table = next(t for t in reader.tensors if t.name == "token_embd.weight")
    ids = torch.tensor([0, 1, 2, 100, 4097, resolved.config.vocab_size - 1])
    want = gguf.quants.dequantize(np.asarray(table.data[ids.numpy()]), table.tensor_type)
    with torch.inference_mode():
        got = model.embed(ids)
    assert torch.equal(got, torch.from_numpy(np.asarray(want, dtype=np.float32)))


def test_gguf_index_reads_what_gguf_reads() -> None:
    """The light index (no metadata arrays parsed) gives gguf's tensors and scalar fields."""
    path = embedded_gguf_path(MODEL)
    index, reader = read_gguf_index(path), read_gguf(path)
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, ref in zip(index.tensors, reader.tensors, strict=True):
        assert ours.tensor_type == ref.tensor_type and ours.n_bytes == ref.n_bytes, ref.name
        assert np.array_equal(ours.shape, ref.shape), ref.name
        assert ours.data.dtype == ref.data.dtype and ours.data.shape == ref.data.shape, ref.name
        assert np.array_equal(ours.data, ref.data), ref.name
    assert index.fields and all(field(index, k) == field(reader, k) for k in index.fields)
    assert "tokenizer.ggml.tokens" not in index.fields  # arrays are stepped over


def test_gguf_index_rejects_a_truncated_file(tmp_path: Path) -> None:
    full = embedded_gguf_path(MODEL).read_bytes()
    for cut_at in (10, 4096, len(full) // 2):
        cut = tmp_path / "truncated.gguf"
        cut.write_bytes(full[:cut_at])
        with pytest.raises(ModelLoadError, match="truncated.gguf"):
            read_gguf_index(cut)


def _tiny_untied_gguf(folder: Path) -> ResolvedModel:
    """A 2-layer Qwen2 GGUF (qkv biases, its own output head: untied) of Q8_0 weights and fp32
    norms/biases, with the config.json the converter writes (no tokenizer: not needed here)."""
    import json

    from convoy.model_config import ModelConfig
    from convoy.models.gguf_convert import _config
    from convoy.models.registry import gguf_family

    hidden, ffn, vocab, heads, kv_heads, head_dim = 64, 128, 96, 2, 1, 32
    rng = np.random.default_rng(0)
    path = folder / "tiny-qwen2.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_block_count(2)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_context_length(128)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)

    def q8(name: str, rows: int, cols: int) -> None:
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        blocks = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def f32(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    q8("token_embd.weight", vocab, hidden)
    q8("output.weight", vocab, hidden)
    f32("output_norm.weight", hidden)
    for i in range(2):
        for piece, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                            ("attn_v", kv_heads * head_dim)):  # fmt: skip
            q8(f"blk.{i}.{piece}.weight", rows, hidden)
            f32(f"blk.{i}.{piece}.bias", rows)
        q8(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        q8(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        q8(f"blk.{i}.ffn_up.weight", ffn, hidden)
        q8(f"blk.{i}.ffn_down.weight", hidden, ffn)
        f32(f"blk.{i}.attn_norm.weight", hidden)
        f32(f"blk.{i}.ffn_norm.weight", hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    family = gguf_family("qwen2")
    assert family is not None
    out = folder / "converted"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(_config(read_gguf(path), "qwen2", family)))
    return ResolvedModel("tiny", path, out, ModelConfig.from_file(out / "config.json"))


def test_untied_embedding_and_qkv_bias(cpu_kernels: None, tmp_path: Path) -> None:
    """An untied GGUF: the embedding keeps its own blocks, the head its own; biases and norms
    equal the dequantized load's."""
    resolved = _tiny_untied_gguf(tmp_path)
    cpu = torch.device("cpu")
    quant = load_model(resolved, torch.float32, cpu, QUANT_TYPES)
    exact = load_model(resolved, torch.float32, cpu)  # writes and reads the fp32 safetensors
    embed = quant.model.embed_tokens
    assert isinstance(embed, QuantEmbedding) and not embed.is_tied
    assert isinstance(quant.lm_head, QuantLinear) and embed.rows is not quant.lm_head
    assert sum(isinstance(m, QuantLinear) for m in quant.modules()) == 4 * 2 + 2
    assert not any(isinstance(m, nn.Linear | nn.Embedding) for m in quant.modules())
    qkv = quant.model.layers[1].self_attn.qkv_proj
    assert qkv.bias is not None
    assert torch.equal(qkv.bias, exact.model.layers[1].self_attn.qkv_proj.bias)
    exact_params = dict(exact.named_parameters())
    for name, p in quant.named_parameters():  # norms: all that stays a parameter
        assert torch.equal(p, exact_params[name]), name
    ids = torch.arange(resolved.config.vocab_size)
    with torch.inference_mode():
        assert torch.equal(quant.embed(ids), exact.embed(ids))
