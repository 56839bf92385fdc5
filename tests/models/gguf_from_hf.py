"""Write a transformers model (Llama-shaped, with or without experts, or Gemma 2) as a GGUF file
the way llama.cpp's converter lays it out: tensor names, Q/K row permutation for `llama`, experts as
3-D tensors, the router in F32, Gemma's norms stored with the one added; weight matrices in F32 or
one quantized type (gguf.quants.quantize).
No tokenizer is written: `resolved_gguf` builds the converted folder's config.json itself."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from convoy.model_config import ModelConfig
from convoy.models.gguf_convert import _config, read_gguf
from convoy.models.registry import gguf_family
from convoy.models.resolve import ResolvedModel
from tests.models.quantize_more import TYPES as MORE_TYPES
from tests.models.quantize_more import quantize_more

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "self_attn.qkv_proj": "attn_qkv",  # phi3: fused in the checkpoint and in the GGUF
    "mlp.gate_up_proj": "ffn_up",  # phi3: gate rows, then up rows
}
# Gemma 2 (convert_hf_to_gguf.py Gemma2Model): its four norms' names
_GEMMA2_LAYER = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_MIXTRAL = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's rotate-half rows -> llama.cpp's interleaved order (the converter's)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    model: Any, arch: str, path: Path, qtype: GGMLQuantizationType,
    metadata: Callable[[GGUFWriter], None] | None = None,
) -> None:  # fmt: skip
    """`model` as a GGUF of `arch` in `qtype`; `metadata` adds keys of its own."""
    cfg = model.config
    w = GGUFWriter(str(path), arch)
    if metadata is not None:
        metadata(w)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta") or getattr(cfg, "rope_theta", 10000.0)))
    w.add_vocab_size(cfg.vocab_size)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", 0)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)

    if arch == "phi3":
        _phi3_metadata(w, cfg, head_dim)
    if arch == "gemma2":
        _gemma2_metadata(w, cfg)

    def put(name: str, t: np.ndarray) -> None:
        t = np.ascontiguousarray(t.astype(np.float32))
        if arch == "gemma2" and name.endswith("norm.weight"):
            t = t + 1.0  # llama.cpp stores Gemma's (1 + w) scales with the one added
        router = name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))
        if t.ndim >= 2 and qtype != GGMLQuantizationType.F32 and not router:
            blocks = quantize_more(t, qtype) if qtype in MORE_TYPES else quantize(t, qtype)
            w.add_tensor(name, blocks, raw_dtype=qtype)
        else:
            w.add_tensor(name, t)

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for key, t in state.items():
        if key == "model.embed_tokens.weight":
            put("token_embd.weight", t)
            continue
        if key == "model.norm.weight":
            put("output_norm.weight", t)
            continue
        if key == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                put("output.weight", t)
            continue
        parts = key.split(".")
        layer, rest = parts[2], [_MIXTRAL.get(p, p) for p in parts[3:]]
        if rest[-1] == "gate_up_proj":  # transformers' in-memory (E, 2I, H) experts
            gate, up = np.split(t, 2, axis=1)
            put(f"blk.{layer}.ffn_gate_exps.weight", gate)
            put(f"blk.{layer}.ffn_up_exps.weight", up)
            continue
        if rest[-1] == "down_proj" and "experts" in rest:
            put(f"blk.{layer}.ffn_down_exps.weight", t)
            continue
        if "experts" in rest:  # a checkpoint's mlp.experts.E.gate_proj.weight
            e, proj = int(rest[2]), rest[3]
            stacked.setdefault(f"blk.{layer}.{_EXPERT[proj]}.weight", {})[e] = t
            continue
        module, kind = ".".join(rest[:-1]), rest[-1]
        if arch == "llama" and module == "self_attn.q_proj":
            t = _permute(t, heads)
        if arch == "llama" and module == "self_attn.k_proj":
            t = _permute(t, kv)
        names = {**_LAYER, **_GEMMA2_LAYER} if arch == "gemma2" else _LAYER
        put(f"blk.{layer}.{names[module]}.{kind}", t)
    for name, by_expert in stacked.items():
        put(name, np.stack([by_expert[i] for i in range(len(by_expert))]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _phi3_metadata(w: GGUFWriter, cfg: Any, head_dim: int) -> None:
    """llama.cpp's Phi3MiniModel: rope dims, window (0: none), LongRoPE's original context,
    attention factor and factor tensors."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    w.add_sliding_window(cfg.sliding_window or 0)
    if rope.get("rope_type") != "longrope":
        return
    orig = rope.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
    w.add_rope_scaling_orig_ctx_len(orig)
    factor = cfg.max_position_embeddings / orig
    scale = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0
    w.add_rope_scaling_attn_factors(rope.get("attention_factor") or scale)
    w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
    w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))


def _gemma2_metadata(w: GGUFWriter, cfg: Any) -> None:
    w.add_sliding_window(cfg.sliding_window)
    w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)


def resolved_gguf(path: Path, out: Path) -> ResolvedModel:
    """The ResolvedModel of a GGUF without a tokenizer: config.json written by the converter's
    own metadata reading into `out`."""
    reader = read_gguf(path)
    arch = reader.fields["general.architecture"].contents()
    family = gguf_family(arch)
    assert family is not None, arch
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_config(reader, arch, family)))
    return ResolvedModel(path.stem, path, out, ModelConfig.from_file(out / "config.json"))

