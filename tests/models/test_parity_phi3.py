"""Phi-3 without downloads: a tiny random Phi3ForCausalLM with LongRoPE (distinct random short and
long factors, original context 32 of 128 so prompts cross the switch cheaply), built by
transformers, loaded as a folder and as a GGUF written from it (tests/models/gguf_from_hf.py).

transformers switches to the long factors for a forward whose last position + 1 exceeds the
original context, and cached keys keep theirs: prompts shorter than 32 that decode past it and
prompts longer than it both follow it token for token, batched, and with the prompt prefilled
in chunks (Convoy's per-token rule does not depend on the chunking)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from convoy.config import ConfigError
from convoy.kernels.ops import QUANT_TYPES
from convoy.model_config import ModelConfig
from convoy.models.loader import load_model
from convoy.models.phi3 import LongRopeEmbedding
from convoy.models.resolve import resolve_model
from convoy.worker.batch import ScheduledSeq
from convoy.worker.kv_cache import allocate_kv_cache
from convoy.worker.model_runner import ModelRunner
from tests.models.gguf_from_hf import resolved_gguf, write_gguf
from tests.models.harness import convoy_greedy, reference_greedy

HEAD_DIM = 16
ORIG, MAX_POS = 32, 128
LOGIT_ATOL = 1e-4
STEPS = 10
LENGTHS = (10, 25, 31, 32, 33, 50)  # short, crossing while decoding, at and past the switch


def _reference(sliding_window: int | None = None, partial: float = 1.0):
    import transformers as tf

    gen = torch.Generator().manual_seed(3)
    half = int(HEAD_DIM * partial) // 2
    scaling = dict(
        rope_type="longrope",
        short_factor=(1 + torch.rand(half, generator=gen)).tolist(),
        long_factor=(1 + 4 * torch.rand(half, generator=gen)).tolist(),
        partial_rotary_factor=partial,
    )
    cfg = tf.Phi3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS,
        original_max_position_embeddings=ORIG, initializer_range=0.2, rope_scaling=scaling,
        sliding_window=sliding_window, pad_token_id=0, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def _prompts(lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]


def _assert_parity(ref: Any, model: Any, cfg: ModelConfig, native: bool = False) -> None:
    prompts = _prompts()
    logits, tokens = convoy_greedy(model, cfg, prompts, steps=STEPS, native_decode=native)
    for prompt, our_logits, our_tokens in zip(prompts, logits, tokens, strict=True):
        ref_logits, ref_tokens = reference_greedy(ref, prompt, steps=STEPS)
        assert (our_logits - ref_logits).abs().max().item() < LOGIT_ATOL, len(prompt)
        assert our_tokens == ref_tokens, len(prompt)


def _folder(tmp_path: Path, **kw: Any) -> tuple[Any, Any, Any]:
    ref = _reference(**kw)
    ref.save_pretrained(tmp_path)
    resolved = resolve_model(str(tmp_path))
    return ref, resolved, load_model(resolved, torch.float32, torch.device("cpu"))


def test_phi3_longrope_switch_differs() -> None:
    """The tiny model's two factor sets give different tables (else the tests prove nothing),
    and the table row of a token follows the per-sequence rule."""
    ref = _reference()
    cfg = ModelConfig.from_dict(ref.config.to_dict())
    assert cfg.rope_scaling and cfg.rope_scaling["original_max_position_embeddings"] == ORIG
    rope = LongRopeEmbedding(HEAD_DIM, MAX_POS, cfg.rope_theta, cfg.rope_scaling)
    cos, _ = rope.tables(torch.tensor([2 * MAX_POS - 1]))
    assert not torch.allclose(cos[2 * 5], cos[2 * 5 + 1])
    meta = type("M", (), {"prompt_lens": torch.tensor([10, 10, 40, 40])})()
    index = rope.rope_index(torch.tensor([5, 32, 5, 39]), meta)  # type: ignore[arg-type]
    assert index.tolist() == [10, 65, 11, 79]


def test_phi3_folder_parity(tmp_path: Path) -> None:
    """The Hugging Face folder (fused qkv_proj / gate_up_proj), fp32, all prompts in one batch:
    transformers' logits and greedy tokens, short prompts decoding past the switch included."""
    ref, resolved, model = _folder(tmp_path)
    assert resolved.config.architecture == "Phi3ForCausalLM"
    _assert_parity(ref, model, resolved.config)


