"""csrc/quant_linear.cpp: GGUF-quantized weights repacked into panels, against references.

Weights: the legacy types are quantized from real-valued matrices by the gguf package; the K-quants
(which gguf cannot quantize) are random blocks with sane scales, so every bit pattern is decoded.
The references are gguf's own dequantization and, for the product, the same arithmetic in float64:
activations quantized to int8 blocks of 32 exactly as the kernel does (fp32 scale amax / 127, fp32
reciprocal, round half to even), times the kernel's own dequantized rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from convoy.kernels import builder
from convoy.kernels.linear import QuantLinear, panel_kind, two_part_kind
from convoy.kernels.ops import (
    QUANT_BLOCKS,
    QUANT_KIND_I4,
    QUANT_KIND_Q3,
    QUANT_KIND_Q4,
    QUANT_KIND_Q4D,
    QUANT_KIND_Q4K,
    QUANT_KIND_Q5,
    QUANT_KIND_Q5K,
    QUANT_KIND_Q6,
    QUANT_KIND_Q6K,
    QUANT_KIND_Q8,
    QUANT_KIND_Q8M,
    QUANT_KIND_Q8S,
    QUANT_KIND_Q40,
    quant_linear,
    quant_pack,
)

pytestmark = pytest.mark.usefixtures("cpu_kernels")

LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
KQUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]
# kept since #25: the IQ4 codebook (kind I4), Q2_K (kind Q4D: a scale and an offset a half) and
# Q3_K (kind Q3, bit planes; Q5_* and Q6_K take kinds Q5 and Q6, bit planes too)
NEWER = [T.IQ4_NL, T.IQ4_XS, T.Q2_K, T.Q3_K]
SHAPES = {32: [(1, 32), (7, 64), (45, 96)], 256: [(3, 256), (45, 512)]}  # (N, K) by block size
BATCHES = [1, 2, 3, 4, 5, 17, 64, 65, 300]  # M: register-tile, tile and thread remainders
HALF_FIELDS = {  # byte offsets of a GGUF block's fp16 scale (and min/offset) fields
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ4_NL: [0], T.IQ4_XS: [0], T.Q2_K: [80, 82], T.Q3_K: [108],
}  # fmt: skip
# scales stored as they are used, no fp16-rounded products (Q4_K, Q5_K, Q6_K alone: their
# superblock-scaled kinds keep the file's d and 8-bit sub-block scales)
EXACT = {*LEGACY, T.IQ4_NL, *KQUANTS}


def _blocks(n: int, k: int, qtype: T, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """(blocks, their dequantized weights) for an (n, k) matrix of `qtype`."""
    rng = np.random.default_rng(seed)
    if qtype in LEGACY:
        w = rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.01
        raw = quantize(w.astype(np.float32), qtype)
    else:
        elems, nbytes = QUANT_BLOCKS[int(qtype)]
        raw = rng.integers(0, 256, (n, k // elems, nbytes), dtype=np.uint8)
        for off in HALF_FIELDS[qtype]:
            half = rng.uniform(0.001, 0.02, (n, k // elems)).astype(np.float16)
            raw[:, :, off : off + 2] = half.view(np.uint8).reshape(n, k // elems, 2)
        raw = raw.reshape(n, -1)
    return torch.from_numpy(np.ascontiguousarray(raw)), dequantize(raw, qtype)


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    xb = x.float().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv)  # fp32 product, half to even: as the kernel
    return (q.double() * d.double()).reshape(x.shape)


def _assert_dequantized(rows: torch.Tensor, w: np.ndarray, exact: bool) -> None:
    """Legacy scales stay the fp16 they are stored as (exact); K-quant sub-block scales and mins
    are products rounded to fp16 (relative 2^-11 each)."""
    if exact:
        assert np.array_equal(rows.numpy(), w)
    else:
        assert np.allclose(rows.numpy(), w, rtol=2**-11, atol=2**-10 * np.abs(w).max())


def _check(layer: QuantLinear, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    full = layer(x)
    ref = _quantized_activations(x) @ w.double().T
    assert (full.double() - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()
    exact = x.double() @ w.double().T  # the int8 activations cost a little, no more
    assert (full.double() - exact).abs().max().item() <= 0.03 * exact.abs().max().item()
    return full


@pytest.mark.parametrize("qtype", LEGACY + KQUANTS + NEWER, ids=lambda t: t.name)
def test_every_type_matches_the_references_for_every_batch_size(qtype: T) -> None:
    for n, k in SHAPES[QUANT_BLOCKS[int(qtype)][0]]:
        blocks, w = _blocks(n, k, qtype, seed=n + k)
        layer = QuantLinear(blocks, int(qtype), k, None)
        rows = layer.dequantize_rows(torch.arange(n))
        _assert_dequantized(rows, w, exact=qtype in EXACT)
        x = torch.randn(max(BATCHES), k, generator=torch.Generator().manual_seed(k))
        full = _check(layer, x, rows)
        for m in BATCHES:  # batch invariance: each row is the same bits alone and in any batch
            assert torch.equal(layer(x[:m]), full[:m]), (n, k, m)


def test_batch_invariance_for_every_batch_size_up_to_300() -> None:
    q4_1 = QuantLinear(_blocks(45, 512, T.Q4_1, seed=11)[0], int(T.Q4_1), 512, None)
    q5_1 = QuantLinear(_blocks(45, 512, T.Q5_1, seed=12)[0], int(T.Q5_1), 512, None)
    parts = [(int(T.Q3_K), _blocks(16, 512, T.Q3_K, seed=13)[0])]
    q6 = QuantLinear.from_parts(
        [*parts, (int(T.Q6_K), _blocks(29, 512, T.Q6_K, seed=14)[0])], 512, None
    )
    blocks, _ = _blocks(45, 512, T.Q4_K, seed=3)
    q4 = QuantLinear(blocks, int(T.Q4_K), 512, None)
    blocks, _ = _blocks(45, 512, T.Q6_K, seed=4)
    q8 = QuantLinear(blocks, int(T.Q6_K), 512, None)
    blocks, _ = _blocks(45, 512, T.Q8_0, seed=6)
    q8s = QuantLinear(blocks, int(T.Q8_0), 512, None)
    blocks, _ = _blocks(45, 512, T.IQ4_XS, seed=7)
    i4 = QuantLinear(blocks, int(T.IQ4_XS), 512, None)
    blocks, _ = _blocks(45, 512, T.Q3_K, seed=8)
    q3 = QuantLinear(blocks, int(T.Q3_K), 512, None)
    blocks, _ = _blocks(45, 512, T.Q2_K, seed=9)
    q4d = QuantLinear(blocks, int(T.Q2_K), 512, None)
    blocks, _ = _blocks(45, 512, T.Q5_K, seed=10)
    q5 = QuantLinear(blocks, int(T.Q5_K), 512, None)
    layers = (q4, q8, q8s, i4, q3, q4d, q5, q4_1, q5_1, q6)
    assert [m.panel_kind for m in layers] == [
        QUANT_KIND_Q4K, QUANT_KIND_Q6K, QUANT_KIND_Q8S, QUANT_KIND_I4, QUANT_KIND_Q3, QUANT_KIND_Q4D,
        QUANT_KIND_Q5K, QUANT_KIND_Q4, QUANT_KIND_Q5, QUANT_KIND_Q6,
    ]  # fmt: skip
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(5))
    for layer in layers:
        full = layer(x)
        for m in range(1, 301):
            assert torch.equal(layer(x[:m]), full[:m]), m
            assert torch.equal(layer(x[m - 1 : m]), full[m - 1 : m]), m


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1], ids=lambda t: t.name)
def test_wide_outputs_in_many_chunks_are_the_bits_of_each_row_alone(qtype: T) -> None:
    """>= 32 rows run compute-bound: panels handed out in chunks, outputs staged per thread in
    groups of 32 panels; an odd last panel, several chunks per thread, two row tiles of 64."""
    n, k = 8 * 700 + 5, 64
    blocks, _ = _blocks(n, k, qtype, seed=11)
    layer = QuantLinear(blocks, int(qtype), k, None)
    rows = layer.dequantize_rows(torch.arange(n))
    x = torch.randn(97, k, generator=torch.Generator().manual_seed(12))
    full = _check(layer, x, rows)
    for m in (96, 40, 33):
        assert torch.equal(layer(x[:m]), full[:m]), m
    for i in (0, 31, 63, 64, 96):  # alone: the memory-bound path, in place
        assert torch.equal(layer(x[i : i + 1]), full[i : i + 1]), i


def test_mixed_types_join_into_one_panel_kind() -> None:
    assert panel_kind([int(T.Q4_K), int(T.Q4_0)]) == QUANT_KIND_Q4
    assert panel_kind([int(T.Q5_0), int(T.Q8_0), int(T.Q6_K)]) == QUANT_KIND_Q8
    assert panel_kind([int(T.Q4_K), int(T.Q6_K)]) == QUANT_KIND_Q8M
    assert panel_kind([int(T.Q5_0), int(T.Q8_0)]) == QUANT_KIND_Q8S
    assert panel_kind([int(T.IQ4_NL), int(T.IQ4_XS)]) == QUANT_KIND_I4
    assert panel_kind([int(T.IQ4_XS), int(T.Q8_0)]) == QUANT_KIND_Q8S
    assert panel_kind([int(T.IQ4_XS), int(T.Q4_K)]) == QUANT_KIND_Q8M
    assert panel_kind([int(T.Q3_K), int(T.Q2_K)]) == QUANT_KIND_Q4D
    assert panel_kind([int(T.Q3_K), int(T.Q4_K)]) == QUANT_KIND_Q4D
    assert panel_kind([int(T.Q3_K), int(T.Q6_K)]) == QUANT_KIND_Q6
    assert panel_kind([int(T.Q3_K), int(T.Q5_K)]) == QUANT_KIND_Q8M
    assert panel_kind([int(T.Q4_K), int(T.Q5_K)]) == QUANT_KIND_Q5
    assert panel_kind([int(T.Q4_0), int(T.Q5_0), int(T.Q5_1)]) == QUANT_KIND_Q5
    assert panel_kind([int(T.Q5_K), int(T.Q6_K)]) == QUANT_KIND_Q8M
    with pytest.raises(ValueError, match="no panel kind"):
        panel_kind([int(T.Q2_K), int(T.Q6_K)])
    for types in (
        [T.Q5_0, T.Q5_0, T.Q8_0], [T.Q8_0, T.Q6_K], [T.Q4_K, T.Q6_K], [T.Q4_1, T.Q5_1],
        [T.IQ4_XS, T.IQ4_XS, T.Q8_0], [T.IQ4_NL, T.Q4_K], [T.Q3_K, T.Q3_K, T.Q5_K],
        [T.Q3_K, T.Q6_K], [T.Q2_K, T.Q3_K, T.Q4_K], [T.Q4_0, T.Q2_K], [T.Q4_K, T.Q5_K],
        [T.Q5_0, T.Q4_0, T.Q5_1], [T.Q5_K, T.Q6_K],
    ):  # fmt: skip
        parts = [_blocks(16, 256, t, seed=i) for i, t in enumerate(types)]
        parts[-1] = _blocks(13, 256, types[-1], seed=9)  # the last part may end mid-panel
        pairs = [(int(t), b) for t, (b, _) in zip(types, parts, strict=True)]
        layer = QuantLinear.from_parts(pairs, 256, None)
        w = torch.from_numpy(np.concatenate([w for _, w in parts]))
        rows = layer.dequantize_rows(torch.arange(w.shape[0]))
        _assert_dequantized(rows, w.numpy(), exact=False)
        x = torch.randn(70, 256, generator=torch.Generator().manual_seed(1))
        _check(layer, x, rows)


@pytest.mark.parametrize(("panels_qk", "rows_v"), [(3, 13), (40, 59)])
def test_a_q4_k_m_qkv_keeps_each_part_in_its_own_kind(panels_qk: int, rows_v: int) -> None:
    """Q4_K q and k beside a Q6_K v (half the layers of a Q4_K_M file): no narrow kind holds both,
    so the joined linear is two parts, each in its own superblock kind (not kQ8M's 9.5 bits a
    weight), their panels back to back. Its columns are the bits of each part's
    own linear at every row count (the memory-bound path splits the panels by bytes, the
    compute-bound one hands out chunks across the cut), and so batch invariant."""
    k = 512
    rows_q = 8 * panels_qk - 8
    q, k_, v = (_blocks(n, k, t, seed=30 + n)[0]
                for n, t in ((rows_q, T.Q4_K), (8, T.Q4_K), (rows_v, T.Q6_K)))  # fmt: skip
    parts = [(int(T.Q4_K), q), (int(T.Q4_K), k_), (int(T.Q6_K), v)]
    layer = QuantLinear.from_parts(parts, k, None)
    qk = QuantLinear.from_parts(parts[:2], k, None)
    alone_v = QuantLinear(v, int(T.Q6_K), k, None)
    assert layer.panel_kind == two_part_kind(QUANT_KIND_Q4K, QUANT_KIND_Q6K, panels_qk)
    assert (qk.panel_kind, alone_v.panel_kind) == (QUANT_KIND_Q4K, QUANT_KIND_Q6K)
    assert qk.packed.shape[1] < alone_v.packed.shape[1]  # Q4_K's panels narrower than Q6_K's
    assert torch.equal(layer.packed, torch.cat([qk.packed.flatten(), alone_v.packed.flatten()]))
    n_qk = 8 * panels_qk
    ids = torch.arange(n_qk + rows_v)
    assert torch.equal(
        layer.dequantize_rows(ids),
        torch.cat([qk.dequantize_rows(ids[:n_qk]), alone_v.dequantize_rows(ids[:rows_v])]),
    )
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(3))
    full = layer(x)
    assert torch.equal(full[:, :n_qk], qk(x)) and torch.equal(full[:, n_qk:], alone_v(x))
    for m in (*range(1, 18), 31, 32, 33, 64, 65, 299):
        assert torch.equal(layer(x[:m]), full[:m]), m
        assert torch.equal(layer(x[m - 1 : m]), full[m - 1 : m]), m
    for threads in (1, 3):  # another split of the panels between threads: the same bits
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            assert torch.equal(layer(x[:1]), full[:1]) and torch.equal(layer(x[:40]), full[:40])
        finally:
            torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("qtype", "narrow", "wide"),
    [(T.Q6_K, QUANT_KIND_Q6, QUANT_KIND_Q8), (T.Q3_K, QUANT_KIND_Q3, QUANT_KIND_Q8),
     (T.Q5_0, QUANT_KIND_Q5, QUANT_KIND_Q8S), (T.Q5_K, QUANT_KIND_Q5, QUANT_KIND_Q8M)],
    ids=lambda v: getattr(v, "name", str(v)),
)  # fmt: skip
def test_bit_plane_panels_are_narrow_and_compute_what_8_bit_panels_do(
    qtype: T, narrow: int, wide: int
) -> None:
    """The bit-plane kinds hold the file's quants in fewer bytes than the 8-bit panels they
    replace, and give the same products: kQ6 and kQ3 the very bits of kQ8 (the offset comes off in
    integers), kQ5 the same within float rounding (one scale a block where kQ8M has two)."""
    n, k = 45, 512
    blocks, _ = _blocks(n, k, qtype, seed=21)
    a, b = (quant_pack(blocks, int(qtype), kind, k) for kind in (narrow, wide))
    bits = {QUANT_KIND_Q6: 7, QUANT_KIND_Q3: 4, QUANT_KIND_Q5: 6}[narrow]
    assert a.numel() == -(-n // 8) * 8 * k * bits // 8 < b.numel()  # bits a weight, scales in
    assert a.numel() <= b.numel() * 0.8
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(22))
    ya, yb = (quant_linear(x, p, kind, n, None) for p, kind in ((a, narrow), (b, wide)))
    if narrow in (QUANT_KIND_Q6, QUANT_KIND_Q3):
        assert torch.equal(ya, yb)
    else:
        assert torch.allclose(ya, yb, rtol=1e-5, atol=1e-5 * yb.abs().max().item())


@pytest.mark.parametrize(
    ("qtype", "kind", "base", "bits"),
    [(T.Q4_K, QUANT_KIND_Q4K, QUANT_KIND_Q4, 4.625), (T.Q5_K, QUANT_KIND_Q5K, QUANT_KIND_Q5, 5.625),
     (T.Q6_K, QUANT_KIND_Q6K, QUANT_KIND_Q6, 6.625)],
    ids=lambda v: getattr(v, "name", str(v)),
)  # fmt: skip
def test_superblock_scaled_panels_are_as_narrow_as_the_file(
    qtype: T, kind: int, base: int, bits: float
) -> None:
    """Q4_K, Q5_K and Q6_K alone keep their 8-bit sub-block scales and fp16 superblock scales:
    the panels hold at most 1/36 more bytes than the file (a 160-byte header a superblock of 8
    rows: Q4_K and Q5_K 0.125 bits a weight more, Q6_K 0.0625), fewer than the base kind with an
    fp16 scale a block, and the product is the base kind's within its fp16 rounding of d * sc."""
    n, k = 45, 768
    blocks, w = _blocks(n, k, qtype, seed=31)
    a, b = (quant_pack(blocks, int(qtype), kd, k) for kd in (kind, base))
    assert a.numel() == -(-n // 8) * 8 * k * bits / 8 < b.numel()
    elems, nbytes = QUANT_BLOCKS[int(qtype)]
    assert a.numel() * 36 <= -(-n // 8) * 8 * k // elems * nbytes * 37  # <= 1/36 over the file
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(32))
    ya, yb = (quant_linear(x, p, kd, n, None) for p, kd in ((a, kind), (b, base)))
    assert torch.allclose(ya, yb, rtol=0, atol=2**-9 * yb.abs().max().item())
    rows = QuantLinear(blocks, int(qtype), k, None).dequantize_rows(torch.arange(n))
    _check(QuantLinear(blocks, int(qtype), k, None), x, rows)
    with pytest.raises(RuntimeError, match="holds its own K-quant type only"):
        quant_pack(_blocks(8, k, T.Q4_K if qtype != T.Q4_K else T.Q6_K, seed=1)[0],
                   int(T.Q4_K if qtype != T.Q4_K else T.Q6_K), kind, k)  # fmt: skip


def test_q4_0_alone_is_as_narrow_as_the_file_with_kq4s_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_0 alone packs into 18 bytes a row's block, as the file (kQ4 stores its offset -8 d
    too: 20), and computes that offset in the tile: kQ4's bits at every row count (one row, a
    register tile, pairs and zmm tiles), in the dequantized rows, in a join and in experts."""
    n, k = 45, 768
    blocks, _ = _blocks(n, k, T.Q4_0, seed=33)
    assert QuantLinear(blocks, int(T.Q4_0), k, None).panel_kind == QUANT_KIND_Q40
    assert panel_kind([int(T.Q4_0), int(T.Q4_0)]) == QUANT_KIND_Q40
    assert panel_kind([int(T.Q4_0), int(T.Q4_1)]) == QUANT_KIND_Q4
    narrow, wide = (quant_pack(blocks, int(T.Q4_0), kd, k) for kd in (QUANT_KIND_Q40, QUANT_KIND_Q4))
    elems, nbytes = QUANT_BLOCKS[int(T.Q4_0)]
    assert narrow.numel() == -(-n // 8) * 8 * k // elems * nbytes
    assert wide.numel() * 18 == narrow.numel() * 20
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(34))
    for zmm in ("1", "0"):
        monkeypatch.setenv("CONVOY_CPU_ZMM", zmm)
        for m in (1, 3, 4, 16, 17, 40, 70):
            ya = quant_linear(x[:m], narrow, QUANT_KIND_Q40, n, None)
            assert torch.equal(ya, quant_linear(x[:m], wide, QUANT_KIND_Q4, n, None)), (zmm, m)
    ids = torch.arange(n)
    assert torch.equal(
        torch.ops.convoy.quant_dequant_rows(narrow, QUANT_KIND_Q40, k, ids),
        torch.ops.convoy.quant_dequant_rows(wide, QUANT_KIND_Q4, k, ids),
    )
    with pytest.raises(RuntimeError, match="offset is not -8 d"):
        quant_pack(_blocks(8, k, T.Q4_1, seed=35)[0], int(T.Q4_1), QUANT_KIND_Q40, k)


def test_bias_and_leading_dims() -> None:
    blocks, w = _blocks(10, 64, T.Q4_1, seed=1)
    bias = torch.arange(10, dtype=torch.float32)
    layer = QuantLinear(blocks, int(T.Q4_1), 64, bias)
    x = torch.randn(2, 3, 64)
    out = layer(x)
    assert out.shape == (2, 3, 10)
    ref = _quantized_activations(x.view(6, 64)) @ torch.from_numpy(w).double().T
    assert torch.allclose(out.double(), ref.view(2, 3, 10) + bias.double(), atol=1e-5)
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_forward_into_a_reused_buffer() -> None:
    blocks, _ = _blocks(45, 96, T.Q8_0, seed=7)
    layer = QuantLinear(blocks, int(T.Q8_0), 96, torch.linspace(-1, 1, 45))
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(8))
    buf = torch.full((9, 45), float("nan"))
    for m in (9, 4, 1):  # a prefix of the same buffer, step after step
        out = layer.forward_into(x[:m], buf[:m])
        assert out.data_ptr() == buf.data_ptr()
        assert torch.equal(out, layer(x[:m]))
    for bad in (torch.empty(9, 44), torch.empty(45, 9).T, torch.empty(9, 45, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="out must be"):
            layer.forward_into(x, bad)


def test_rejects_what_it_cannot_run() -> None:
    blocks, _ = _blocks(16, 64, T.Q8_0, seed=2)
    with pytest.raises(ValueError, match="bytes do not hold"):
        QuantLinear(blocks, int(T.Q8_0), 96, None)
    with pytest.raises(ValueError, match="unsupported"):
        QuantLinear(blocks, int(T.IQ2_XXS), 64, None)
    with pytest.raises(ValueError, match="divisible"):
        QuantLinear(blocks, int(T.Q4_K), 64, None)
    odd, _ = _blocks(5, 64, T.Q8_0, seed=3)
    with pytest.raises(ValueError, match="multiple of 8"):
        QuantLinear.from_parts([(int(T.Q8_0), odd), (int(T.Q8_0), blocks)], 64, None)
    layer = QuantLinear(blocks, int(T.Q8_0), 64, None)
    with pytest.raises(RuntimeError, match="out of range"):
        layer.dequantize_rows(torch.tensor([16]))


_CROSS_CHECK = """
import sys, torch
from convoy import kernels
kernels.build()
from convoy.kernels.linear import QuantLinear
cases = torch.load(sys.argv[1])
layer = lambda t, b, k: QuantLinear.from_parts(t, k, None) if b is None else QuantLinear(b, t, k, None)
torch.save([layer(t, b, k)(x) for t, b, k, x in cases], sys.argv[2])
"""


@pytest.mark.skipif(builder.isa() == "avx2", reason="this host's build is the AVX2 one")
def test_the_avx2_build_gives_the_same_bits(tmp_path: Path) -> None:
    """AVX2 (no VNNI) is the floor CI may run on: its maddubs path must give exactly what this
    host's path gives (exact integer dots, the same float steps)."""
    if builder.isa() == "generic":
        pytest.skip("this host cannot run AVX2 code")
    cases = []
    for i, qtype in enumerate([T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, *NEWER]):
        blocks, _ = _blocks(21, 256, qtype, seed=i)
        cases.append((int(qtype), blocks, 256, torch.randn(9, 256)))
    cases += _base_kind_cases()
    cases += _many_row_cases()
    _assert_same_bits_when_built_for("avx2", cases, tmp_path)


