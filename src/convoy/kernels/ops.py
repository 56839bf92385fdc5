"""Thin wrappers over the kernels' `torch.ops.convoy.*` ops; call `build()`/`available()` first."""

from __future__ import annotations

from typing import Any

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
    softcap: float = 0.0,
) -> torch.Tensor:
    """Decode attention straight from the paged cache (csrc/paged_attention.cpp), fp32 or bf16.

    q (B, H, D); k_cache, v_cache (Hkv, num_slots, D), contiguous, q's dtype; block_tables (B, NB)
    int64, each sequence's blocks in order; lens (B,) int64 keys per sequence; window: 0 for none,
    else only the last `window` keys are visible; softcap: 0 for none, else each score (q . k *
    scale) becomes softcap * tanh(score / softcap) before the softmax (Gemma 2). Returns (B, H, D)
    in q's dtype.
    """
    return torch.ops.convoy.decode_attention(
        q, k_cache, v_cache, block_tables, lens, block_size, scale, window, softcap
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    block_size: int,
    scale: float,
    window: int,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One sequence's chunk of queries q (T, H, D) at positions start.. start + T - 1, each
    attended from the cache (which holds the chunk's K/V already) exactly as `decode_attention`
    attends the decode row of its position: the same bits, with the scores of a few rows
    computed per key load. block_table (NB,) int64 covers start + T keys. Returns (T, H, D)."""
    return torch.ops.convoy.prefill_attention(
        q, k_cache, v_cache, block_table, start, block_size, scale, window, softcap
    )


def pack_bf16_weight(w: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 or fp16 weight -> 16-wide K-major panels of its dtype for `bf16_linear`
    (csrc/bf16_linear.cpp)."""
    return torch.ops.convoy.pack_bf16_weight(w)


def pack_fp32_weight(w: torch.Tensor) -> torch.Tensor:
    """(N, K) fp32 weight -> 16-wide K-major panels for `fp32_linear` (csrc/fp32_linear.cpp)."""
    return torch.ops.convoy.pack_fp32_weight(w)


def fp32_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x (M, K) fp32 @ a `pack_fp32_weight` weight (+ bias) -> (M, out_features); each output
    one FMA chain over k in order, whatever M (batch invariant)."""
    return torch.ops.convoy.fp32_linear(x, packed, bias, out_features)


def bf16_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x (M, K) bf16 or fp32 @ packed bf16 or fp16 weight (+ bias) -> (M, out_features) in x's
    dtype; the weights widen to fp32 in registers, the sums run in fp32."""
    return torch.ops.convoy.bf16_linear(x, packed, bias, out_features)


def pack_bf16_pairs(w: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 weight -> 16-wide panels of k pairs for `bf16_pairs_linear`
    (csrc/panel_gemm.h's BF16_PAIRS layout, vdpbf16ps's)."""
    return torch.ops.convoy.pack_bf16_pairs(w)


def bf16_pairs_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x (M, K) bf16 (fp32 rounded to bf16) @ a `pack_bf16_pairs` weight (+ bias) ->
    (M, out_features) in x's dtype. vdpbf16ps where the CPU has AVX512-BF16, FMAs in its order
    elsewhere: the same bits on every path, batch invariant."""
    return torch.ops.convoy.bf16_pairs_linear(x, packed, bias, out_features)


# GGUF block types kept quantized (GGML type id -> the panel kind csrc/quant_linear.cpp packs it
# into: 0 = 4-bit quants + scale + offset, 1 = int8 quants + two half-block scales, 2 = int8 quants
# + two scales + offset, 3 = int8 quants + one scale, 4 = 4-bit indices into the IQ4 codebook +
# one scale, 5 = 4-bit quants + two half-block scales and offsets, 6 = 5-bit quants in bit planes +
# scale + offset, 7 = 6-bit and 8 = 3-bit quants in bit planes + two half-block scales; 9, 10, 11 =
# 0, 6, 7 with the file's 8-bit sub-block scales and its superblocks' fp16 d (and dmin): Q4_K,
# Q5_K, Q6_K alone, as narrow as the file; 12 = 0 without the stored offset, which is -8 d: Q4_0
# alone, 18 bytes a block as the file) and their (weights, bytes) per GGUF block.
QUANT_KIND_Q4, QUANT_KIND_Q8, QUANT_KIND_Q8M, QUANT_KIND_Q8S = 0, 1, 2, 3
QUANT_KIND_I4, QUANT_KIND_Q4D, QUANT_KIND_Q5, QUANT_KIND_Q6, QUANT_KIND_Q3 = 4, 5, 6, 7, 8
QUANT_KIND_Q4K, QUANT_KIND_Q5K, QUANT_KIND_Q6K, QUANT_KIND_Q40 = 9, 10, 11, 12
# A kind of one type alone (superblock-scaled, or Q4_0's without its offset) in a linear joined
# with other types: its base kind holds the same
SUPERBLOCK_BASE: dict[int, int] = {
    QUANT_KIND_Q4K: QUANT_KIND_Q4, QUANT_KIND_Q5K: QUANT_KIND_Q5, QUANT_KIND_Q6K: QUANT_KIND_Q6,
    QUANT_KIND_Q40: QUANT_KIND_Q4,
}  # fmt: skip
QUANT_TYPES: dict[int, int] = {
    2: QUANT_KIND_Q40,  # Q4_0
    3: QUANT_KIND_Q4,  # Q4_1
    6: QUANT_KIND_Q5,  # Q5_0
    7: QUANT_KIND_Q5,  # Q5_1
    8: QUANT_KIND_Q8S,  # Q8_0
    10: QUANT_KIND_Q4D,  # Q2_K
    11: QUANT_KIND_Q3,  # Q3_K
    12: QUANT_KIND_Q4K,  # Q4_K
    13: QUANT_KIND_Q5K,  # Q5_K
    14: QUANT_KIND_Q6K,  # Q6_K
    20: QUANT_KIND_I4,  # IQ4_NL
    23: QUANT_KIND_I4,  # IQ4_XS
}
# The 8-bit kind each type takes in a linear joined from types no narrower kind holds together
QUANT_TYPES_8BIT: dict[int, int] = {
    2: QUANT_KIND_Q8M, 3: QUANT_KIND_Q8M, 6: QUANT_KIND_Q8S, 7: QUANT_KIND_Q8M, 8: QUANT_KIND_Q8S,
    11: QUANT_KIND_Q8, 12: QUANT_KIND_Q8M, 13: QUANT_KIND_Q8M, 14: QUANT_KIND_Q8,
    20: QUANT_KIND_Q8S, 23: QUANT_KIND_Q8S,
}  # fmt: skip
QUANT_BLOCKS: dict[int, tuple[int, int]] = {
    2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
    20: (32, 18), 23: (256, 136),
}  # fmt: skip
PANEL_ROWS = 8  # weight rows per packed panel


def quant_pack(blocks: torch.Tensor, qtype: int, kind: int, in_features: int) -> torch.Tensor:
    """(N, row bytes) uint8 GGUF blocks of `qtype` -> (ceil(N / 8), ...) uint8 panels of `kind`."""
    return torch.ops.convoy.quant_pack(blocks, qtype, kind, in_features)


def quant_linear(
    x: torch.Tensor, packed: torch.Tensor, kind: int, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (M, K) fp32 @ packed panels (+ bias) -> (M, out_features) fp32.

    Activations are quantized to int8 blocks of 32 inside, as llama.cpp does; every output element
    is reduced in the same order whatever M is (batch invariant).
    """
    return torch.ops.convoy.quant_linear(x, packed, kind, out_features, bias)


def quant_linear_out(
    x: torch.Tensor,
    packed: torch.Tensor,
    kind: int,
    out_features: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """`quant_linear` written into `out`, a contiguous (M, out_features) fp32 tensor; returns it."""
    torch.ops.convoy.quant_linear_out(x, packed, kind, out_features, bias, out)
    return out


def quant_dequant_rows(
    packed: torch.Tensor, kind: int, in_features: int, ids: torch.Tensor
) -> torch.Tensor:
    """Rows `ids` (T,) int64 of a packed weight, dequantized: (T, in_features) fp32."""
    return torch.ops.convoy.quant_dequant_rows(packed, kind, in_features, ids)


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_kind: int,
    down: torch.Tensor,
    down_kind: int,
    intermediate: int,
    act: int,
) -> torch.Tensor:
    """MoE routed experts on stacked quantized panels (csrc/quant_linear.cpp), in one call.

    x (T, H) fp32; ids (T, k) int64 expert ids in [0, E) (repeats allowed); weights (T, k) fp32.
    gate_up: every expert's gate|up panels stacked (expert e: panels [e * Gu, (e + 1) * Gu),
    Gu = 2 * intermediate / 8) of `gate_up_kind`; down likewise (Gd = ceil(H / 8) each). Returns
    (T, H) fp32: out = w0 * y0, then out = out + wj * yj for j = 1..k-1 (a rounded product, then a
    rounded sum), yj = down_e(act(gate_e(x)) * up_e(x)), e = ids[:, j]: the bits of running
    `quant_linear` and `act_and_mul` per expert, whatever the batch or the thread count.
    """
    return torch.ops.convoy.moe_experts(
        x, ids, weights, gate_up, gate_up_kind, down, down_kind, intermediate, act
    )


# --- the MoE router (csrc/moe_router.cpp): batch invariant


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (T, H) fp32 @ w (E, H) fp32 .T -> (T, E) fp32, each output one dot in a fixed order
    (32 fma lanes, then a fixed pairwise sum): the same bits whatever T, the other rows or the
    threads."""
    return torch.ops.convoy.dense_linear(x, w)


def sigmoid_gate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sigmoid(dense_linear(x, w)), each element in scalar code: a row's bits never depend on
    its place in the batch (torch.sigmoid runs a vector body and a scalar tail)."""
    return torch.ops.convoy.sigmoid_gate(x, w)


def moe_topk(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) fp32 -> (weights (T, k) fp32, ids (T, k) int64): softmax in fp32, the k
    largest probabilities in descending order (among equal ones the lower expert first), divided
    by their sum when `normalize`."""
    weights, ids = torch.ops.convoy.moe_topk(logits, k, normalize)
    return weights, ids


# --- fused per-layer ops (csrc/fused_ops.cpp): fp32 or bf16 activations, rows split across threads


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """RMSNorm of x's last dim, a new contiguous tensor: x_hat * (offset + weight).

    Sum of squares and x_hat in fp32. offset 0 (Llama): x_hat is rounded to x's dtype, then
    multiplied by the weight; offset 1 (Gemma's 1 + w): scaled in fp32, rounded once.
    """
    return torch.ops.convoy.rms_norm(x, weight, eps, offset)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """`residual += x` (in place, in x's dtype), then returns `rms_norm(residual, ...)`."""
    return torch.ops.convoy.add_rms_norm(x, residual, weight, eps, offset)


def rotary_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotate-half rotary on q (T, H, D) and k (T, Hkv, D) in place (any strides but a contiguous
    head dim), then write k and v into `k_cache`/`v_cache` (Hkv, num_slots, D) at `slot_mapping`
    (T,) int64, converted to the cache's dtype (fp32, bf16 or fp16). cos/sin: (P, D / 2) fp32
    tables indexed by `positions` (T,) int64. An empty k_cache: rotary only."""
    torch.ops.convoy.rotary_cache(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)


ACT_SILU, ACT_GELU_TANH = 0, 1


def act_and_mul(x: torch.Tensor, act: int) -> torch.Tensor:
    """(..., 2I) gate|up -> (..., I): act(gate) * up; act ACT_SILU or ACT_GELU_TANH."""
    return torch.ops.convoy.act_and_mul(x, act)


def decode_layer(
    delta: torch.Tensor | None,
    residual: torch.Tensor,
    weights: tuple[Any, ...],
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """One decoder layer over a step of decode tokens (csrc/decoder_layer.cpp): the same kernels
    as the per-op path, in one call. `residual` (T, hidden) fp32 is updated in place; returns the
    layer's output still to add. weights: (eps, norm offset, in_norm, q_norm, k_norm,
    attn_out_norm, ff_in_norm, ff_out_norm, qkv, qkv kind, qkv bias, o, o kind, gate_up,
    gate_up kind, down, down kind, H, Hkv, D, intermediate, act), the optional ones None (see
    models/llama.py `FusedDecodeLayer`); the rest as `rotary_cache` and `decode_attention`
    (softcap: 0 for none)."""
    return torch.ops.convoy.decode_layer(
        delta, residual, *weights, positions, cos, sin, k_cache, v_cache, slot_mapping,
        block_tables, lens, block_size, scale, window, softcap,
    )  # fmt: skip


def decode_moe_layer(
    delta: torch.Tensor | None,
    residual: torch.Tensor,
    weights: tuple[Any, ...],
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """`decode_layer` for a mixture-of-experts layer (csrc/decoder_layer.cpp): the same attention
    half, then router (`dense_linear`), `moe_topk`, `moe_experts` and the optional shared expert
    scaled by sigmoid(its gate), as models/moe.py `SparseMoe` runs them. weights: (eps, norm
    offset, in_norm, q_norm, k_norm, ff_in_norm, qkv, qkv kind, qkv bias, o, o kind, H, Hkv, D,
    act, router weight (E, hidden) fp32, top_k, normalize, experts gate_up, kind, experts down,
    kind, expert intermediate, shared gate_up, kind, shared down, kind, shared intermediate,
    shared gate weight (1, hidden)), the shared expert's None / 0 where there is none."""
    return torch.ops.convoy.decode_moe_layer(
        delta, residual, *weights, positions, cos, sin, k_cache, v_cache, slot_mapping,
        block_tables, lens, block_size, scale, window, softcap,
    )  # fmt: skip