def _chunked(model: Any, cfg: ModelConfig, prompts: list[list[int]], chunk: int, steps: int):
    """Every prompt prefilled `chunk` tokens a step beside the others' chunks (the scheduler's
    prompt_len on each), then decoded together: each prompt's logits and greedy tokens."""
    bs = 4
    per_seq = (max(map(len, prompts)) + steps + bs - 1) // bs
    kv = allocate_kv_cache(cfg, per_seq * len(prompts), bs, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, kv, torch.device("cpu"), False)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    done = [0] * len(prompts)
    with torch.inference_mode():
        while any(len(t) < steps for t in tokens):
            seqs, owners = [], []
            for i, p in enumerate(prompts):
                if done[i] < len(p):
                    new = p[done[i] : done[i] + chunk]
                elif len(tokens[i]) < steps:
                    new = [tokens[i][-1]]
                else:
                    continue
                seqs.append(ScheduledSeq(f"s{i}", new, done[i], tables[i], prompt_len=len(p)))
                owners.append(i)
            ids, positions, meta = runner.prepare(seqs)
            out = model.compute_logits(model(ids, positions, meta))
            offset = 0
            for s, i in zip(seqs, owners, strict=True):
                rows = out[offset : offset + len(s.token_ids)]
                offset += len(s.token_ids)
                done[i] += len(s.token_ids)
                if done[i] <= len(prompts[i]):
                    logits[i].append(rows)
                if done[i] >= len(prompts[i]):
                    tokens[i].append(int(rows[-1].argmax()))
    return [torch.cat(rows) for rows in logits], tokens


@pytest.mark.parametrize("chunk", [7, 16])
def test_phi3_chunked_prefill_parity(tmp_path: Path, chunk: int) -> None:
    """Prompts prefilled in chunks (a 50-token prompt's first chunks lie below the switch, yet
    take the long factors as its one-shot prefill does) beside other prompts' chunks and
    decodes, under a sliding window (Phi-3-mini-4k sets 2047; transformers masks every layer
    with it): transformers' logits and greedy tokens."""
    ref, resolved, model = _folder(tmp_path, sliding_window=8)
    assert [resolved.config.layer_window(i) for i in range(2)] == [8, 8]
    prompts = _prompts((50, 25, 33))
    logits, tokens = _chunked(model, resolved.config, prompts, chunk, STEPS)
    for prompt, our_logits, our_tokens in zip(prompts, logits, tokens, strict=True):
        ref_logits, ref_tokens = reference_greedy(ref, prompt, steps=STEPS)
        assert (our_logits - ref_logits).abs().max().item() < LOGIT_ATOL, len(prompt)
        assert our_tokens == ref_tokens, len(prompt)


def test_phi3_gguf_parity(tmp_path: Path) -> None:
    """A GGUF of F32 tensors as llama.cpp lays phi3 out (attn_qkv, ffn_up holding gate + up,
    rope_factors_long / _short, the original context and attention factor in metadata),
    dequantized load: transformers' logits and greedy tokens."""
    ref = _reference(sliding_window=8)
    path = tmp_path / "phi3.gguf"
    write_gguf(ref, "phi3", path, Q.F32)
    resolved = resolved_gguf(path, tmp_path / "converted")
    cfg = resolved.config
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.sliding_window == 8
    assert cfg.rope_scaling is not None
    want = ref.config.rope_parameters
    for key in ("short_factor", "long_factor"):
        assert torch.allclose(torch.tensor(cfg.rope_scaling[key]), torch.tensor(want[key]))
    assert cfg.rope_scaling["original_max_position_embeddings"] == ORIG
    model = load_model(resolved, torch.float32, torch.device("cpu"))
    _assert_parity(ref, model, cfg)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0])
