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
