"""Attention over a paged KV cache for flat, unpadded batches of many sequences.

Layout of one layer's cache (see kv_cache.py): K and V are each a head-major tensor of slots

    slot = block_id * block_size + offset          k_cache: (Hkv, num_slots, D)

    block_table of a sequence:  [ 7 | 2 | 9 ]      its token t lives in slot
                                                   block_table[t // bs] * bs + t % bs

A step's tokens come flat: sequence 0's new tokens, then sequence 1's, ... New K/V are written to
their slots first, then each query reads its sequence's slots. Sequences with one new token (decode)
are attended together in one batched call (the csrc kernel of convoy.kernels on the CPU, else torch);
sequences with several (prefill chunks, speculative verification) one at a time. With the csrc
kernel every query of a chunk is attended as a decode row of its position (`_rows_as_decode`), so
a position's output has the same bits whether it is computed fresh, after a prefix-cache hit, in
a chunk of any size or alone; the torch path (other devices) uses SDPA and is exact only within
one way of chunking.

The cache may hold K/V in a narrower dtype than the activations (`kv_cache_dtype`, e.g. bf16 under
fp32): writes round to it, reads widen back (the csrc kernel in registers; here a `.to`), and a
fresh prefill attends to its own K/V rounded the same way, so every read sees the cached values.

Head-major slots make a sequence's context one `index_select` along dim 1 that lands directly in
the (Hkv, B, L, D) layout the batched matmuls read, with no transpose copy afterwards (measured,
B=16, L=200, smollm2 heads: 2.3 -> 0.7 ms per layer against a slot-major cache gathered with
advanced indexing and permuted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from convoy import kernels


@dataclass(slots=True)
class PrefillSeq:
    """One sequence with more than one new token in this step."""

    start: int  # first index of its tokens in the flat batch
    end: int
    context_len: int  # tokens in cache after this step (computed before + new)
    blocks: torch.Tensor  # (NB,) its block table, covering context_len (torch path: unused fresh)
    # Attention masks of this step's query tiles, shared by the layers with the same window:
    # (window, first query, end query) -> (first key, end key, (tile, keys) bool mask or None)
    masks: dict[tuple[int | None, int, int], tuple[int, int, torch.Tensor | None]] = field(
        default_factory=dict
    )


@dataclass(slots=True)
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor  # (T,) cache slot of each new token
    positions: torch.Tensor  # (T,) position of each new token
    prefills: list[PrefillSeq]
    decode_idx: torch.Tensor | None  # (Bd,) flat index of each decode token
    decode_blocks: torch.Tensor | None  # (Bd * NB,) block table per decode sequence, padded
    decode_len_max: int  # NB * block_size: keys per decode sequence, padding included
    decode_lens: torch.Tensor | None  # (Bd,) context length per decode sequence
    all_decode: bool = False  # every token of the step is a decode token, in order
    native_decode: bool = False  # use convoy.kernels.decode_attention (CPU fp32/bf16)
    # (T,) prompt length of each token's sequence (LongRoPE's short/long switch, phi3.py)
    prompt_lens: torch.Tensor | None = None
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """(1, Bd, 1, Lmax) additive mask: padding and keys outside the window get -inf."""
        mask = self._masks.get(window)
        if mask is None:
            assert self.decode_lens is not None
            key_pos = torch.arange(self.decode_len_max, device=self.decode_lens.device)
            lens = self.decode_lens.unsqueeze(1)
            valid = key_pos.unsqueeze(0) < lens
            if window is not None:
                valid &= key_pos.unsqueeze(0) > lens - 1 - window
            mask = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
            mask.masked_fill_(~valid, float("-inf"))
            mask = mask[None, :, None, :]
            self._masks[window] = mask
        return mask


def paged_attention(
    q: torch.Tensor,  # (T, H, D)
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (Hkv, num_slots, D)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    cache_written: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache (unless `cache_written`: the caller did, e.g. by
    kernels.rotary_cache), then attend every query to its sequence's context. `softcap` (Gemma
    2): scores become softcap * tanh(scores / softcap) before the mask and the softmax."""
    if not cache_written:
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(v_cache.dtype))
    if meta.all_decode:
        return _decode_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    out = torch.empty_like(q)
    if meta.decode_idx is not None:
        out[meta.decode_idx] = _decode_attention(
            q[meta.decode_idx], k_cache, v_cache, meta, scale, window, softcap
        )
    for seq in meta.prefills:
        if meta.native_decode:
            out[seq.start : seq.end] = _rows_as_decode(
                q[seq.start : seq.end], k_cache, v_cache, seq, meta.block_size, scale, window,
                softcap,
            )  # fmt: skip
            continue
        out[seq.start : seq.end] = _prefill_attention(
            q[seq.start : seq.end], k[seq.start : seq.end], v[seq.start : seq.end],
            k_cache, v_cache, seq, meta.block_size, scale, window, softcap,
        )  # fmt: skip
    return out


