"""Prepacked oneDNN linears: same results as nn.Linear, every linear of a model replaced, run at
a bounded set of row counts (issue #29)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from convoy.kernels import packed_linear as packed_mod
from convoy.kernels.packed_linear import (
    EXACT_ROWS,
    PackedLinear,
    PaddedBf16Linear,
    onednn_linear_available,
    pack_linears,
    padded_rows,
)

pytestmark = pytest.mark.skipif(
    not onednn_linear_available(torch.device("cpu"), torch.float32), reason="no oneDNN"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 16, 64, 65, 300])
def test_packed_linear_matches_nn_linear(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        want = linear(x)
        got = packed(x)
        got3 = packed(x.view(1, rows, 96))  # leading dims kept
        got_t = packed(torch.randn(96, rows).t())  # non-contiguous input is accepted
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got3, want.view(1, rows, 200), atol=1e-5, rtol=1e-5)
    assert got_t.shape == (rows, 200)


def test_padded_rows_are_few_sizes_close_above_the_row_count() -> None:
    sizes = {padded_rows(m) for m in range(1, 8193)}
    assert len(sizes) <= 176  # oneDNN's primitive cache holds 1024: ~5 linear shapes x these
    for m in range(1, 8193):
        assert m <= padded_rows(m) <= m * 1.0625
        assert padded_rows(m) == m or m > EXACT_ROWS
        assert padded_rows(padded_rows(m)) == padded_rows(m)


def test_packed_linear_gives_onednn_only_padded_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step's row count used to reach oneDNN as is: a new primitive per count (#29)."""
    seen: list[int] = []
    run = packed_mod.onednn_linear

    def recording(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        seen.append(x.shape[0])
        return run(x, packed, bias)

    monkeypatch.setattr(packed_mod, "onednn_linear", recording)
    torch.manual_seed(0)
    linear = nn.Linear(32, 48)
    packed = PackedLinear(linear)
    x = torch.randn(300, 32)
    with torch.inference_mode():
        for rows in range(60, 300, 7):
            torch.testing.assert_close(packed(x[:rows]), linear(x[:rows]), atol=1e-5, rtol=1e-5)
    assert seen == [padded_rows(rows) for rows in range(60, 300, 7)]


def test_pack_linears_replaces_every_linear_and_keeps_tied_embedding() -> None:
    emb = nn.Embedding(50, 32)
    model = nn.ModuleDict(
        {
            "emb": emb,
            "a": nn.Linear(32, 64),
            "inner": nn.Sequential(nn.Linear(64, 32)),
            "head": nn.Linear(32, 50, bias=False),
        }
    )
    model["head"].weight = emb.weight  # tied, as in SmolLM2 and Gemma 3
    x = torch.randn(3, 32)
    with torch.inference_mode():
        want = model["head"](model["inner"](model["a"](x)))
        assert pack_linears(model) == 3
        got = model["head"](model["inner"](model["a"](x)))
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model["emb"].weight is emb.weight and emb.weight.layout == torch.strided
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 6, 13, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_kernel_linear_matches_fp32_math_on_bf16_weights(
    cpu_kernels: None, rows: int, bias: bool
) -> None:
    from convoy.kernels.linear import Bf16PackedLinear

    torch.manual_seed(rows)
    linear = nn.Linear(72, 37, bias=bias).to(torch.bfloat16)  # 37: a partial 16-wide panel
    packed = Bf16PackedLinear(linear)
    x = torch.randn(rows, 72).to(torch.bfloat16)
    with torch.inference_mode():
        got = packed(x)
        b = None if linear.bias is None else linear.bias.float()
        want = torch.nn.functional.linear(x.float(), linear.weight.float(), b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 37)
    # fp32 accumulation, one rounding to bf16 at the end: within half a bf16 ulp (+ order noise)
    torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=2**-8)


def test_native_bf16_linear_runs_at_padded_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 with native bf16 goes to oneDNN through F.linear: the same per-shape primitive cache
    grew the bf16 server ~60 KB a request until its row counts were padded too (#29)."""
    seen: list[int] = []
    run = torch.nn.functional.linear

    def recording(
        x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        seen.append(x.shape[0])
        return run(x, w, b)

    torch.manual_seed(0)
    linear = nn.Linear(32, 48).to(torch.bfloat16)
    padded = PaddedBf16Linear(linear)
    x = torch.randn(300, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = [linear(x[:rows]) for rows in range(60, 300, 7)]
        monkeypatch.setattr(packed_mod.F, "linear", recording)
        got = [padded(x[:rows]) for rows in range(60, 300, 7)]
    assert seen == [padded_rows(rows) for rows in range(60, 300, 7)]
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == torch.bfloat16
        torch.testing.assert_close(g, w, atol=1e-2, rtol=1e-2)
