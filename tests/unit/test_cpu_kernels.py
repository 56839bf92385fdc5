"""The compiled decode-attention kernel equals the torch path on the same paged cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from convoy import kernels
from convoy.kernels import builder
from convoy.models.attention import AttentionMetadata, _decode_attention

# builds the kernels; skips only without a C++ compiler (tests/unit/conftest.py)
pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window"),
    [
        (9, 3, 64, 16, None),  # SmolLM2-135M
        (4, 1, 256, 16, None),  # Gemma 3 270M, global layer
        (4, 1, 256, 16, 7),  # Gemma 3 sliding layer, window shorter than most contexts
        (8, 8, 32, 4, None),  # no GQA, tiny blocks
        (6, 2, 48, 8, 1),  # window of one key
        (32, 32, 96, 16, None),  # Phi-3's heads: V in 64 dims a pass, then 32
        (8, 2, 80, 16, None),  # 4 heads a group, 64 dims a pass then 16
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_torch_path(
    heads, kv_heads, head_dim, block_size, window, dtype
) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    num_blocks = 64
    slots = num_blocks * block_size
    k_cache = torch.randn(kv_heads, slots, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, slots, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([1, 2, block_size, block_size + 1, 5 * block_size - 3, 9])
    b = lens.numel()
    nb = (int(lens.max()) + block_size - 1) // block_size
    # scattered, distinct blocks per sequence, padded with block 0 as the runner does
    perm = torch.randperm(num_blocks, generator=gen)[: b * nb].view(b, nb)
    for i, n in enumerate(lens.tolist()):
        perm[i, (n + block_size - 1) // block_size :] = 0
    q = torch.randn(b, heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        block_size=block_size,
        slot_mapping=torch.empty(0, dtype=torch.long),
        positions=torch.empty(0, dtype=torch.long),
        prefills=[],
        decode_idx=None,
        decode_blocks=perm.reshape(-1),
        decode_len_max=nb * block_size,
        decode_lens=lens,
    )
    scale = head_dim**-0.5
    want = _decode_attention(q, k_cache, v_cache, meta, scale, window)
    meta.native_decode = True
    got = _decode_attention(q, k_cache, v_cache, meta, scale, window)
    assert got.shape == (b, heads, head_dim) and got.dtype == dtype
    # bf16: the torch path rounds scores and probabilities to bf16, the kernel keeps them in fp32
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # the first sequence sees one key: its output is that key's value row, per KV head
    first_slot = int(perm[0, 0]) * block_size
    group = heads // kv_heads
    for h in range(heads):
        torch.testing.assert_close(got[0, h], v_cache[h // group, first_slot])


def test_decode_kernel_rejects_out_of_range_blocks() -> None:
    k_cache = torch.zeros(1, 32, 8)
    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.decode_attention(
            q, k_cache, k_cache, torch.tensor([[99]]), torch.tensor([3]), 16, 1.0, 0
        )


def _capped_reference(q, k_cache, v_cache, tables, lens, bs, scale, window, cap) -> torch.Tensor:
    """One sequence and head at a time: scores = cap * tanh(q . k * scale / cap), softmax, sum."""
    b, heads, _ = q.shape
    group = heads // k_cache.shape[0]
    out = torch.empty_like(q)
    for i in range(b):
        n = int(lens[i])
        pos = torch.arange(max(0, n - window) if window else 0, n)
        slots = tables[i, pos // bs] * bs + pos % bs
        for h in range(heads):
            keys, values = k_cache[h // group, slots].float(), v_cache[h // group, slots].float()
            scores = keys @ q[i, h].float() * scale
            probs = torch.softmax(torch.tanh(scores / cap) * cap, dim=0)
            out[i, h] = probs @ values
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "window"), [
    (4, 2, 32, 0), (4, 2, 32, 5), (8, 4, 256, 0), (6, 2, 20, 0),  # 20: no AVX2 path (D % 8)
])  # fmt: skip
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_decode_kernel_soft_cap(heads, kv_heads, head_dim, window, cache_dtype) -> None:
    """Gemma 2's soft-capped scores: the kernel equals a per-head Python reference, each
    sequence alone gives its bits in the batch, and softcap 0 is the uncapped kernel."""
    gen = torch.Generator().manual_seed(heads + head_dim + window)
    bs, num_blocks = 4, 48
    k_cache = (torch.randn(kv_heads, num_blocks * bs, head_dim, generator=gen) * 2).to(cache_dtype)
    v_cache = torch.randn(kv_heads, num_blocks * bs, head_dim, generator=gen).to(cache_dtype)
    lens = torch.tensor([1, 7, 13, 30, 9])
    tables = torch.randperm(num_blocks, generator=gen)[:40].view(5, 8)
    q = torch.randn(5, heads, head_dim, generator=gen) * 2
    scale, cap = 24**-0.5, 2.0
    got = kernels.decode_attention(q, k_cache, v_cache, tables, lens, bs, scale, window, cap)
    want = _capped_reference(q, k_cache, v_cache, tables, lens, bs, scale, window, cap)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    uncapped = kernels.decode_attention(q, k_cache, v_cache, tables, lens, bs, scale, window)
    assert (got - uncapped).abs().max() > 1e-2  # the cap changes the result
    assert torch.equal(
        uncapped, kernels.decode_attention(q, k_cache, v_cache, tables, lens, bs, scale, window, 0)
    )
    for i in range(5):  # batch invariant: a row alone is the same bits
        one = kernels.decode_attention(
            q[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1], bs, scale,
            window, cap,
        )  # fmt: skip
        assert torch.equal(one[0], got[i])
    meta = AttentionMetadata(
        block_size=bs, slot_mapping=torch.empty(0, dtype=torch.long),
        positions=torch.empty(0, dtype=torch.long), prefills=[], decode_idx=None,
        decode_blocks=tables.reshape(-1), decode_len_max=8 * bs, decode_lens=lens,
    )  # fmt: skip
    torch_path = _decode_attention(q, k_cache, v_cache, meta, scale, window or None, cap)
    torch.testing.assert_close(torch_path, want, atol=2e-6, rtol=2e-5)


def test_decode_kernel_rejects_negative_soft_cap() -> None:
    k_cache = torch.zeros(1, 16, 8)
    with pytest.raises(RuntimeError, match="softcap"):
        kernels.decode_attention(
            torch.zeros(1, 2, 8), k_cache, k_cache, torch.tensor([[0]]), torch.tensor([3]), 16,
            1.0, 0, -1.0,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "window", "softcap"),
    [
        (9, 3, 64, 0, 0.0),  # SmolLM2: 4 rows a tile
        (4, 1, 256, 0, 0.0),  # Gemma 3: 3 rows a tile
        (4, 1, 256, 7, 0.0),  # a sliding window shorter than the chunk
        (8, 4, 16, 0, 50.0),  # soft-capped (Gemma 2)
        (12, 2, 96, 5, 0.0),  # Phi-3's head size, 6 heads a group: 2 rows a tile
        (4, 4, 96, 0, 0.0),  # Phi-3's heads (no GQA): V in 64 dims a pass, then 32
        (8, 2, 80, 0, 0.0),  # 4 heads a group: V in 64 dims a pass, then 16
        (16, 2, 32, 0, 0.0),  # 8 heads a group: 1 row a tile
        (18, 2, 32, 0, 0.0),  # 9 heads a group: the scalar path
        (4, 2, 12, 3, 0.0),  # head size not a multiple of 8: the scalar path
    ],
)
@pytest.mark.parametrize(
    ("q_dtype", "cache_dtype"),
    [(torch.float32, torch.float16), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)],
)
@pytest.mark.parametrize("start", [0, 13])
def test_prefill_kernel_gives_each_query_the_bits_of_its_decode_row(
    heads, kv_heads, head_dim, window, softcap, q_dtype, cache_dtype, start
) -> None:
    """A chunk's query at position p, attended by prefill_attention, equals bit for bit the
    decode row of position p (decode_attention with context p + 1): what makes a prompt's
    logits independent of chunking and of prefix-cache hits, and verification exact."""
    gen = torch.Generator().manual_seed(heads * 7 + head_dim + start)
    block_size, num_blocks, num_q = 4, 32, 23  # tiles of 1-4 rows and a ragged last tile
    k_cache = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen)
    v_cache = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    ctx = start + num_q
    table = torch.randperm(num_blocks, generator=gen)[: -(-ctx // block_size)]
    q = torch.randn(num_q, heads, head_dim, generator=gen).to(q_dtype)
    scale = head_dim**-0.5
    out = kernels.prefill_attention(
        q, k_cache, v_cache, table, start, block_size, scale, window, softcap
    )
    lens = torch.arange(start + 1, ctx + 1)
    rows = kernels.decode_attention(
        q, k_cache, v_cache, table.expand(num_q, -1), lens, block_size, scale, window, softcap
    )
    assert torch.equal(out, rows)


_ATTENTION_CROSS_CHECK = """
import sys, torch
from convoy import kernels
kernels.build()
cases = torch.load(sys.argv[1])
torch.save([kernels.decode_attention(*case) for case in cases], sys.argv[2])
"""


def test_the_avx2_build_gives_the_same_attention_bits(tmp_path: Path) -> None:
    """AVX2 is the floor CI may run on: where this host's build has AVX-512 (the weighted sums
    in zmm), a decode row is still the bits the AVX2 build gives it (each element's sum over
    the keys in the same order), for every cache type and the head shapes the kernel tiles
    differently (3 and 4 heads a group, 64-dim passes, the 16- and 8-dim rests)."""
    if builder.isa() in ("avx2", "generic"):
        pytest.skip("this host's build is the AVX2 one (or it cannot run AVX2 code)")
    gen = torch.Generator().manual_seed(5)
    cases = []
    for heads, kv_heads, head_dim in [(9, 3, 64), (4, 1, 256), (8, 2, 80), (4, 4, 96), (6, 1, 72)]:
        for q_dtype, cache_dtype in [
            (torch.float32, torch.float16), (torch.float32, torch.float32),
            (torch.bfloat16, torch.bfloat16),
        ]:  # fmt: skip
            bs, num_blocks = 4, 40
            k = torch.randn(kv_heads, num_blocks * bs, head_dim, generator=gen).to(cache_dtype)
            v = torch.randn(kv_heads, num_blocks * bs, head_dim, generator=gen).to(cache_dtype)
            lens = torch.tensor([1, 6, 13, 37])
            tables = torch.randperm(num_blocks, generator=gen)[:40].view(4, 10)
            q = torch.randn(4, heads, head_dim, generator=gen).to(q_dtype)
            cases.append((q, k, v, tables, lens, bs, head_dim**-0.5, 0, 0.0))
    torch.save(cases, tmp_path / "cases.pt")
    subprocess.run(
        [sys.executable, "-c", _ATTENTION_CROSS_CHECK, str(tmp_path / "cases.pt"),
         str(tmp_path / "out.pt")],
        env={**os.environ, builder.ISA_ENV: "avx2"}, check=True, timeout=900,
    )  # fmt: skip
    theirs = torch.load(tmp_path / "out.pt")
    for case, other in zip(cases, theirs, strict=True):
        assert torch.equal(kernels.decode_attention(*case), other), case[0].shape
