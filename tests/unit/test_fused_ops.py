"""The fused per-layer kernels (csrc/fused_ops.cpp) against straightforward torch references:
RMSNorm (plain and with the residual add; Llama's and Gemma's scale), rotary + paged cache write,
SiLU/GELU-and-multiply; fp32 and bf16, odd sizes, several row counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from convoy import kernels

pytestmark = pytest.mark.usefixtures("cpu_kernels")

DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 3, 64, 257]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # bf16: one rounding of a value near 1-10 is up to 2^-8 relative; fp32: summation order only
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}


def _ref_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """models/layers.py RMSNorm.forward."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (x32 * (offset + w.float())).to(x.dtype)
    return w * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "offset"), [(576, 0.0), (640, 1.0), (37, 0.0), (37, 1.0)])
def test_rms_norm(dtype: torch.dtype, rows: int, n: int, offset: float) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
    w = (torch.randn(n, generator=gen) * 0.5 + (0 if offset else 1)).to(dtype)
    got = kernels.rms_norm(x, w, 1e-5, offset)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, _ref_norm(x, w, 1e-5, offset), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "offset"), [(576, 0.0), (640, 1.0), (37, 0.0)])
def test_add_rms_norm(dtype: torch.dtype, rows: int, n: int, offset: float) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + n)
    x = torch.randn(rows, n, generator=gen).to(dtype)
    residual = (torch.randn(rows, n, generator=gen) * 4).to(dtype)
    w = (torch.randn(n, generator=gen) * 0.5 + 1).to(dtype)
    want_res = residual + x
    want = _ref_norm(want_res, w, 1e-6, offset)
    got = kernels.add_rms_norm(x, residual, w, 1e-6, offset)
    assert torch.equal(residual, want_res)  # the add is exact in both dtypes' rounding
    torch.testing.assert_close(got, want, **_tol(dtype))


def test_rms_norm_of_strided_heads_and_batch_invariance() -> None:
    """q/k norms run on (T, H, D) views of the qkv output; a row's result ignores other rows."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(9, 5 * 64 + 2 * 64, generator=gen)
    q = qkv[:, : 5 * 64].view(9, 5, 64)
    w = torch.randn(64, generator=gen)
    got = kernels.rms_norm(q, w, 1e-6, 1.0)
    torch.testing.assert_close(got, _ref_norm(q, w, 1e-6, 1.0), atol=1e-5, rtol=1e-5)
    for i in range(9):
        assert torch.equal(kernels.rms_norm(q[i : i + 1], w, 1e-6, 1.0)[0], got[i])


def _ref_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """models/layers.py RotaryEmbedding.forward: (T, H, D) with (T, D/2) fp32 tables."""
    c = cos.to(x.dtype).repeat(1, 2).unsqueeze(1)
    s = sin.to(x.dtype).repeat(1, 2).unsqueeze(1)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rot * s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5, 70])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 256), (3, 3, 6)])
def test_rotary_cache(
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None,
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> None:
    cache_dtype = cache_dtype or dtype
    gen = torch.Generator().manual_seed(tokens + heads + head_dim)
    max_pos, slots = 300, 512
    angles = torch.rand(max_pos, head_dim // 2, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    slot_mapping = torch.randperm(slots, generator=gen)[:tokens]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    want_q = _ref_rotary(q, cos[positions], sin[positions])
    want_k = _ref_rotary(k, cos[positions], sin[positions])
    want_v = v.clone()
    k_cache = torch.zeros(kv_heads, slots, head_dim, dtype=cache_dtype)
    v_cache = torch.zeros(kv_heads, slots, head_dim, dtype=cache_dtype)
    kernels.rotary_cache(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
    # each product and sum rounded to the dtype as torch does: the same bits
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, want_v)
    assert torch.equal(k_cache[:, slot_mapping], want_k.transpose(0, 1).to(cache_dtype))
    assert torch.equal(v_cache[:, slot_mapping], want_v.transpose(0, 1).to(cache_dtype))
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert not k_cache[:, untouched].any() and not v_cache[:, untouched].any()


def test_rotary_without_cache_and_bad_slots() -> None:
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    cos, sin = torch.ones(4, 4), torch.zeros(4, 4)
    empty = torch.empty(0)
    want_q, want_k = q.clone(), k.clone()
    kernels.rotary_cache(q, k, k, torch.tensor([0, 3]), cos, sin, empty, empty, empty.long())
    assert torch.equal(q, want_q) and torch.equal(k, want_k)  # angle 0: identity
    cache = torch.zeros(1, 4, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.rotary_cache(q, k, k, torch.tensor([0, 1]), cos, sin, cache, cache.clone(),
                             torch.tensor([0, 4]))  # fmt: skip
    with pytest.raises(RuntimeError, match="position out of range"):
        kernels.rotary_cache(q, k, k, torch.tensor([0, 4]), cos, sin, cache, cache.clone(),
                             torch.tensor([0, 1]))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", [1536, 33])
@pytest.mark.parametrize("act", [kernels.ACT_SILU, kernels.ACT_GELU_TANH])
def test_act_and_mul(dtype: torch.dtype, rows: int, n: int, act: int) -> None:
    gen = torch.Generator().manual_seed(rows + n + act)
    x = (torch.randn(rows, 2 * n, generator=gen) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0]).to(dtype)  # the exp's clamped ends
    gate, up = x.chunk(2, dim=-1)
    fn = F.silu if act == kernels.ACT_SILU else (lambda t: F.gelu(t, approximate="tanh"))
    want = fn(gate) * up
    got = kernels.act_and_mul(x, act)
    assert got.shape == (rows, n) and got.dtype == dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 1e-2}
    torch.testing.assert_close(got, want, **tol)
    for i in (0, rows - 1):  # one row alone gives that row's bits
        assert torch.equal(kernels.act_and_mul(x[i : i + 1], act)[0], got[i])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [0, 5])
def test_decode_attention_fp32_q_with_16bit_cache(cache_dtype: torch.dtype, window: int) -> None:
    """fp32 activations over a 16-bit cache equal fp32 attention over the widened cache."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, d, bs, num_blocks = 9, 3, 64, 16, 32
    k_cache = torch.randn(kv_heads, num_blocks * bs, d, generator=gen).to(cache_dtype)
    v_cache = torch.randn(kv_heads, num_blocks * bs, d, generator=gen).to(cache_dtype)
    lens = torch.tensor([1, 17, 40])
    tables = torch.randperm(num_blocks, generator=gen)[:9].view(3, 3)
    q = torch.randn(3, heads, d, generator=gen)
    got = kernels.decode_attention(q, k_cache, v_cache, tables, lens, bs, d**-0.5, window)
    want = kernels.decode_attention(
        q, k_cache.float(), v_cache.float(), tables, lens, bs, d**-0.5, window
    )
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