@pytest.mark.skipif(builder.isa() == "avxvnni", reason="this host's build is the AVX-VNNI one")
def test_the_avx_vnni_build_gives_the_same_bits(tmp_path: Path) -> None:
    """AVX-VNNI (Intel's cores without AVX-512, from Alder Lake on) runs the integer dots as ymm
    vpdpbusd in AVX2's register tiles: the same bits as this host's build."""
    if "avx_vnni" not in builder._cpu_flags():
        pytest.skip("this CPU has no AVX-VNNI")
    cases = []
    for i, qtype in enumerate([T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, *NEWER]):
        blocks, _ = _blocks(21, 256, qtype, seed=30 + i)
        cases.append((int(qtype), blocks, 256, torch.randn(9, 256)))
    cases += _base_kind_cases()
    cases += _many_row_cases()
    _assert_same_bits_when_built_for("avxvnni", cases, tmp_path)


def _many_row_cases() -> list:
    """Enough rows and panels for the compute-bound tiles (zmm tiles of four panels where the
    host has AVX-512 VNNI), with a part-filled last group: 61 outputs are 8 panels, the last one
    5 rows deep."""
    cases = []
    for i, qtype in enumerate([T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.IQ4_XS, T.Q2_K, T.Q3_K]):
        blocks, _ = _blocks(61, 256, qtype, seed=60 + i)
        cases.append((int(qtype), blocks, 256, torch.randn(40, 256)))
    # kQ5, kQ6; kQ8M and kQ8 (no cut splits these in two runs of narrow kinds)
    joined = (
        [T.Q4_K, T.Q5_K],
        [T.Q3_K, T.Q6_K],
        [T.Q4_K, T.Q8_0, T.Q4_K],
        [T.Q6_K, T.Q8_0, T.Q6_K],
    )
    for i, types in enumerate(joined):
        parts = [(int(t), _blocks(16, 256, t, seed=70 + i)[0]) for t in types]
        cases.append((parts, None, 256, torch.randn(40, 256)))
    return cases