def test_phi3_gguf_quantized(tmp_path: Path, qtype: Q) -> None:
    """The fused attn_qkv / ffn_up tensors kept in their blocks as qkv_proj / gate_up_proj:
    top-1 agreement of the prefill logits with the exact load; at decode each layer is one
    kernels.decode_layer call with the per-op path's tokens."""
    from convoy import kernels
    from convoy.kernels.linear import QuantLinear
    from convoy.models import llama

    ref = _reference()
    path = tmp_path / "phi3.gguf"
    write_gguf(ref, "phi3", path, qtype)
    resolved = resolved_gguf(path, tmp_path / "converted")
    cpu = torch.device("cpu")
    quant = load_model(resolved, torch.float32, cpu, QUANT_TYPES)
    layers = list(quant.model.layers)
    assert all(isinstance(m.self_attn.qkv_proj, QuantLinear) for m in layers)
    assert all(isinstance(m.mlp.gate_up_proj, QuantLinear) for m in layers)
    exact = load_model(resolved, torch.float32, cpu)
    quant.use_native_kernels(True)
    prompts = _prompts()
    e_logits, _ = convoy_greedy(exact, resolved.config, prompts, steps=1)
    q_logits, _ = convoy_greedy(quant, resolved.config, prompts, steps=1)
    agree = sum(
        int((e.argmax(-1) == q.argmax(-1)).sum()) for e, q in zip(e_logits, q_logits, strict=True)
    )
    top1 = agree / sum(len(e) for e in e_logits)
    print(f"phi3 {qtype.name}: top-1 {top1:.3f}")
    assert top1 >= (0.9 if qtype == Q.Q8_0 else 0.8)

    calls: list[int] = []
    decode_layer = kernels.decode_layer

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return decode_layer(*args)  # type: ignore[arg-type]

    llama.kernels.decode_layer = counted  # type: ignore[assignment]
    try:
        _, fused = convoy_greedy(quant, resolved.config, prompts, steps=STEPS, native_decode=True)
    finally:
        llama.kernels.decode_layer = decode_layer  # type: ignore[assignment]
    assert len(calls) == (STEPS - 1) * len(layers)
    for layer in layers:
        layer._fused = False  # the per-op path
    _, per_op = convoy_greedy(quant, resolved.config, prompts, steps=STEPS, native_decode=True)
    assert fused == per_op


def test_phi3_partial_rotary_parity(tmp_path: Path) -> None:
    """Phi-4-mini's partial_rotary_factor (0.75: rope on the first 12 of 16 dims, its factors
    6 long), folder and GGUF (rope.dimension_count): transformers' logits and tokens."""
    ref, resolved, model = _folder(tmp_path / "folder", partial=0.75)
    assert resolved.config.partial_rotary_factor == 0.75
    _assert_parity(ref, model, resolved.config)
    path = tmp_path / "phi3.gguf"
    write_gguf(ref, "phi3", path, Q.F32)
    resolved = resolved_gguf(path, tmp_path / "converted")
    assert resolved.config.partial_rotary_factor == 0.75
    _assert_parity(ref, load_model(resolved, torch.float32, torch.device("cpu")), resolved.config)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_phi3_native_kernels_parity(tmp_path: Path, partial: float) -> None:
    """With the CPU kernels on (norms, rotary + cache writes on the row index, decode
    attention; a partial rope by torch ops beside them): transformers' logits and tokens."""
    ref, resolved, model = _folder(tmp_path, partial=partial)
    _assert_parity(ref, model, resolved.config, native=True)
    assert all(m.native for m in model.modules() if type(m).__name__ == "RMSNorm")


def test_phi3_odd_rotary_refused(tmp_path: Path) -> None:
    """A partial_rotary_factor that leaves an odd number of rope dims is refused by name."""
    ref, resolved, _ = _folder(tmp_path)
    resolved.config.partial_rotary_factor = 0.5625  # 9 of 16 dims
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        load_model(resolved, torch.float32, torch.device("cpu"))
