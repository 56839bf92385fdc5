"""Thin wrappers over the kernels' `torch.ops.convoy.*` ops; call `build()`/`available()` first."""

from __future__ import annotations

import torch


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Decode attention straight from the paged cache (csrc/paged_attention.cpp), fp32 or bf16.

    q (B, H, D); k_cache, v_cache (Hkv, num_slots, D), contiguous, q's dtype; block_tables (B, NB)
    int64, each sequence's blocks in order; lens (B,) int64 keys per sequence; window: 0 for none,
    else only the last `window` keys are visible. Returns (B, H, D) in q's dtype.
    """
    return torch.ops.convoy.decode_attention(
        q, k_cache, v_cache, block_tables, lens, block_size, scale, window
    )


def pack_bf16_weight(w: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 weight -> 16-wide K-major panels for `bf16_linear` (csrc/bf16_linear.cpp)."""
    return torch.ops.convoy.pack_bf16_weight(w)


def bf16_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x (M, K) bf16 or fp32 @ packed weight (+ bias) -> (M, out_features) in x's dtype."""
    return torch.ops.convoy.bf16_linear(x, packed, bias, out_features)


# GGML type ids of the block formats `quant_linear` runs, and their bytes per 32 weights.
QUANT_BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # Q4_0, Q4_1, Q8_0


def quant_linear(
    x: torch.Tensor, weight: torch.Tensor, qtype: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (M, K) fp32 @ GGUF-quantized weight (N, K / 32 blocks as uint8 bytes) -> (M, N) fp32.

    Activations are quantized to int8 blocks of 32 inside (csrc/quant_linear.cpp), as llama.cpp.
    """
    return torch.ops.convoy.quant_linear(x, weight, qtype, bias)
