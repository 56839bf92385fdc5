"""Prefill attention over the paged cache against a dense reference: causal, sliding-window
(queries in tiles, each against only the keys its window reaches), fresh and continued chunks."""

from __future__ import annotations

import pytest
import torch

from convoy.models import attention
from convoy.models.attention import PrefillSeq, _prefill_attention

H, HKV, D, BS = 4, 2, 8, 4


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, window: int | None
) -> torch.Tensor:
    """q (Tq, H, D) at positions first.., k/v (L, HKV, D) at positions 0..L-1."""
    out = torch.empty_like(q)
    group = H // HKV
    for i in range(q.shape[0]):
        p = first + i
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(H):
            keys, values = k[lo : p + 1, h // group], v[lo : p + 1, h // group]
            probs = torch.softmax(keys @ q[i, h] * D**-0.5, dim=0)
            out[i, h] = probs @ values
    return out


@pytest.mark.parametrize("window", [None, 3, 8, 100])
@pytest.mark.parametrize(("context_len", "num_q"), [(19, 19), (19, 7), (30, 1 + 16)])
def test_prefill_attention_matches_dense_reference(
    monkeypatch: pytest.MonkeyPatch, window: int | None, context_len: int, num_q: int
) -> None:
    monkeypatch.setattr(attention, "_WINDOW_TILE", 4)  # many tiles on short prompts
    gen = torch.Generator().manual_seed(context_len * 31 + num_q)
    k = torch.randn(context_len, HKV, D, generator=gen)
    v = torch.randn(context_len, HKV, D, generator=gen)
    q = torch.randn(num_q, H, D, generator=gen)
    num_blocks = (context_len + BS - 1) // BS
    blocks = torch.randperm(num_blocks + 3, generator=gen)[:num_blocks]  # scattered blocks
    k_cache = torch.zeros(HKV, (num_blocks + 3) * BS, D)
    v_cache = torch.zeros_like(k_cache)
    slots = blocks.repeat_interleave(BS)[:context_len] * BS + torch.arange(context_len) % BS
    k_cache[:, slots] = k.transpose(0, 1)
    v_cache[:, slots] = v.transpose(0, 1)
    first = context_len - num_q
    seq = PrefillSeq(0, num_q, context_len, blocks)
    out = _prefill_attention(q, k[first:], v[first:], k_cache, v_cache, seq, BS, D**-0.5, window)
    torch.testing.assert_close(out, _reference(q, k, v, first, window), atol=1e-5, rtol=1e-5)
    if window is not None and window < context_len:
        assert len(seq.masks) == -(-num_q // 4)  # one mask per tile, kept for the other layers


def _capped_reference(q, k, v, first: int, window: int | None, cap: float) -> torch.Tensor:
    out = torch.empty_like(q)
    group = H // HKV
    for i in range(q.shape[0]):
        p = first + i
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(H):
            keys, values = k[lo : p + 1, h // group], v[lo : p + 1, h // group]
            scores = keys @ q[i, h] * D**-0.5
            out[i, h] = torch.softmax(torch.tanh(scores / cap) * cap, dim=0) @ values
    return out


@pytest.mark.parametrize("window", [None, 3, 100])
@pytest.mark.parametrize(("context_len", "num_q"), [(19, 19), (19, 7), (30, 1 + 16)])
def test_prefill_attention_soft_capped(
    monkeypatch: pytest.MonkeyPatch, window: int | None, context_len: int, num_q: int
) -> None:
    """Gemma 2's capped scores (SDPA has no cap: an explicit path), in query tiles for global
    layers too, fresh prompts and continued chunks, against a dense reference."""
    monkeypatch.setattr(attention, "_WINDOW_TILE", 4)
    gen = torch.Generator().manual_seed(context_len * 7 + num_q)
    k = torch.randn(context_len, HKV, D, generator=gen) * 3
    v = torch.randn(context_len, HKV, D, generator=gen)
    q = torch.randn(num_q, H, D, generator=gen) * 3
    num_blocks = (context_len + BS - 1) // BS
    blocks = torch.randperm(num_blocks + 3, generator=gen)[:num_blocks]
    k_cache = torch.zeros(HKV, (num_blocks + 3) * BS, D)
    v_cache = torch.zeros_like(k_cache)
    slots = blocks.repeat_interleave(BS)[:context_len] * BS + torch.arange(context_len) % BS
    k_cache[:, slots] = k.transpose(0, 1)
    v_cache[:, slots] = v.transpose(0, 1)
    first = context_len - num_q
    seq = PrefillSeq(0, num_q, context_len, blocks)
    args = (q, k[first:], v[first:], k_cache, v_cache, seq, BS, D**-0.5, window)
    out = _prefill_attention(*args, 1.5)
    torch.testing.assert_close(
        out, _capped_reference(q, k, v, first, window, 1.5), atol=1e-5, rtol=1e-5
    )
    assert len(seq.masks) == -(-num_q // 4)  # tiled whatever the window
    uncapped = _prefill_attention(*args)
    assert (out - uncapped).abs().max() > 1e-2
