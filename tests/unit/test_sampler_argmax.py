"""worker/sampler.argmax_rows: the same indices as torch's argmax (first maximum, NaN as the
maximum), on shapes that take the chunked path and shapes that do not."""

from __future__ import annotations

import torch

from convoy.worker.sampler import argmax_rows


def test_same_indices_as_torch_argmax() -> None:
    g = torch.Generator().manual_seed(0)
    for n, v in [(1, 4096), (7, 49152), (3, 5000), (2, 1024)]:
        x = torch.randn(n, v, generator=g)
        assert torch.equal(argmax_rows(x), x.argmax(-1)), (n, v)
    x = torch.zeros(4, 8192)
    x[0, [5000, 300]] = 2.0  # ties: the first one wins, across chunks
    x[1, [1500, 1200]] = 3.0  # ties inside one chunk
    x[2] = float("-inf")  # a fully masked row
    x[3, [9, 7000]] = float("nan")  # NaN counts as the maximum, the first one
    x[3, 100] = float("inf")
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert argmax_rows(x).tolist() == [300, 1200, 0, 9]
    strided = torch.randn(8192, 3).T  # not contiguous: torch's own path
    assert torch.equal(argmax_rows(strided), strided.argmax(-1))
