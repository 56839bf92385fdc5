"""Gemma 2: Gemma 3's layer (gemma3.py) without q/k norms, with one rope base for every layer,
sliding-window attention on the even layers, and soft-capping: attention scores and the final
logits become cap * tanh(x / cap).

    (1 + w) RMSNorms before and after both sublayers, embeddings scaled by sqrt(hidden), GeGLU
    (gelu_pytorch_tanh), queries scaled by query_pre_attn_scalar ** -0.5, tied embeddings.

The attention cap is `Attention.softcap` (set by Gemma3Attention from the config) and runs in every
attention path: the prefill's explicit tiles, the torch decode path, the decode kernel and the
fused decode layer. The logit cap is `CausalLM.compute_logits`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from convoy.models.gemma3 import Gemma3ForCausalLM

# llama.cpp's defaults where a gemma2 GGUF has no soft-capping keys (llama_hparams)
GGUF_ATTN_SOFTCAP = 50.0
GGUF_FINAL_SOFTCAP = 30.0
GGUF_27B_LAYERS = 46  # llama.cpp scales Gemma 2 27B's queries by (hidden / heads) ** -0.5


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    gguf_architectures = {"gemma2": ("gemma2", "Gemma2ForCausalLM")}

    @classmethod
    def gguf_config(cls, arch: str, cfg: dict[str, Any], get: Callable[..., Any]) -> None:
        """llama.cpp's gemma2 metadata: the caps and the window are keys; the query scale and the
        layer pattern (even layers slide) are llama.cpp's own rules (llama-model.cpp)."""
        num_layers = cfg["num_hidden_layers"]
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        cfg["query_pre_attn_scalar"] = (
            cfg["hidden_size"] // cfg["num_attention_heads"]
            if num_layers == GGUF_27B_LAYERS
            else cfg["head_dim"]
        )
        cfg["sliding_window"] = int(get("attention.sliding_window", 4096))
        cfg["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ]
        cfg["attn_logit_softcapping"] = float(get("attn_logit_softcapping", GGUF_ATTN_SOFTCAP))
        cfg["final_logit_softcapping"] = float(get("final_logit_softcapping", GGUF_FINAL_SOFTCAP))
