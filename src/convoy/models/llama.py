"""The Llama family: Llama, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Serving convention: `forward(input_ids, positions, attn_metadata)` runs the flat, unpadded tokens
of every sequence in the step at once; `compute_logits` projects only the rows that sample.
Module names mirror Hugging Face's so checkpoints load by name; q/k/v and gate/up are fused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from convoy import kernels
from convoy.kernels.linear import QuantLinear
from convoy.model_config import ModelConfig
from convoy.models.attention import Attention, AttentionMetadata
from convoy.models.layers import (
    CausalLM,
    RMSNorm,
    RotaryEmbedding,
    activation,
    native_activation,
    token_embedding,
)


class LlamaAttention(nn.Module):
    native = False  # rotary + cache write by one csrc kernel (CausalLM.use_native_kernels)

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary  # shared by every layer
        self.attn = Attention(layer_idx, cfg.head_dim**-0.5, cfg.layer_window(layer_idx))

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj.forward(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        if self.native:  # q, k rotated in place; k, v written to the cache
            attn = self.attn
            cos, sin = self.rotary.tables(positions)
            kernels.rotary_cache(
                q, k, v, positions, cos, sin, attn.k_cache, attn.v_cache, meta.slot_mapping
            )
            o = attn.forward(q, k, v, meta, cache_written=True)
        else:
            q, k = self.rotary(positions, q, k)
            o = self.attn.forward(q, k, v, meta)
        return self.o_proj.forward(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    native = False  # act(gate) * up by one csrc kernel, where it has the activation

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.act = activation(cfg.hidden_act)
        self.act_id = native_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        if self.native and self.act_id is not None:
            return self.down_proj.forward(kernels.act_and_mul(gate_up, self.act_id))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj.forward(self.act(gate) * up)


class FusedDecodeLayer(nn.Module):
    """A decoder layer that runs a step of decode tokens by one csrc call (kernels.decode_layer)
    where it qualifies: every linear quantized, fp32 norms of one eps, an activation the kernels
    have. The call runs the same kernels in the same order as the family's per-op forward with
    native kernels, so the same bits (tests/engine/test_quantized.py)."""

    native = False  # CausalLM.use_native_kernels
    self_attn: LlamaAttention
    mlp: LlamaMLP

    def __init__(self) -> None:
        super().__init__()
        self._fused: tuple[Any, ...] | bool | None = None  # fused_weights(); False: not fused

    def norms(self) -> tuple[RMSNorm, RMSNorm | None, RMSNorm, RMSNorm | None]:
        """(in_norm, attn_out_norm, ff_in_norm, ff_out_norm) in the order of decoder_layer.cpp."""
        raise NotImplementedError

    def fused_weights(self) -> tuple[Any, ...] | None:
        """The layer's arguments of kernels.decode_layer, or None when it does not qualify.
        Computed once (the loader has placed the linears by the first step)."""
        if self._fused is None:
            self._fused = _fused_weights(self) or False
        return self._fused or None

    def fused_kernel(self) -> Callable[..., torch.Tensor]:
        """The kernels op `fused_weights` are the arguments of (a MoE layer has its own)."""
        return kernels.decode_layer

    def fused_forward(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """This step's layer output (still to add; `residual` updated in place) by one kernel
        call, or None where the step or the layer does not qualify."""
        if not (self.native and meta.all_decode and meta.native_decode):
            return None
        weights = self.fused_weights()
        if weights is None or residual.dtype != torch.float32:
            return None
        attn = self.self_attn.attn
        cos, sin = self.self_attn.rotary.tables(positions)
        assert meta.decode_blocks is not None and meta.decode_lens is not None
        return self.fused_kernel()(
            delta, residual, weights, positions, cos, sin, attn.k_cache, attn.v_cache,
            meta.slot_mapping, meta.decode_blocks.view(residual.shape[0], -1), meta.decode_lens,
            meta.block_size, attn.scale, attn.window or 0, attn.softcap or 0.0,
        )  # fmt: skip


def _fused_weights(layer: FusedDecodeLayer) -> tuple[Any, ...] | None:
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = layer.norms()
    all_norms = [n for n in (*norms, attn.q_norm, attn.k_norm) if n is not None]
    if (
        not all(isinstance(m, QuantLinear) for m in linears)
        or any(m.bias is not None for m in linears[1:])
        or mlp.act_id is None
        or any(n.weight.dtype != torch.float32 for n in all_norms)
        or len({(n.eps, n.offset) for n in all_norms}) != 1
    ):
        return None
    in_norm, attn_out, ff_in, ff_out = norms
    packed = [(m.packed, m.panel_kind) for m in linears]  # type: ignore[union-attr]
    return (
        in_norm.eps, in_norm.offset, in_norm.weight,
        None if attn.q_norm is None else attn.q_norm.weight,
        None if attn.k_norm is None else attn.k_norm.weight,
        None if attn_out is None else attn_out.weight, ff_in.weight,
        None if ff_out is None else ff_out.weight,
        *packed[0], attn.qkv_proj.bias, *packed[1], *packed[2], *packed[3],
        attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.gate_up_proj.out_features // 2,
        mlp.act_id,
    )  # fmt: skip


class LlamaDecoderLayer(FusedDecodeLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def norms(self) -> tuple[RMSNorm, RMSNorm | None, RMSNorm, RMSNorm | None]:
        return self.input_layernorm, None, self.post_attention_layernorm, None

    def forward(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous sublayer's output still to add, residual) -> this layer's (delta, residual):
        x = x + attn(norm(x)); x = x + mlp(norm(x)), each add fused into the norm after it."""
        fused = self.fused_forward(delta, residual, positions, meta)
        if fused is not None:
            return fused, residual
        h, residual = self.input_layernorm.add_forward(delta, residual)
        h, residual = self.post_attention_layernorm.add_forward(
            self.self_attn.forward(h, positions, meta), residual
        )
        return self.mlp.forward(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = token_embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    gguf_architectures = {
        "llama": ("llama", "LlamaForCausalLM"),
        "qwen2": ("qwen2", "Qwen2ForCausalLM"),
        "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, LlamaModel(cfg))

    @classmethod
    def gguf_config(cls, arch: str, cfg: dict[str, Any], get: Callable[..., Any]) -> None:
        if arch == "qwen2":
            cfg["attention_bias"] = True
        if arch == "llama":
            moe_config(arch, cfg, get)  # Mixtral: llama with experts

    @classmethod
    def gguf_tensor(
        cls, arch: str, hf_name: str, w: torch.Tensor, cfg: dict[str, Any]
    ) -> torch.Tensor:
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return _unpermute(w, cfg["num_attention_heads"])
        if arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            return _unpermute(w, cfg["num_key_value_heads"])
        return w


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rope -> Hugging Face's rotate-half)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def moe_config(arch: str, cfg: dict[str, Any], get: Callable[..., Any]) -> None:
    """The expert keys of config.json from a GGUF's metadata (llama with experts: Mixtral)."""
    experts = int(get("expert_count", 0) or 0)
    if not experts:
        return
    cfg["num_experts_per_tok"] = int(get("expert_used_count"))
    if arch == "llama":
        cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral")
        cfg["num_local_experts"] = experts
        return
    cfg["num_experts"] = experts
    cfg["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
    # llama.cpp renormalises Qwen3-MoE's top-k weights, not Qwen2-MoE's (newer files say so)
    cfg["norm_topk_prob"] = bool(get("expert_weights_norm", arch == "qwen3moe"))
    if arch == "qwen2moe":
        cfg["attention_bias"] = True
        cfg["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0))