@pytest.mark.skipif(builder.isa() != "avx512vnni", reason="zmm tiles need AVX-512 VNNI")
def test_zmm_tiles_give_the_bits_of_ymm_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """CONVOY_CPU_ZMM=0 runs the same tiles in ymm registers: the same outputs, bit for bit, at
    every row count (a tile of 1-4 rows, a part-filled last group of panels), where the panels
    are split statically (3-15 rows; 2 for IQ4_XS) and in chunks (16 rows on)."""
    for qtype, blocks, k, x in _many_row_cases():
        layer = _layer(qtype, blocks, k)
        wide = layer(x)
        monkeypatch.setenv("CONVOY_CPU_ZMM", "0")
        for m in (2, 3, 5, 15, 16, 17, 19, 40):
            assert torch.equal(layer(x[:m]), wide[:m]), (qtype, m)
        monkeypatch.delenv("CONVOY_CPU_ZMM")


def _base_kind_cases() -> list:
    """K-quants joined with other types: the base kinds kQ4, kQ5, kQ6 of their fp16 scales."""
    cases = []
    for i, types in enumerate(([T.Q4_K, T.Q4_0], [T.Q4_K, T.Q5_K], [T.Q3_K, T.Q6_K])):
        parts = [(int(t), _blocks(16, 256, t, seed=40 + i)[0]) for t in types]
        cases.append((parts, None, 256, torch.randn(9, 256)))
    return cases