def _rows_as_decode(
    q: torch.Tensor,  # (Tq, H, D)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: PrefillSeq,
    block_size: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """A chunk's queries attended from the cache by the prefill kernel, each query as the decode
    row of its position would be (its own context length, keys in the same order): a prompt's
    logits are then the same bits computed fresh, after a prefix-cache hit, in chunks of any
    size, or token by token, which speculative verification relies on."""
    first = seq.context_len - q.shape[0]
    return kernels.prefill_attention(
        q, k_cache, v_cache, seq.blocks, first, block_size, scale, window or 0, softcap or 0.0
    )


def _decode_attention(
    q: torch.Tensor,  # (B, H, D)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    assert meta.decode_blocks is not None and meta.decode_lens is not None
    b, h, d = q.shape
    if meta.native_decode:
        return kernels.decode_attention(
            q, k_cache, v_cache, meta.decode_blocks.view(b, -1), meta.decode_lens,
            meta.block_size, scale, window or 0, softcap or 0.0,
        )  # fmt: skip
    hkv = k_cache.shape[0]
    length = meta.decode_len_max
    # Whole blocks are gathered (a 4 KB row each for D=64, bs=16): ~1.5x faster than gathering
    # single slots; the mask hides the block padding.
    keys = _gather_blocks(k_cache, meta.decode_blocks, meta.block_size).view(hkv, b, length, d)
    values = _gather_blocks(v_cache, meta.decode_blocks, meta.block_size).view(hkv, b, length, d)
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # a 16-bit cache under fp32
    # NOTE: grouped-query attention as matmuls over (Hkv, B, G, .): no K/V repeat.
    qg = q.view(b, hkv, h // hkv, d).transpose(0, 1)  # (Hkv, B, G, D)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float()  # (Hkv, B, G, L)
    scores *= scale
    if softcap:
        scores = _soft_cap(scores, softcap)
    scores += meta.decode_mask(window)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).transpose(0, 1).reshape(b, h, d)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """(Hkv, num_slots, D) cache, (N,) block ids -> (Hkv, N, block_size * D) copy of those blocks."""
    hkv, num_slots, d = cache.shape
    return cache.view(hkv, num_slots // block_size, block_size * d).index_select(1, blocks)


def _prefill_attention(
    q: torch.Tensor,  # (Tq, H, D)
    k: torch.Tensor,  # (Tq, Hkv, D)
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: PrefillSeq,
    block_size: int,
    scale: float,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    num_q = q.shape[0]
    fresh = seq.context_len == num_q  # nothing cached before: attend to this step's K/V directly
    if fresh:  # (Hkv, L, D), rounded as the cache holds them
        keys = k.transpose(0, 1).to(k_cache.dtype).to(q.dtype)
        values = v.transpose(0, 1).to(v_cache.dtype).to(q.dtype)
    else:
        hkv, _, d = k_cache.shape
        keys, values = (
            _gather_blocks(c, seq.blocks, block_size).view(hkv, -1, d)[:, : seq.context_len]
            .to(q.dtype)
            for c in (k_cache, v_cache)
        )  # fmt: skip
    out = torch.empty_like(q)
    for t0, t1 in _query_tiles(num_q, seq.context_len, window, softcap):
        k0, k1, mask = _tile_mask(seq, num_q, t0, t1, window, fresh, q.device)
        if softcap:
            out[t0:t1] = _capped_attention(
                q[t0:t1], keys[:, k0:k1], values[:, k0:k1], mask, scale, softcap
            )
            continue
        out[t0:t1] = (
            F.scaled_dot_product_attention(
                q[t0:t1].transpose(0, 1).unsqueeze(0),  # (1, H, Tq, D)
                keys[:, k0:k1].unsqueeze(0),  # (1, Hkv, L, D)
                values[:, k0:k1].unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )
            .squeeze(0)
            .transpose(0, 1)
        )  # (Tq, H, D)
    return out


# Queries of a sliding-window layer go in tiles of this many, each against only the keys its
# window reaches: the CPU flash kernel computes every key a boolean mask hides, so one mask over
# the whole prompt cost the full (Tq, L) square (measured, Gemma 3, a 1,100-token prompt, window
# 512, one thread: attention 582 -> 328 ms, the prefill 1.90 -> 1.54 s).
_WINDOW_TILE = 128


def _query_tiles(
    num_q: int, context_len: int, window: int | None, softcap: float | None = None
) -> list[tuple[int, int]]:
    """[t0, t1) ranges of the step's queries attended in one call each. A soft-capped layer's
    queries always go in tiles: its explicit scores are a (H, tile, keys) tensor."""
    if not softcap and (window is None or window >= context_len):
        return [(0, num_q)]
    return [(t0, min(num_q, t0 + _WINDOW_TILE)) for t0 in range(0, num_q, _WINDOW_TILE)]


def _soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(scores / cap), in transformers' order (Gemma 2's eager attention)."""
    return torch.tanh(scores / cap) * cap


def _capped_attention(
    q: torch.Tensor,  # (Tq, H, D)
    keys: torch.Tensor,  # (Hkv, L, D)
    values: torch.Tensor,
    mask: torch.Tensor | None,  # (Tq, L) bool, or None: causal, the queries being the keys
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Attention with soft-capped scores (SDPA has no cap): scores = q . k * scale, capped,
    masked, softmax in fp32, weighted sum; grouped-query heads as matmuls over (Hkv, G, .)."""
    tq, h, d = q.shape
    hkv, length = keys.shape[0], keys.shape[1]
    qg = q.transpose(0, 1).reshape(hkv, h // hkv, tq, d)  # (Hkv, G, Tq, D)
    scores = torch.matmul(qg, keys.unsqueeze(1).transpose(-1, -2)) * scale  # (Hkv, G, Tq, L)
    scores = _soft_cap(scores.float(), softcap)
    if mask is None:
        mask = torch.ones(tq, length, dtype=torch.bool, device=q.device).tril(length - tq)
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values.unsqueeze(1))  # (Hkv, G, Tq, D)
    return out.reshape(h, tq, d).transpose(0, 1)


def _tile_mask(
    seq: PrefillSeq,
    num_q: int,
    t0: int,
    t1: int,
    window: int | None,
    fresh: bool,
    device: torch.device,
) -> tuple[int, int, torch.Tensor | None]:
    """Keys [k0, k1) that queries [t0, t1) may see, and their mask (None: plain causal, the
    queries being the keys' own tokens from k0 on), computed once a step for all layers."""
    cached = seq.masks.get((window, t0, t1))
    if cached is not None:
        return cached
    first = seq.context_len - num_q  # position of the step's first query
    k0 = 0 if window is None else max(0, first + t0 - window + 1)
    k1 = first + t1
    mask = None
    if not (fresh and t0 == 0 and (window is None or window >= k1)):
        q_pos = torch.arange(first + t0, first + t1, device=device)
        diff = q_pos.unsqueeze(1) - torch.arange(k0, k1, device=device).unsqueeze(0)
        mask = diff >= 0
        if window is not None:
            mask &= diff < window
    seq.masks[(window, t0, t1)] = k0, k1, mask
    return k0, k1, mask


class Attention(nn.Module):
    """One layer's paged attention: the model family computes q/k/v, this owns the cache.

    The worker binds the layer's K/V cache tensors with `bind_cache` after allocating the pool.
    """

    def __init__(
        self, layer_idx: int, scale: float, window: int | None, softcap: float | None = None
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.scale = scale
        self.window = window  # None = full attention
        self.softcap = softcap  # None = none; else scores = softcap * tanh(scores / softcap)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        cache_written: bool = False,
    ) -> torch.Tensor:
        """q: (T, H, D), k/v: (T, Hkv, D) -> (T, H, D); `cache_written`: k/v are in the cache."""
        return paged_attention(
            q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.window, cache_written,
            self.softcap,
        )  # fmt: skip
