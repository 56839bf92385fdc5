"""Phi-3 (Phi-3-mini-4k/128k, Phi-3.5-mini, Phi-4-mini): Llama's layers with the checkpoint's
fused qkv_proj and gate_up_proj (already Convoy's fused modules, gate rows then up rows), a
sliding window on every layer where the config sets one, and LongRoPE.

LongRoPE: two sets of per-frequency factors, short and long, and an attention factor on cos/sin.
transformers picks the long set for a whole forward when its last position + 1 exceeds
`original_max_position_embeddings`, and cached keys keep what they were computed with. For a
one-shot prefill then token-by-token decode that is, per token at position p of a sequence whose
prompt has L tokens: long iff p >= orig or L > orig. Convoy applies that rule per token (it
never depends on chunking or on the other sequences of a step) through one rope table whose row
2p holds position p with the short factors and row 2p + 1 with the long ones: the model hands the
layers that row index in place of the position, and every rope path (torch, kernels.rotary_cache,
the fused kernels.decode_layer) indexes the table with it unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from convoy.config import ConfigError
from convoy.model_config import ModelConfig
from convoy.models.attention import AttentionMetadata
from convoy.models.layers import CausalLM, RMSNorm, RotaryEmbedding, token_embedding
from convoy.models.llama import LlamaAttention, LlamaDecoderLayer

LONGROPE = ("longrope", "su")  # "su": the legacy name of the same scaling


class LongRopeEmbedding(RotaryEmbedding):
    """Rotary table of interleaved rows: 2p = position p with the short factors, 2p + 1 with the
    long ones, both times the attention factor (transformers' `attention_scaling`)."""

    def __init__(
        self, head_dim: int, max_positions: int, base: float, scaling: dict[str, Any]
    ) -> None:
        self.original_max = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or max_positions / self.original_max
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = (
                1.0
                if factor <= 1.0
                else math.sqrt(1 + math.log(factor) / math.log(self.original_max))
            )
        self.attention_factor = float(attention_factor)
        self.factors = [list(map(float, scaling[k])) for k in ("short_factor", "long_factor")]
        for name, f in zip(("short_factor", "long_factor"), self.factors, strict=True):
            if len(f) != head_dim // 2:
                raise ConfigError(f"rope_scaling.{name} has {len(f)} values, not {head_dim // 2}")
        super().__init__(head_dim, 2 * max_positions, base, None)

    def _chunks(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.head_dim
        device = self.cos.device
        shape = torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d
        short, long = (
            1.0 / (torch.tensor(f, dtype=torch.float32, device=device) * self.base**shape)
            for f in self.factors
        )
        cos, sin = [], []
        for c in range(start, end, self.CHUNK):
            rows = torch.arange(c, c + self.CHUNK, device=device)
            inv_freq = torch.where((rows % 2 == 1).unsqueeze(1), long, short)
            freqs = (rows // 2).float().unsqueeze(1) * inv_freq  # (CHUNK, D/2)
            cos.append(freqs.cos() * self.attention_factor)
            sin.append(freqs.sin() * self.attention_factor)
        n = end - start
        return torch.cat(cos)[:n], torch.cat(sin)[:n]

    def rope_index(self, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """(T,) each token's table row: 2p, or 2p + 1 where it takes the long factors."""
        orig = self.original_max
        prompt_lens = meta.prompt_lens if meta.prompt_lens is not None else positions + 1
        is_long = (positions >= orig) | (prompt_lens > orig)
        return 2 * positions + is_long.long()


def rotary_dim(cfg: ModelConfig) -> int:
    """Head dims the rope turns: all, or the first `partial_rotary_factor` of them (Phi-4-mini)."""
    dim = int(cfg.head_dim * cfg.partial_rotary_factor)
    if dim % 2 or not 0 < dim <= cfg.head_dim:
        raise ConfigError(f"partial_rotary_factor={cfg.partial_rotary_factor}: odd or empty rope")
    return dim


def rotary(cfg: ModelConfig) -> RotaryEmbedding:
    dim, scaling = rotary_dim(cfg), cfg.rope_scaling
    if scaling and scaling["rope_type"] in LONGROPE:
        return LongRopeEmbedding(dim, cfg.max_position_embeddings, cfg.rope_theta, scaling)
    return RotaryEmbedding(dim, cfg.max_position_embeddings, cfg.rope_theta, scaling)


class Phi3Attention(LlamaAttention):
    """Llama's attention; with a partial rotary factor the rope turns the first `rotary_dim`
    dims of each head (rotate-half within them) and the rest pass, by torch ops: the native
    rotary + cache kernel takes whole-head tables."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_idx, rope)
        self.rotary_dim = rope.head_dim
        self.is_partial = self.rotary_dim < cfg.head_dim

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if not self.is_partial:
            return super().forward(x, positions, meta)
        t, rd = x.shape[0], self.rotary_dim
        q, k, v = self.qkv_proj.forward(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q_rot, k_rot = self.rotary(positions, q[..., :rd], k[..., :rd])
        q = torch.cat([q_rot, q[..., rd:]], dim=-1)
        k = torch.cat([k_rot, k[..., rd:]], dim=-1)
        o = self.attn.forward(q, k, v, meta)
        return self.o_proj.forward(o.reshape(t, self.q_size))


class Phi3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_idx, rope)
        self.self_attn = Phi3Attention(cfg, layer_idx, rope)

    def fused_weights(self) -> tuple[Any, ...] | None:
        """kernels.decode_layer turns whole heads: a partial rope runs the per-op path."""
        attn = self.self_attn
        return (
            None if isinstance(attn, Phi3Attention) and attn.is_partial else super().fused_weights()
        )


class Phi3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = token_embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = rotary(cfg)
        self.layers = nn.ModuleList(
            Phi3DecoderLayer(cfg, i, self.rotary) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Phi3ForCausalLM(CausalLM):
    extra_stop_tokens = ("<|end|>",)  # the instruct models' turn end (GGUF eos: <|endoftext|>)
    gguf_architectures = {"phi3": ("phi3", "Phi3ForCausalLM")}
    gguf_layer_names = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Phi3Model(cfg))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        between_layers: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor:
        rope = self.model.rotary
        if isinstance(rope, LongRopeEmbedding):
            positions = rope.rope_index(positions, attn_metadata)
        return super().forward(input_ids, positions, attn_metadata, between_layers)

    @classmethod
    def gguf_config(cls, arch: str, cfg: dict[str, Any], get: Callable[..., Any]) -> None:
        window = int(get("attention.sliding_window", 0) or 0)
        cfg["sliding_window"] = window or None
        dims = int(get("rope.dimension_count", cfg["head_dim"]))
        cfg["partial_rotary_factor"] = dims / cfg["head_dim"]
        scaling = cfg.get("rope_scaling")
        if scaling:  # the factor tensors (gguf_convert): the rest is metadata
            scaling["original_max_position_embeddings"] = int(
                get("rope.scaling.original_context_length", cfg["max_position_embeddings"])
            )
            attn_factor = get("rope.scaling.attn_factor")
            if attn_factor is not None:
                scaling["attention_factor"] = float(attn_factor)


def gguf_rope_factors(tensors: dict[str, np.ndarray]) -> dict[str, Any] | None:
    """LongRoPE's factor lists from llama.cpp's rope_factors_short / _long tensors."""
    if "rope_factors_long.weight" not in tensors:
        return None
    short = tensors.get("rope_factors_short.weight", tensors["rope_factors_long.weight"])
    return {
        "rope_type": "longrope",
        "short_factor": [float(x) for x in np.asarray(short, dtype=np.float32).reshape(-1)],
        "long_factor": [
            float(x)
            for x in np.asarray(tensors["rope_factors_long.weight"], np.float32).reshape(-1)
        ],
    }