def test_the_portable_build_gives_the_same_bits(tmp_path: Path) -> None:
    """The plain C++ path (no SIMD: what a host without AVX2 runs) computes what this host's
    SIMD path computes, for every panel kind: the same integer dots and float steps."""
    cases = []
    for i, qtype in enumerate([T.Q4_K, T.Q8_0, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1, *NEWER]):
        blocks, _ = _blocks(21, 256, qtype, seed=i)
        cases.append((int(qtype), blocks, 256, torch.randn(37, 256)))
    parts = [(int(T.Q3_K), _blocks(16, 256, T.Q3_K, seed=1)[0]), (int(T.Q5_K), cases[2][1])]
    cases.append((parts, None, 256, torch.randn(5, 256)))  # Q3_K in 8-bit panels
    cases += _base_kind_cases()
    _assert_same_bits_when_built_for("generic", cases, tmp_path)


def _assert_same_bits_when_built_for(isa: str, cases: list, tmp_path: Path) -> None:
    """Each case's output from a subprocess whose kernels are built for `isa` equals this one's."""
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, builder.ISA_ENV: isa}
    subprocess.run(
        [sys.executable, "-c", _CROSS_CHECK, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
        env=env,
        check=True,
        timeout=900,
    )
    theirs = torch.load(tmp_path / "out.pt")
    for (qtype, blocks, k, x), other in zip(cases, theirs, strict=True):
        assert torch.equal(_layer(qtype, blocks, k)(x), other), qtype


def _layer(qtype, blocks, k):  # noqa: ANN001, ANN202 - a case of _CROSS_CHECK
    if blocks is None:
        return QuantLinear.from_parts(qtype, k, None)
    return QuantLinear(blocks, qtype, k, None)
