"""csrc MoE kernels: `moe_experts` (every routed expert in one call on the stacked quant_linear
panels) against the per-expert quant_linear + act_and_mul loop (`QuantExperts.forward_loop`), and
the router's `dense_linear` / `moe_topk` against torch. Every expert kernel result must be the
loop's bits, and the bits of a row must not depend on the rows beside it or the thread count."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from convoy import kernels
from convoy.kernels import builder
from convoy.kernels.ops import QUANT_BLOCKS
from convoy.models.moe import QuantExperts

pytestmark = pytest.mark.usefixtures("cpu_kernels")

LEGACY = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
HALF_FIELDS = {Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}  # fp16 scale fields of a block
# Q8_0 -> kQ8S, Q4_0 / Q4_1 / Q4_K -> kQ4, Q6_K -> kQ6, Q5_K / Q5_0 -> kQ5 (bit planes)
KINDS = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q5_0]
E, H, INTER = 8, 256, 256


def _blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> torch.Tensor:
    """(rows, bytes) GGUF blocks: legacy types quantized by gguf from real values, K-quants random
    bytes with sane fp16 scales (gguf cannot quantize them)."""
    if qtype in LEGACY:
        w = rng.standard_normal((rows, cols)) * 0.05 + rng.standard_normal((rows, 1)) * 0.01
        raw = quantize(w.astype(np.float32), qtype)
    else:
        elems, nbytes = QUANT_BLOCKS[int(qtype)]
        raw = rng.integers(0, 256, (rows, cols // elems, nbytes), dtype=np.uint8)
        for off in HALF_FIELDS[qtype]:
            half = rng.uniform(0.0005, 0.004, (rows, cols // elems)).astype(np.float16)
            raw[:, :, off : off + 2] = half.view(np.uint8).reshape(rows, cols // elems, 2)
        raw = raw.reshape(rows, -1)
    return torch.from_numpy(np.ascontiguousarray(raw))


def _experts(qtype: Q, act: str = "silu", seed: int = 0, experts: int = E) -> QuantExperts:
    rng = np.random.default_rng(seed)
    gu = torch.stack([_blocks(2 * INTER, H, qtype, rng) for _ in range(experts)])
    dn = torch.stack([_blocks(H, INTER, qtype, rng) for _ in range(experts)])
    return QuantExperts([(int(qtype), gu)], [(int(qtype), dn)], H, INTER, act)


def _route(t: int, k: int, seed: int, experts: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen)
    return ids, w


def _x(t: int, seed: int) -> torch.Tensor:
    return torch.randn(t, H, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def threads() -> Iterator[None]:
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("qtype", KINDS, ids=lambda q: q.name)
def test_one_expert_a_row_is_the_bits_of_the_loop(qtype: Q) -> None:
    ex = _experts(qtype)
    x = _x(9, 1)
    ids, w = _route(9, 1, 2)
    out = ex(x, ids, w)
    assert out.shape == (9, H) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert torch.equal(out, ex.forward_loop(x, ids, w))


@pytest.mark.parametrize("qtype", KINDS, ids=lambda q: q.name)
@pytest.mark.parametrize("k", [2, 8])
def test_top_k_is_the_bits_of_the_loop(qtype: Q, k: int) -> None:
    ex = _experts(qtype, seed=3)
    x = _x(11, 4)
    ids, w = _route(11, k, 5)
    assert torch.equal(ex(x, ids, w), ex.forward_loop(x, ids, w))


def test_gelu_and_many_rows_an_expert() -> None:
    """Two experts, ~100 rows each: several row tiles, register-tile remainders, panel pairs."""
    ex = _experts(Q.Q8_0, act="gelu_pytorch_tanh", seed=6, experts=2)
    x = _x(150, 7)
    ids, w = _route(150, 2, 8, experts=2)
    ids[::3] = ids[::3].flip(1)
    assert torch.equal(ex(x, ids, w), ex.forward_loop(x, ids, w))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q6_K], ids=lambda q: q.name)
def test_a_row_is_the_same_bits_in_any_batch(qtype: Q) -> None:
    ex = _experts(qtype, seed=9)
    row, (row_ids, row_w) = _x(1, 10), _route(1, 4, 11)
    alone = ex(row, row_ids, row_w)
    for size, seed in [(1, 12), (3, 13), (16, 14), (64, 15)]:
        x, (ids, w) = _x(size, seed), _route(size, 4, seed)
        at = size // 2
        x[at], ids[at], w[at] = row[0], row_ids[0], row_w[0]
        assert torch.equal(ex(x, ids, w)[at], alone[0]), size


def test_the_thread_count_changes_no_bit(threads: None) -> None:
    ex = _experts(Q.Q4_1, seed=16)
    results = []
    for t in (1, 16, 64):
        x, (ids, w) = _x(t, 17 + t), _route(t, 8, 18 + t)
        per_threads = []
        for n in (1, 2):
            torch.set_num_threads(n)
            per_threads.append(ex(x, ids, w))
        results.append(per_threads)
    for one, two in results:
        assert torch.equal(one, two)


def test_repeated_ids_in_a_row() -> None:
    ex = _experts(Q.Q8_0, seed=19)
    x = _x(3, 20)
    ids = torch.tensor([[3, 3, 1], [0, 0, 0], [7, 2, 7]])
    w = torch.rand(3, 3)
    out = ex(x, ids, w)
    assert torch.equal(out, ex.forward_loop(x, ids, w))
    one = ex(x[1:2], torch.tensor([[0]]), torch.ones(1, 1))  # 3 ranks of expert 0
    ws = w[1]
    assert torch.equal(out[1], ((ws[0] * one[0]) + ws[1] * one[0]) + ws[2] * one[0])


def test_bad_ids_and_shapes_raise() -> None:
    ex = _experts(Q.Q8_0, seed=21)
    x = _x(2, 22)
    w = torch.ones(2, 2)
    for bad in (-1, E, 1 << 40):
        with pytest.raises(RuntimeError, match="out of range"):
            ex(x, torch.tensor([[0, 1], [bad, 2]]), w)
    args = (ex.gate_up, ex.gate_up_kind, ex.down, ex.down_kind, INTER, ex.act_id)
    ids = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(RuntimeError, match="weights"):
        kernels.moe_experts(x, ids, w[:, :1].contiguous(), *args)
    with pytest.raises(RuntimeError, match="ids"):
        kernels.moe_experts(x, ids.int(), w, *args)
    with pytest.raises(RuntimeError, match="down"):
        kernels.moe_experts(x, ids, w, ex.gate_up, ex.gate_up_kind, ex.down[:-8], ex.down_kind,
                            INTER, ex.act_id)  # fmt: skip
    empty = kernels.moe_experts(x[:0], ids[:0], w[:0], *args)
    assert empty.shape == (0, H)


# --- router


@pytest.mark.parametrize("hidden", [64, 100, 2048])
def test_dense_linear_matches_torch_and_is_batch_invariant(hidden: int, threads: None) -> None:
    gen = torch.Generator().manual_seed(23)
    w = torch.randn(60, hidden, generator=gen) * 0.05
    x = torch.randn(64, hidden, generator=gen)
    out = kernels.dense_linear(x, w)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    ref64 = (x.double() @ w.double().T).float()
    torch.testing.assert_close(out, ref64, rtol=1e-5, atol=1e-5)
    for size in (1, 3, 16):
        assert torch.equal(kernels.dense_linear(x[:size], w), out[:size])
    assert torch.equal(kernels.dense_linear(x[5:6], w)[0], out[5])
    torch.set_num_threads(1)
    assert torch.equal(kernels.dense_linear(x, w), out)


def test_sigmoid_gate_is_torch_sigmoid_and_batch_invariant() -> None:
    """Qwen2-MoE's shared-expert gate: one column, so torch.sigmoid over (T, 1) puts a row in the
    vector body or in the scalar tail depending on T (different bits on AVX2); the kernel's are
    the same whatever the batch."""
    gen = torch.Generator().manual_seed(25)
    w = torch.randn(1, 64, generator=gen) * 0.3
    x = torch.randn(29, 64, generator=gen)
    out = kernels.sigmoid_gate(x, w)
    assert out.shape == (29, 1)
    torch.testing.assert_close(out, torch.sigmoid(F.linear(x, w)), rtol=1e-6, atol=1e-7)
    for start, size in ((0, 1), (3, 9), (12, 17), (28, 1)):
        part = kernels.sigmoid_gate(x[start : start + size].contiguous(), w)
        assert torch.equal(part, out[start : start + size])


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_moe_topk_matches_torch(k: int, normalize: bool) -> None:
    logits = torch.randn(50, 64, generator=torch.Generator().manual_seed(24)) * 3
    weights, ids = kernels.moe_topk(logits, k, normalize)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ref_w, ref_ids = torch.topk(probs, k, dim=-1)
    if normalize:
        ref_w = ref_w / ref_w.sum(dim=-1, keepdim=True)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)
    for size in (1, 7):  # rows alone are the same bits
        w1, i1 = kernels.moe_topk(logits[3 : 3 + size].contiguous(), k, normalize)
        assert torch.equal(w1, weights[3 : 3 + size]) and torch.equal(i1, ids[3 : 3 + size])


def test_moe_topk_ties_take_the_lower_expert_first() -> None:
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, ids = kernels.moe_topk(logits, 3, False)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert torch.equal(weights[1], torch.full((3,), 0.2))
    with pytest.raises(RuntimeError, match="k must be"):
        kernels.moe_topk(logits, 6, False)
    nan = torch.tensor([[0.0, float("nan"), 1.0, 2.0]])  # NaN rows still give k distinct ids
    _, ids = kernels.moe_topk(nan, 3, True)
    assert sorted(ids[0].tolist()) == ids[0].tolist() and len(set(ids[0].tolist())) == 3


_CROSS_CHECK = """
import sys, torch
from convoy import kernels
kernels.build()
ex, x, ids, w, logits = torch.load(sys.argv[1], weights_only=False)
torch.save([ex(x, ids, w), kernels.dense_linear(x, logits), kernels.moe_topk(x @ logits.T, 4, True)],
           sys.argv[2])
