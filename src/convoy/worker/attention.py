"""Attention over a paged KV cache for flat, unpadded batches of many sequences.

Layout of one layer's cache (see kv_cache.py): K and V are each a tensor of slots

    slot = block_id * block_size + offset          k_cache: (num_slots, Hkv, D)

    block_table of a sequence:  [ 7 | 2 | 9 ]      its token t lives in slot
                                                   block_table[t // bs] * bs + t % bs

A step's tokens come flat: sequence 0's new tokens, then sequence 1's, ... New K/V are written to
their slots first, then each query reads its sequence's slots. Sequences with one new token (decode)
are attended together in one batched call; sequences with several (prefill chunks) one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSeq:
    """One sequence with more than one new token in this step."""

    start: int  # first index of its tokens in the flat batch
    end: int
    context_len: int  # tokens in cache after this step (computed before + new)
    slots: torch.Tensor  # (context_len,) slot of every context token, in order


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) cache slot of each new token
    positions: torch.Tensor  # (T,) position of each new token
    prefills: list[PrefillSeq]
    decode_idx: torch.Tensor | None  # (Bd,) flat index of each decode token
    decode_slots: torch.Tensor | None  # (Bd, Lmax) context slots per decode sequence, padded
    decode_lens: torch.Tensor | None  # (Bd,) context length per decode sequence
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """(Bd, 1, 1, Lmax) additive mask: padding and keys outside the window get -inf."""
        mask = self._masks.get(window)
        if mask is None:
            assert self.decode_slots is not None and self.decode_lens is not None
            key_pos = torch.arange(self.decode_slots.shape[1], device=self.decode_slots.device)
            lens = self.decode_lens.unsqueeze(1)
            valid = key_pos.unsqueeze(0) < lens
            if window is not None:
                valid &= key_pos.unsqueeze(0) > lens - 1 - window
            mask = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
            mask.masked_fill_(~valid, float("-inf"))
            mask = mask[:, None, None, :]
            self._masks[window] = mask
        return mask


def paged_attention(
    q: torch.Tensor,  # (T, H, D)
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (num_slots, Hkv, D)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend every query to its sequence's context."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.decode_idx is not None:
        out[meta.decode_idx] = _decode_attention(
            q[meta.decode_idx], k_cache, v_cache, meta, scale, window
        )
    for seq in meta.prefills:
        out[seq.start : seq.end] = _prefill_attention(
            q[seq.start : seq.end], k[seq.start : seq.end], v[seq.start : seq.end],
            k_cache, v_cache, seq, scale, window,
        )  # fmt: skip
    return out


def _decode_attention(
    q: torch.Tensor,  # (B, H, D)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    assert meta.decode_slots is not None
    b, h, d = q.shape
    hkv = k_cache.shape[1]
    keys = k_cache[meta.decode_slots].permute(0, 2, 3, 1)  # (B, Hkv, D, L)
    values = v_cache[meta.decode_slots].transpose(1, 2)  # (B, Hkv, L, D)
    # NOTE: grouped-query attention as matmuls over (B, Hkv, G, .): no K/V repeat.
    qg = q.view(b, hkv, h // hkv, d)
    scores = torch.matmul(qg, keys).float() * scale  # (B, Hkv, G, L)
    scores += meta.decode_mask(window)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).reshape(b, h, d)


def _prefill_attention(
    q: torch.Tensor,  # (Tq, H, D)
    k: torch.Tensor,  # (Tq, Hkv, D)
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: PrefillSeq,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    num_q = q.shape[0]
    fresh = seq.context_len == num_q  # nothing cached before: attend to this step's K/V directly
    keys = k if fresh else k_cache[seq.slots]
    values = v if fresh else v_cache[seq.slots]
    mask = None
    if not fresh or (window is not None and window < num_q):
        q_pos = torch.arange(seq.context_len - num_q, seq.context_len, device=q.device)
        k_pos = torch.arange(seq.context_len, device=q.device)
        diff = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)  # (Tq, L)
        mask = diff >= 0
        if window is not None:
            mask &= diff < window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # (1, H, Tq, D)
        keys.transpose(0, 1).unsqueeze(0),  # (1, Hkv, L, D)
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)  # (Tq, H, D)
