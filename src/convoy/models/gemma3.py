"""Gemma 3 (text): sliding-window and global layers with their own rope bases, q/k RMSNorm,
(1 + w) RMSNorm around both sublayers, embeddings scaled by sqrt(hidden), GeGLU MLP.

Same serving convention as llama.py: flat tokens in, `compute_logits` on the sampling rows only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from convoy.model_config import ModelConfig
from convoy.models.attention import AttentionMetadata
from convoy.models.layers import CausalLM, RMSNorm, RotaryEmbedding, token_embedding
from convoy.models.llama import FusedDecodeLayer, LlamaAttention, LlamaMLP

# Gemma 3 in llama.cpp: rope base of the sliding layers and the sliding/global layer pattern.
GGUF_LOCAL_ROPE_BASE = 10000.0
GGUF_LAYER_PATTERN = 6

# Gemma's turn format, for Gemma files that carry no chat template (the base models).
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def _norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, offset=1.0)


class Gemma3Attention(LlamaAttention):
    """Llama's attention with (1 + w) q/k norms, a rope per layer kind and its own scale; Gemma 2
    (gemma2.py): no q/k norms, one rope, soft-capped scores."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ropes: dict[str, RotaryEmbedding]) -> None:
        window = cfg.layer_window(layer_idx)
        is_local = window is not None and cfg.rope_local_theta is not None
        super().__init__(cfg, layer_idx, ropes["local" if is_local else "global"])
        if cfg.qk_norm:
            self.q_norm, self.k_norm = _norm(cfg, cfg.head_dim), _norm(cfg, cfg.head_dim)
        self.attn.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.attn.softcap = cfg.attn_logit_softcapping


class Gemma3DecoderLayer(FusedDecodeLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ropes: dict[str, RotaryEmbedding]) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer_idx, ropes)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = _norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)
        self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
        self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size)

    def norms(self) -> tuple[RMSNorm, RMSNorm | None, RMSNorm, RMSNorm | None]:
        return (
            self.input_layernorm, self.post_attention_layernorm,
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm,
        )  # fmt: skip

    def forward(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: x = x + post_norm(attn(norm(x))); x = x + post_ff(mlp(pre_ff(x))),
        each residual add fused into the norm after it."""
        fused = self.fused_forward(delta, residual, positions, meta)
        if fused is not None:
            return fused, residual
        h, residual = self.input_layernorm.add_forward(delta, residual)
        o = self.post_attention_layernorm.forward(self.self_attn.forward(h, positions, meta))
        h, residual = self.pre_feedforward_layernorm.add_forward(o, residual)
        return self.post_feedforward_layernorm.forward(self.mlp.forward(h)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = token_embedding(cfg.vocab_size, cfg.hidden_size)
        pos = cfg.max_position_embeddings
        # NOTE: rope scaling (larger Gemma 3 models) applies to the global layers only.
        ropes = {"global": RotaryEmbedding(cfg.head_dim, pos, cfg.rope_theta, cfg.rope_scaling)}
        if cfg.rope_local_theta is not None:
            ropes["local"] = RotaryEmbedding(cfg.head_dim, pos, cfg.rope_local_theta, None)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, ropes) for i in range(cfg.num_layers)
        )
        self.norm = _norm(cfg, cfg.hidden_size)


class Gemma3ForCausalLM(CausalLM):
    default_chat_template = GEMMA_TEMPLATE
    extra_stop_tokens = ("<end_of_turn>",)  # the turn end: instruction-tuned Gemmas stop there
    gguf_architectures = {"gemma3": ("gemma3_text", "Gemma3ForCausalLM")}
    gguf_ffn_norm = "pre_feedforward_layernorm"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Gemma3Model(cfg))
        self.embed_scale = cfg.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)  # scale rounded to the dtype

    @classmethod
    def gguf_config(cls, arch: str, cfg: dict[str, Any], get: Callable[..., Any]) -> None:
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
        cfg["sliding_window"] = int(get("attention.sliding_window", 512))
        cfg["layer_types"] = [
            "full_attention" if (i + 1) % GGUF_LAYER_PATTERN == 0 else "sliding_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
        cfg["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": GGUF_LOCAL_ROPE_BASE},
            "full_attention": {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")},
        }

    @classmethod
    def gguf_tensor(
        cls, arch: str, hf_name: str, w: torch.Tensor, cfg: dict[str, Any]
    ) -> torch.Tensor:
        if hf_name.endswith("norm.weight"):
            return w - 1.0  # llama.cpp stores the (1 + w) norm scales with the one added
        return w
