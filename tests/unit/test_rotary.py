"""RotaryEmbedding's cos/sin table grows with the positions seen, in fixed chunks, so a position's
values do not depend on the order in which the table grew."""

from __future__ import annotations

import torch

from convoy.models.layers import RotaryEmbedding


def test_table_grows_on_demand_and_values_do_not_depend_on_its_history() -> None:
    a = RotaryEmbedding(64, 32768, 10000.0, None)
    b = RotaryEmbedding(64, 32768, 10000.0, None)
    assert a.cos.shape[0] == RotaryEmbedding.CHUNK  # not the whole context up front
    for p in (5000, 1500, 20000, 3000):  # a grows step by step, b at once
        a.tables(torch.tensor([0, p]))
    cos_b, sin_b = b.tables(torch.tensor([20000]))
    n = min(a.cos.shape[0], cos_b.shape[0])
    assert n > 20000
    assert torch.equal(a.cos[:n], cos_b[:n]) and torch.equal(a.sin[:n], sin_b[:n])
    # The values are the textbook ones.
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    assert torch.allclose(cos_b[12345], torch.cos(12345 * inv_freq), atol=1e-3)


def test_never_beyond_the_model_context() -> None:
    rope = RotaryEmbedding(32, 3000, 10000.0, None)
    cos, _ = rope.tables(torch.tensor([2999]))
    assert cos.shape[0] == 3000
    q = torch.randn(2, 1, 32)
    out_q, _ = rope(torch.tensor([0, 2999]), q, q.clone())
    assert out_q.shape == q.shape
    assert torch.equal(out_q[0], q[0])  # position 0 is the identity
