"""The dense linear kernels on 16-wide panels (csrc/panel_gemm.h): fp32 (fp32_linear.cpp) and
bf16 in k pairs (bf16_linear.cpp's bf16_pairs_linear, vdpbf16ps where the CPU has it), what
fp32 and bf16 models on the CPU run instead of oneDNN, whose per-shape primitive caches grew the
exact modes' servers in steps (issue #29)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from convoy import kernels
from convoy.kernels import builder
from convoy.kernels.linear import Bf16PackedLinear
from convoy.kernels.packed_linear import Fp32KernelLinear, linear_packing, pack_linears

# (K, N): SmolLM2's qkv shape; then remainders of the 6-row tiles, the 16-wide panels, the
# AVX-512 panel pairs (N = 16 * odd) and the 256-wide k blocks (K = 513, 300)
SHAPES = [(576, 1728), (37, 47), (300, 16), (5, 33), (513, 97), (64, 80)]
ROWS = [1, 2, 5, 6, 7, 13, 64, 193, 300]


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not builder.has_compiler():
        pytest.skip("no C++ compiler")
    kernels.build()


def _packed(k: int, n: int, seed: int) -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n)
    return linear, kernels.pack_fp32_weight(linear.weight.detach())


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_fp32_kernel_matches_a_float64_matmul(k: int, n: int) -> None:
    linear, packed = _packed(k, n, seed=k * n)
    bias = linear.bias.detach()
    for rows in ROWS:
        x = torch.randn(rows, k)
        got = kernels.fp32_linear(x, packed, bias, n)
        want = (x.double() @ linear.weight.detach().double().t() + bias.double()).float()
        assert got.shape == (rows, n) and got.dtype == torch.float32
        # fp32 sums of k unit-scale products: within a few ulps of the sum's magnitude
        torch.testing.assert_close(got, want, atol=2e-6 * k**0.5 * 4, rtol=1e-5)
        no_bias = kernels.fp32_linear(x, packed, None, n)
        torch.testing.assert_close(no_bias + bias, got, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_a_rows_bits_do_not_depend_on_the_batch(k: int, n: int) -> None:
    """Each output is one FMA chain over k in order, whatever the tile, block or row count."""
    _, packed = _packed(k, n, seed=1)
    x = torch.randn(300, k)
    alone = torch.cat([kernels.fp32_linear(x[i : i + 1], packed, None, n) for i in range(300)])
    for rows, start in [(300, 0), (7, 11), (193, 100), (64, 236)]:
        got = kernels.fp32_linear(x[start : start + rows], packed, None, n)
        assert torch.equal(got, alone[start : start + rows]), (rows, start)


def test_empty_and_malformed_inputs() -> None:
    _, packed = _packed(40, 24, seed=2)
    assert kernels.fp32_linear(torch.randn(0, 40), packed, None, 24).shape == (0, 24)
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.fp32_linear(torch.randn(3, 41), packed, None, 24)
    with pytest.raises(RuntimeError, match="fp32"):
        kernels.fp32_linear(torch.randn(3, 40, dtype=torch.bfloat16), packed, None, 24)


def test_fp32_models_on_the_cpu_get_the_kernel() -> None:
    cpu = torch.device("cpu")
    assert linear_packing(cpu, torch.float32) == "fp32-kernel"
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 20, bias=False))
    x = torch.randn(5, 3, 32)  # leading dims kept
    with torch.inference_mode():
        want = model(x)
        assert pack_linears(model, "fp32-kernel") == 2
        got = model(x)
    assert all(isinstance(m, Fp32KernelLinear) for m in model)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _bf16(k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    w = torch.randn(n, k).to(torch.bfloat16)
    return w, torch.randn(n), kernels.pack_bf16_pairs(w)


def test_bf16_pairs_are_packed_as_vdpbf16ps_reads_them() -> None:
    w = torch.randn(37, 5).to(torch.bfloat16)  # a partial panel, an odd K
    packed = kernels.pack_bf16_pairs(w)
    assert packed.shape == (3, 3, 32) and packed.dtype == torch.bfloat16
    for p in range(3):
        for j in range(3):
            for c in range(16):
                for t in range(2):
                    n, k = 16 * p + c, 2 * j + t
                    want = w[n, k] if n < 37 and k < 5 else torch.tensor(0, dtype=torch.bfloat16)
                    assert torch.equal(packed[p, j, 2 * c + t], want), (p, j, c, t)


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_bf16_pairs_kernel_matches_a_float64_matmul(k: int, n: int) -> None:
    w, bias, packed = _bf16(k, n, seed=k + n)
    for rows in ROWS:
        x = torch.randn(rows, k).to(torch.bfloat16)
        got = kernels.bf16_pairs_linear(x, packed, bias, n)
        want = x.double() @ w.double().t() + bias.double()
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        # exact products, fp32 sums, one rounding to bf16: half a bf16 ulp and a little
        torch.testing.assert_close(got.double(), want, atol=1e-4 * k**0.5, rtol=2**-8)
        wide = kernels.bf16_pairs_linear(x.float(), packed, bias, n)  # fp32 in: fp32 out
        assert wide.dtype == torch.float32 and torch.equal(wide.to(torch.bfloat16), got)


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_a_bf16_rows_bits_do_not_depend_on_the_batch(k: int, n: int) -> None:
    _, _, packed = _bf16(k, n, seed=2)
    x = torch.randn(300, k).to(torch.bfloat16)
    alone = torch.cat([kernels.bf16_pairs_linear(x[i : i + 1], packed, None, n) for i in range(300)])
    for rows, start in [(300, 0), (7, 11), (193, 100), (64, 236)]:
        got = kernels.bf16_pairs_linear(x[start : start + rows], packed, None, n)
        assert torch.equal(got, alone[start : start + rows]), (rows, start)


def test_bf16_pairs_malformed_inputs() -> None:
    _, _, packed = _bf16(41, 24, seed=3)
    assert kernels.bf16_pairs_linear(torch.randn(0, 41), packed, None, 24).shape == (0, 24)
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.bf16_pairs_linear(torch.randn(3, 43), packed, None, 24)
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.bf16_pairs_linear(torch.randn(3, 41), packed, None, 40)
    with pytest.raises(RuntimeError, match="bf16 weight"):
        kernels.pack_bf16_pairs(torch.randn(8, 8, dtype=torch.float16))


def test_bf16_models_on_the_cpu_get_the_kernel() -> None:
    """With or without native bf16: oneDNN's bf16 path caches a primitive per shape (#29)."""
    cpu = torch.device("cpu")
    assert linear_packing(cpu, torch.bfloat16) == "bf16-kernel"
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 20, bias=False)).to(torch.bfloat16)
    x = torch.randn(5, 3, 32).to(torch.bfloat16)
    with torch.inference_mode():
        want = model.float()(x.float())
        model.to(torch.bfloat16)
        assert pack_linears(model, "bf16-kernel") == 2
        got = model(x)
    assert all(isinstance(m, Bf16PackedLinear) for m in model)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


