"""Gemma 3 (text): sliding-window and global layers with their own rope bases, q/k RMSNorm,
(1 + w) RMSNorm around both sublayers, embeddings scaled by sqrt(hidden), GeGLU MLP.

Same serving convention as llama.py: flat tokens in, `compute_logits` on the sampling rows only.
"""

from __future__ import annotations

import torch
from torch import nn

from convoy.config import ModelConfig
from convoy.models.layers import RMSNorm, RotaryEmbedding
from convoy.models.llama import LlamaMLP
from convoy.worker.attention import AttentionMetadata, paged_attention


def _norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, offset=1.0)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ropes: dict[str, RotaryEmbedding]) -> None:
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
        self.q_norm = _norm(cfg, cfg.head_dim)
        self.k_norm = _norm(cfg, cfg.head_dim)
        self.window = cfg.layer_window(layer_idx)
        is_local = self.window is not None and cfg.rope_local_theta is not None
        self.rotary = ropes["local" if is_local else "global"]  # shared by the layers of a kind
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(t, self.num_heads, self.head_dim))  # (T, H, D)
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))  # (T, Hkv, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        o = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.window)
        return self.o_proj(o.reshape(t, self.q_size))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ropes: dict[str, RotaryEmbedding]) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer_idx, ropes)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = _norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)
        self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
        self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), positions, meta)
        )
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        pos = cfg.max_position_embeddings
        # NOTE: rope scaling (larger Gemma 3 models) applies to the global layers only.
        ropes = {"global": RotaryEmbedding(cfg.head_dim, pos, cfg.rope_theta, cfg.rope_scaling)}
        if cfg.rope_local_theta is not None:
            ropes["local"] = RotaryEmbedding(cfg.head_dim, pos, cfg.rope_local_theta, None)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, ropes) for i in range(cfg.num_layers)
        )
        self.norm = _norm(cfg, cfg.hidden_size)


class Gemma3ForCausalLM(nn.Module):
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Gemma3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.embed_scale = cfg.hidden_size**0.5

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """(T,) token ids of all sequences, flat -> (T, hidden) final hidden states."""
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # scale rounded to the model dtype
        for i in range(len(self.model.layers)):
            x = self.model.layers[i](x, positions, attn_metadata)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) rows that sample -> (N, vocab) fp32 logits."""
        return self.lm_head(hidden).float()
