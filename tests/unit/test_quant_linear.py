"""csrc/quant_linear.cpp: GGUF Q4_0 / Q4_1 / Q8_0 weights kept in their blocks, against a reference.

The reference follows the same arithmetic in float64: weights dequantized by the gguf package,
activations quantized to int8 blocks of 32 (scale amax / 127, round half to even) and dequantized.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from convoy.kernels.linear import QuantLinear

pytestmark = pytest.mark.usefixtures("cpu_kernels")

TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]
SHAPES = [(1, 32), (7, 64), (45, 96), (130, 576)]  # (N, K): odd N, thread-split remainders
BATCHES = [1, 2, 3, 5, 17, 64, 65, 300]  # M: group and tile remainders


def _weights(n: int, k: int, qtype: T, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.01).astype(np.float32)
    blocks = quantize(w, qtype)
    return torch.from_numpy(np.ascontiguousarray(blocks)), dequantize(blocks, qtype)


def _reference(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    xb = x.double().view(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, xb / d, torch.zeros_like(xb)).round()  # half to even, as nearbyint
    xq = (q * d).view(x.shape)
    return xq @ torch.from_numpy(w).double().T


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_matches_the_reference_for_every_batch_size(qtype: T, n: int, k: int) -> None:
    blocks, w = _weights(n, k, qtype, seed=n + k)
    layer = QuantLinear(blocks, int(qtype), k, None)
    x = torch.randn(max(BATCHES), k, generator=torch.Generator().manual_seed(k))
    full = layer(x)
    ref = _reference(x, w)
    scale = ref.abs().max().item()
    assert (full.double() - ref).abs().max().item() <= 1e-5 * scale
    # Against the plain fp32 product the int8 activations cost a little accuracy, no more.
    exact = x @ torch.from_numpy(w).T
    assert (full - exact).abs().max().item() <= 0.02 * exact.abs().max().item()
    for m in BATCHES:  # batch invariance: each row is the same bits alone and in any batch
        assert torch.equal(layer(x[:m]), full[:m]), m


def test_bias_and_leading_dims() -> None:
    blocks, w = _weights(10, 64, T.Q4_1, seed=1)
    bias = torch.arange(10, dtype=torch.float32)
    layer = QuantLinear(blocks, int(T.Q4_1), 64, bias)
    x = torch.randn(2, 3, 64)
    out = layer(x)
    assert out.shape == (2, 3, 10)
    ref = _reference(x.view(6, 64), w).view(2, 3, 10) + bias.double()
    assert torch.allclose(out.double(), ref, atol=1e-4)


def test_rejects_shapes_it_cannot_run() -> None:
    blocks, _ = _weights(4, 64, T.Q8_0, seed=2)
    with pytest.raises(ValueError):
        QuantLinear(blocks, int(T.Q8_0), 96, None)  # row bytes do not hold 96 weights
    with pytest.raises(ValueError):
        QuantLinear(blocks, int(T.Q4_K), 64, None)  # not a type this kernel runs
