"""ModelConfig: the architecture facts the model code needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convoy.config import ConfigError

POOLING_TYPES = ("mean", "last")


@dataclass(slots=True)
class ModelConfig:
    """The architecture facts the model code needs, read from a Hugging Face config.json."""

    architecture: str  # e.g. "LlamaForCausalLM", "Gemma3ForCausalLM"
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0  # rope on this fraction of each head's dims (Phi-4-mini)
    qkv_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    # Per-layer attention window (None = full attention); Gemma 3 and Mistral-style models.
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    rope_local_theta: float | None = None  # rope base on sliding layers (Gemma 3)
    query_pre_attn_scalar: float | None = None
    # Gemma 2's soft-capping: x = cap * tanh(x / cap) on attention scores / final logits.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral): 0 experts for a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's; `intermediate_size` is a dense layer's
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    moe_layers: list[bool] = field(default_factory=list)  # per layer: experts, else a dense MLP
    pooling_type: str | None = None  # an embedding model's pooling ("mean" / "last"), if it says

    def is_moe_layer(self, layer_idx: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer_idx]

    def layer_window(self, layer_idx: int) -> int | None:
        """Attention window of one layer: None means the layer attends to the whole context."""
        if self.layer_types and self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    def rope_switch_len(self) -> int | None:
        """LongRoPE (phi3.py): prompts longer than this take the long factors at every
        position, so their K/V differ from a shorter prompt's with the same prefix."""
        scaling = self.rope_scaling
        if not scaling or scaling.get("rope_type") not in ("longrope", "su"):
            return None
        return int(scaling["original_max_position_embeddings"])

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        with open(path) as f:
            raw = json.load(f)
        try:
            return cls.from_dict(raw)
        except (KeyError, TypeError) as e:
            raise ConfigError(f"{path}: missing or malformed field {e}") from e

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        if "text_config" in raw:  # multimodal wrappers keep the language model's config here
            raw = {**raw["text_config"], "architectures": raw.get("architectures")}
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else raw.get("model_type", "unknown")
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        head_dim = raw.get("head_dim") or hidden // num_heads
        model_type = raw.get("model_type", "")
        rope_theta, rope_local, rope_scaling = _rope_fields(raw)
        if rope_scaling is not None and raw.get("original_max_position_embeddings"):
            rope_scaling.setdefault(  # Phi-3 keeps it beside the scaling (LongRoPE)
                "original_max_position_embeddings", raw["original_max_position_embeddings"]
            )
        params = raw.get("rope_parameters")
        partial = raw.get("partial_rotary_factor") or (
            params.get("partial_rotary_factor") if isinstance(params, dict) else None
        )
        num_layers = raw["num_hidden_layers"]
        layer_types = list(raw.get("layer_types") or [])
        sliding_window = raw.get("sliding_window")
        if model_type.startswith("gemma3") and not layer_types:
            pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
            layer_types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(num_layers)
            ]
        if model_type == "gemma2" and not layer_types:  # even layers slide (transformers')
            layer_types = [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
            ]
        if model_type.startswith(("qwen2", "qwen3")) and not raw.get("use_sliding_window"):
            sliding_window, layer_types = None, []
        if sliding_window and not layer_types:
            layer_types = ["sliding_attention"] * num_layers
        experts, moe = _moe_fields(raw, model_type, num_layers)
        eos = raw.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            partial_rotary_factor=float(partial or 1.0),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("attention_bias") or raw.get("qkv_bias"))
            or model_type in ("qwen2", "qwen2_moe"),
            qk_norm=model_type.startswith(("qwen3", "gemma3")),
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
            sliding_window=sliding_window,
            layer_types=layer_types,
            rope_local_theta=rope_local,
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
            attn_logit_softcapping=raw.get("attn_logit_softcapping") or None,
            final_logit_softcapping=raw.get("final_logit_softcapping") or None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=[int(e) for e in eos_ids],
            **experts,
            moe_layers=moe,
            pooling_type=_pooling(raw.get("pooling_type")),
        )


def _pooling(value: Any) -> str | None:
    return value if value in POOLING_TYPES else None


def _moe_fields(raw: dict[str, Any], model_type: str, num_layers: int) -> tuple[dict, list[bool]]:
    """The expert fields and the per-layer MoE flags: Mixtral's experts are its
    `intermediate_size` wide and always renormalised; Qwen MoE layers are those not in
    `mlp_only_layers` at every `decoder_sparse_step`-th layer."""
    n = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    if n == 0:
        return {}, []
    mixtral = model_type == "mixtral"
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    moe = [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
    return {
        "num_experts": n,
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(
            raw["intermediate_size"] if mixtral else raw["moe_intermediate_size"]
        ),
        "norm_topk_prob": True if mixtral else bool(raw.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0),
    }, moe


def _rope_fields(raw: dict[str, Any]) -> tuple[float, float | None, dict[str, Any] | None]:
    """(global base, sliding-layer base, scaling) from either the legacy or the v5 config keys."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = params["full_attention"]
        local = params.get("sliding_attention", {}).get("rope_theta")
        return float(full["rope_theta"]), local, _scaling(full)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"]), raw.get("rope_local_base_freq"), _scaling(params)
    scaling = raw.get("rope_scaling")
    return float(raw.get("rope_theta", 10000.0)), raw.get("rope_local_base_freq"), _scaling(scaling)


def _scaling(params: dict[str, Any] | None) -> dict[str, Any] | None:
    if not params:
        return None
    kind = params.get("rope_type") or params.get("type") or "default"
    return None if kind == "default" else {**params, "rope_type": kind}
