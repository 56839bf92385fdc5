"""The sampler's random rows, by both of its paths (worker/sampler.py): the CPU's inverse CDF
(`_sample_random_cpu`, numpy masking) and every other device's exponential race
(`_sample_random`, masked_fill_), the latter run here on CPU tensors (`sampler.CPU_PATHS`). The
tokens drawn follow softmax(logits / T) restricted by a grammar's bitmask, top-k (ties at the
k-th value kept), top-p and min-p, computed here in float64 from the definitions; no token of
zero weight is drawn, the logits stay as they are, and a seeded row draws the same token alone
and in any batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from convoy.sampling_params import SamplingParams
from convoy.worker import sampler
from convoy.worker.batch import SamplerRow
from convoy.worker.sampler import sample

V = 2500  # two whole search chunks of 1024 and a remainder
DRAWS = 4000


@pytest.fixture(params=["cpu", "device"])
def both_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test runs on the CPU's paths, then on the other devices' ones."""
    monkeypatch.setattr(sampler, "CPU_PATHS", request.param == "cpu")


def _rows(
    params: SamplingParams, n: int, seed: int | None = None, bitmask: np.ndarray | None = None
) -> list[SamplerRow]:
    return [SamplerRow(params, seed, [1], [], [0], False, bitmask) for _ in range(n)]


