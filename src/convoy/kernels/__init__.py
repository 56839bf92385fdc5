"""Native C++ CPU kernels (csrc/), built on first use; a leaf package: imports nothing from convoy.

    from convoy import kernels
    if kernels.available():  # memoised; False (torch path) when disabled, without compiler, ...
        out = kernels.decode_attention(q, k_cache, v_cache, block_tables, lens, bs, scale, 0)

`build()` is the strict form: it raises NoCompilerError or KernelBuildError (with the compiler
output) instead of returning False. See builder.py for the cache and how builds stay safe.
"""

from .builder import (
    KernelBuildError,
    NoCompilerError,
    available,
    build,
    cache_dir,
    has_compiler,
)
from .ops import (
    ACT_GELU_TANH,
    ACT_SILU,
    QUANT_TYPES,
    act_and_mul,
    add_rms_norm,
    bf16_linear,
    bf16_pairs_linear,
    decode_attention,
    decode_layer,
    decode_moe_layer,
    dense_linear,
    fp32_linear,
    moe_experts,
    moe_topk,
    pack_bf16_pairs,
    pack_bf16_weight,
    pack_fp32_weight,
    prefill_attention,
    quant_dequant_rows,
    quant_linear,
    quant_pack,
    rms_norm,
    rotary_cache,
    sigmoid_gate,
)

__all__ = [
    "ACT_GELU_TANH",
    "ACT_SILU",
    "QUANT_TYPES",
    "KernelBuildError",
    "NoCompilerError",
    "act_and_mul",
    "add_rms_norm",
    "available",
    "bf16_linear",
    "bf16_pairs_linear",
    "build",
    "cache_dir",
    "decode_attention",
    "prefill_attention",
    "decode_layer",
    "decode_moe_layer",
    "dense_linear",
    "fp32_linear",
    "has_compiler",
    "moe_experts",
    "moe_topk",
    "pack_bf16_pairs",
    "pack_bf16_weight",
    "pack_fp32_weight",
    "quant_dequant_rows",
    "quant_linear",
    "quant_pack",
    "rms_norm",
    "rotary_cache",
    "sigmoid_gate",
]
