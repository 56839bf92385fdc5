"""The fp32 linear kernel (csrc/fp32_linear.cpp): what fp32 models on the CPU run instead of
oneDNN, whose per-shape primitive caches grew the fp32 server in steps (issue #29)."""

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


_CROSS_CHECK = """
import sys, torch
from convoy import kernels
kernels.build()
cases = torch.load(sys.argv[1])
torch.save([kernels.fp32_linear(x, kernels.pack_fp32_weight(w), b, w.shape[0]) for w, b, x in cases],
           sys.argv[2])
"""


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_every_build_gives_the_same_bits(isa: str, tmp_path: Path) -> None:
    """AVX-512 (two panels a tile), AVX2 and the portable loop: the same chains, the same bits."""
    if builder.isa() == isa:
        pytest.skip(f"this host's build is the {isa} one")
    if isa == "avx2" and builder.isa() == "generic":
        pytest.skip("this host cannot run AVX2 code")
    torch.manual_seed(3)
    cases = [(torch.randn(n, k), torch.randn(n), torch.randn(rows, k))
             for (k, n), rows in zip(SHAPES, [13, 7, 300, 1, 64, 6], strict=True)]  # fmt: skip
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, builder.ISA_ENV: isa}
    out = tmp_path / "out.pt"
    subprocess.run(
        [sys.executable, "-c", _CROSS_CHECK, str(tmp_path / "cases.pt"), str(out)],
        env=env,
        check=True,
        timeout=900,
    )
    for (w, b, x), theirs in zip(cases, torch.load(out), strict=True):
        assert torch.equal(kernels.fp32_linear(x, kernels.pack_fp32_weight(w), b, w.shape[0]), theirs)
