"""Model families: architecture name (config.json `architectures[0]`) -> model class, and the
llama.cpp architecture names each family converts from GGUF. A new family is one model file
(a CausalLM subclass) plus its lines here."""

from __future__ import annotations

from convoy.models.gemma2 import Gemma2ForCausalLM
from convoy.models.gemma3 import Gemma3ForCausalLM
from convoy.models.layers import CausalLM
from convoy.models.llama import LlamaForCausalLM
from convoy.models.moe import MoeForCausalLM
from convoy.models.phi3 import Phi3ForCausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}

GGUF_FAMILIES: dict[str, type[CausalLM]] = {
    arch: family
    for family in dict.fromkeys(ARCHITECTURES.values())
    for arch in family.gguf_architectures
}


def model_class(architecture: str) -> type[CausalLM] | None:
    return ARCHITECTURES.get(architecture)


def gguf_family(gguf_architecture: str) -> type[CausalLM] | None:
    return GGUF_FAMILIES.get(gguf_architecture)