_CROSS_CHECK = """
import sys, torch
from convoy import kernels
kernels.build()
fp32, bf16 = torch.load(sys.argv[1])
torch.save(([kernels.fp32_linear(x, kernels.pack_fp32_weight(w), b, w.shape[0]) for w, b, x in fp32],
            [kernels.bf16_pairs_linear(x, kernels.pack_bf16_pairs(w), b, w.shape[0]) for w, b, x in bf16]),
           sys.argv[2])
"""


def _has_vdpbf16ps() -> bool:
    return builder.isa().startswith("avx512") and torch.cpu._is_avx512_bf16_supported()


@pytest.mark.parametrize("isa", ["avx2", "generic", "avx512-fma"])
def test_every_build_gives_the_same_bits(isa: str, tmp_path: Path) -> None:
    """AVX-512 (two panels a tile; bf16 through vdpbf16ps where the CPU has it, FMAs in its order
    with CONVOY_CPU_VDPBF16PS=0), AVX2 and the portable loop: the same chains, the same bits."""
    env = {**os.environ}
    if isa == "avx512-fma":
        if not _has_vdpbf16ps():
            pytest.skip("no vdpbf16ps here: this host's build runs the FMA loops already")
        env["CONVOY_CPU_VDPBF16PS"] = "0"
    else:
        if builder.isa() == isa:
            pytest.skip(f"this host's build is the {isa} one")
        if isa == "avx2" and builder.isa() == "generic":
            pytest.skip("this host cannot run AVX2 code")
        env[builder.ISA_ENV] = isa
    torch.manual_seed(3)
    rows = [13, 7, 300, 1, 64, 6]
    fp32 = [(torch.randn(n, k), torch.randn(n), torch.randn(r, k))
            for (k, n), r in zip(SHAPES, rows, strict=True)]  # fmt: skip
    bf16 = [(w.to(torch.bfloat16), b, x.to(torch.bfloat16)) for w, b, x in fp32]
    torch.save((fp32, bf16), tmp_path / "cases.pt")
    out = tmp_path / "out.pt"
    subprocess.run(
        [sys.executable, "-c", _CROSS_CHECK, str(tmp_path / "cases.pt"), str(out)],
        env=env,
        check=True,
        timeout=900,
    )
    theirs_fp32, theirs_bf16 = torch.load(out)
    for (w, b, x), theirs in zip(fp32, theirs_fp32, strict=True):
        assert torch.equal(kernels.fp32_linear(x, kernels.pack_fp32_weight(w), b, w.shape[0]), theirs)
    for (w, b, x), theirs in zip(bf16, theirs_bf16, strict=True):
        got = kernels.bf16_pairs_linear(x, kernels.pack_bf16_pairs(w), b, w.shape[0])
        assert torch.equal(got, theirs), w.shape