def _expected(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution the parameters define, in float64, by sorting the whole vocabulary."""
    x = logits.double() / p.temperature
    keep = torch.isfinite(x)
    if p.top_k > 0:
        keep &= x >= x.sort(descending=True).values[p.top_k - 1]
    probs = torch.softmax(x.masked_fill(~keep, float("-inf")), -1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs
        nucleus = torch.zeros_like(keep)
        nucleus[order[before < p.top_p]] = True
        keep &= nucleus
    probs = probs.masked_fill(~keep, 0.0)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def _drawn(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return _frequencies(_sampled(logits, _rows(params, DRAWS)))


def _sampled(logits: torch.Tensor, rows: list[SamplerRow]) -> list[int]:
    """The tokens `rows` draw from copies of one row of logits."""
    torch.manual_seed(1234)
    batch = logits.expand(len(rows), V).contiguous()
    before = batch.clone()
    tokens = sample(batch, rows).token_ids
    assert torch.equal(batch, before)  # the raw logits stay as they were (logprobs read them)
    return tokens


def _frequencies(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=V).double() / len(tokens)


def _logits(scale: float, seed: int) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * scale


def _tied_at_the_fifth() -> torch.Tensor:
    x = _logits(1.0, 5)
    top = x.sort(descending=True).indices
    x[top[:4]] = torch.tensor([6.0, 5.5, 5.0, 4.5])
    x[top[4:7]] = 4.0  # the 5th, 6th and 7th highest are equal: top_k=5 keeps all three
    return x


def _underflowing_at_the_kth() -> torch.Tensor:
    """At temperature 0.05 the weights exp(l / T - max) of all but the top four tokens underflow
    to 0 in float32 ((10 - 4) / 0.05 = 120 > 104): top_k=20's k-th weight is 0."""
    x = _logits(1.0, 8)
    x[x.sort(descending=True).indices[:4]] = torch.tensor([10.0, 9.95, 9.9, 9.85])
    return x


def _weights(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The CPU sampler's weights of a row."""
    x = logits / temperature
    return (x - x.max()).exp()


CASES = {
    "temperature": (_logits(3.0, 1), SamplingParams(temperature=0.7)),
    "top_k with ties": (_tied_at_the_fifth(), SamplingParams(temperature=1.0, top_k=5)),
    "top_k at a low temperature": (
        _underflowing_at_the_kth(),
        SamplingParams(temperature=0.05, top_k=20),
    ),
    "top_p within the candidates": (_logits(4.0, 2), SamplingParams(temperature=0.8, top_p=0.8)),
    "top_p past the candidates": (_logits(0.5, 3), SamplingParams(temperature=1.0, top_p=0.95)),
    "min_p": (_logits(3.0, 4), SamplingParams(temperature=1.0, min_p=0.2)),
    "all three": (
        _logits(2.0, 6),
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05),
    ),
}


@pytest.mark.usefixtures("both_paths")
@pytest.mark.parametrize("case", CASES)
def test_draws_follow_the_filtered_softmax(case: str) -> None:
    logits, params = CASES[case]
    want = _expected(logits, params)
    got = _drawn(logits, params)
    assert (got[want == 0] == 0).all(), "drew a token the filters drop"
    _assert_same_mass_by_rank(got, want)


def _assert_same_mass_by_rank(got: torch.Tensor, want: torch.Tensor) -> None:
    """Tokens by expected probability, highest first, cut into ~10 bins of equal expected mass:
    each bin's drawn share is within 5 standard deviations of its expected share."""
    order = want.sort(descending=True).indices
    edges = torch.bucketize(want[order].cumsum(0), torch.linspace(0.1, 0.9, 9, dtype=want.dtype))
    for b in edges.unique():
        m = want[order[edges == b]].sum().item()
        seen = got[order[edges == b]].sum().item()
        assert abs(seen - m) <= 5 * (m * (1 - m) / DRAWS) ** 0.5 + 1e-9, (b.item(), seen, m)


def _bitmask(allowed: list[int]) -> np.ndarray:
    bits = np.zeros(-(-V // 32) * 32, dtype=np.uint8)  # whole int32 words: V = 2500 needs 79
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


@pytest.mark.usefixtures("both_paths")
def test_a_constrained_row_draws_from_the_softmax_over_its_allowed_tokens() -> None:
    """Each constrained row is masked on its own: one whose grammar allows only the stop token
    min_tokens bans is redone with the grammar's mask alone, an unconstrained row keeps the
    model's favourite, which the others' grammar forbids."""
    logits = _logits(2.0, 9)
    favourite = int(logits.argmax())
    allowed = sorted({0, 5, 31, 32, 1023, 1024, 2047, 2048, 2499} - {favourite})
    params = SamplingParams(temperature=1.0)
    stop = 1234
    dead = SamplerRow(SamplingParams(temperature=1.0, min_tokens=4), None, [1], [], [stop], False)
    dead.bitmask = _bitmask([stop])
    free = SamplerRow(SamplingParams(temperature=0.0), None, [1], [], [0], False)
    tokens = _sampled(logits, [dead, free, *_rows(params, DRAWS, bitmask=_bitmask(allowed))])
    assert tokens[:2] == [stop, favourite]
    got = _frequencies(tokens[2:])
    assert set(got.nonzero()[:, 0].tolist()) <= set(allowed)
    masked = torch.full((V,), float("-inf"))
    masked[allowed] = logits[allowed]
    _assert_same_mass_by_rank(got, _expected(masked, params))


def test_the_nucleus_past_the_candidates_is_searched_beyond_them() -> None:
    logits, params = CASES["top_p past the candidates"]
    assert int((_expected(logits, params) > 0).sum()) > sampler._CANDIDATES


def test_top_k_keeps_ties_at_the_kth_weight_only_when_it_is_not_zero() -> None:
    """A weight of 0 is never drawn: the tokens tied at a k-th weight of 0 (all but four of the
    vocabulary here) are not candidates, ties of a non-zero weight still are."""
    logits, params = CASES["top_k at a low temperature"]
    w = _weights(logits, params.temperature)
    assert int((w > 0).sum()) == 4  # the k-th weight underflowed, every other one ties with it
    vals, ids = sampler._top_k(w, params.top_k)
    assert len(ids) == params.top_k and set(ids[:4].tolist()) == set(w.nonzero()[:, 0].tolist())
    assert len(sampler._top_k(_weights(_tied_at_the_fifth(), 1.0), 5)[1]) == 7


@pytest.mark.usefixtures("both_paths")
def test_zero_weight_tokens_are_never_drawn_in_any_chunk() -> None:
    x = torch.full((V,), float("-inf"))
    finite = torch.tensor([3, 1023, 1024, 2047, 2048, 2499])  # chunk edges and the remainder
    x[finite] = torch.tensor([0.0, 1.0, -1.0, 0.5, 2.0, -0.5])
    params = SamplingParams(temperature=1.0)
    got = _drawn(x, params)
    assert set(torch.nonzero(got).squeeze(1).tolist()) == set(finite.tolist())
    _assert_same_mass_by_rank(got, _expected(x, params))


@pytest.mark.usefixtures("both_paths")
def test_a_seeded_row_draws_the_same_token_alone_and_in_a_batch() -> None:
    logits = _logits(1.0, 7).expand(6, V).contiguous()
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)):
        mixed = [*_rows(params, 2), *_rows(params, 1, seed=42), *_rows(params, 3)]
        alone = sample(logits[:1], _rows(params, 1, seed=42)).token_ids
        for _ in range(3):
            assert sample(logits, mixed).token_ids[2] == alone[0]
        later = SamplerRow(params, 42, [1], [9] * 5, [0], False)  # another output position
        draws = {sample(logits[:1], [later]).token_ids[0] for _ in range(2)}
        assert len(draws) == 1  # its own stream, seeded by (seed, position)


@pytest.mark.usefixtures("both_paths")
def test_nan_logits_still_give_a_token_id() -> None:
    x = torch.full((2, V), float("nan"))
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)):
        for token in sample(x, _rows(params, 2)).token_ids:
            assert 0 <= token < V