"""


@pytest.mark.skipif(builder.isa() in ("avx2", "generic"), reason="needs a host above AVX2")
def test_the_avx2_build_gives_the_same_bits(tmp_path: Path) -> None:
    """AVX2 without VNNI (the floor CI may run on): the experts and the router are this host's
    bits (exact integer dots, the same float steps)."""
    ex = _experts(Q.Q4_1, seed=25)
    x, (ids, w) = _x(5, 26), _route(5, 3, 27)
    router = torch.randn(E, H, generator=torch.Generator().manual_seed(28)) * 0.05
    torch.save((ex, x, ids, w, router), tmp_path / "cases.pt")
    env = {**os.environ, builder.ISA_ENV: "avx2"}
    subprocess.run(
        [sys.executable, "-c", _CROSS_CHECK, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
        env=env,
        check=True,
        timeout=900,
    )
    out, dense, (tw, tids) = torch.load(tmp_path / "out.pt")
    assert torch.equal(out, ex(x, ids, w))
    assert torch.equal(dense, kernels.dense_linear(x, router))
    mine_w, mine_ids = kernels.moe_topk(x @ router.T, 4, True)
    assert torch.equal(tids, mine_ids) and torch.equal(tw, mine_w)


def _dequantized(ex: QuantExperts, qtype: Q, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float weights (E, 2I, H) and (E, H, I) of `_experts(qtype, seed=seed)`'s blocks."""
    from gguf.quants import dequantize

    rng = np.random.default_rng(seed)
    gu, dn = [], []
    for _ in range(ex.num_experts):
        gu.append(dequantize(_blocks(2 * INTER, H, qtype, rng).numpy(), qtype))
    for _ in range(ex.num_experts):
        dn.append(dequantize(_blocks(H, INTER, qtype, rng).numpy(), qtype))
    as_t = lambda ws: torch.from_numpy(np.stack(ws)).double()  # noqa: E731
    return as_t(gu).view(ex.num_experts, 2 * INTER, H), as_t(dn).view(ex.num_experts, H, INTER)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_uneven_loads_against_a_dequantize_and_matmul_reference(qtype: Q) -> None:
    """Row counts 1..300 where one expert takes every row and another none: within the int8
    activation rounding of a float64 dequantize + matmul reference, and any leading rows of the
    batch are the same bits run alone."""
    seed = 21
    ex = _experts(qtype, seed=seed)
    gu, dn = _dequantized(ex, qtype, seed)
    for t in (1, 5, 37, 300):
        x = _x(t, 30 + t)
        gen = torch.Generator().manual_seed(t)
        ids = torch.stack(
            [
                torch.zeros(t, dtype=torch.long),  # expert 0: every row
                torch.randint(1, E - 1, (t,), generator=gen),
            ],
            1,
        )  # E-1: none
        w = torch.rand(t, 2, generator=gen)
        out = ex(x, ids, w)
        ref = torch.zeros(t, H, dtype=torch.float64)
        for j in range(2):
            g = torch.einsum("th,tih->ti", x.double(), gu[ids[:, j]])
            gate, up = g.chunk(2, dim=-1)
            y = torch.einsum("ti,thi->th", F.silu(gate) * up, dn[ids[:, j]])
            ref += w[:, j : j + 1].double() * y
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 0.02, (t, err)
        for n in {1, t // 2, t - 1} - {0}:
            assert torch.equal(ex(x[:n], ids[:n], w[:n]), out[:n]), (t, n)
