"""Batched sampling: logit bias, min_tokens, penalties, grammar bitmasks (structured outputs),
greedy / temperature / top-k / top-p / min-p, per-sequence seeds, and logprobs of the raw
distribution; prompt logprobs in bounded slices. A batch with no processor and no constrained
row samples its logits as they are (no copy).

Every tensor lives on the logits' device (CPU or CUDA): nothing here assumes the CPU.

A seeded sequence draws from its own generator on that device, seeded from (seed, output
position): its tokens do not depend on what else is in the batch, nor on whether it was
preempted and recomputed. (The streams differ between a CPU and a CUDA generator: a seed is
reproducible on one kind of device.) Random rows are drawn by inverse CDF on the CPU (one draw
a row, `_sample_random_cpu`) and by an exponential race elsewhere (`_sample_random`): the same
distributions, different streams. `CPU_PATHS = False` runs the other devices' paths on CPU
tensors too (tests do: they have no GPU).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from convoy.outputs import PositionLogprobs
from convoy.sampling_params import SamplingParams
from convoy.worker.batch import SamplerRow

_MASK64 = (1 << 63) - 1
# fp32 logits materialised at once when scoring a prompt (and as much again for their
# log-softmax): 64 rows of Gemma's 262k vocabulary, not the whole chunk (2,048 x 262,144 x 4 B
# = 2 GiB, twice).
PROMPT_LOGITS_BYTES = 64 << 20
# CPU tensors take the CPU's own paths (inverse-CDF draws, numpy masking); False: the paths of
# every other device (the exponential race, masked_fill_), which tests run on CPU tensors.
CPU_PATHS = True


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]  # per row, when params.logprobs is set
    sampled_logprobs: list[float | None]  # per row, when need_logprob


def sample(logits: torch.Tensor, rows: list[SamplerRow]) -> SamplerOutput:
    """logits: (N, V) fp32 raw model logits, one row per sequence that samples."""
    raw = logits
    has_processors = any(_has_processors(r) for r in rows)
    constrained = [(i, r.bitmask) for i, r in enumerate(rows) if r.bitmask is not None]
    if has_processors or constrained:
        logits = logits.clone()
    if has_processors:
        _apply_processors(logits, rows)
    if constrained:
        _apply_bitmasks(logits, raw, constrained)
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if not random_rows:  # all greedy: no (N, V) gather copy
        tokens = argmax_rows(logits)
    else:
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if greedy:
            tokens[greedy] = argmax_rows(logits[greedy])
        chosen = [rows[i] for i in random_rows]
        if _is_cpu(logits):
            tokens[random_rows] = _sample_random_cpu(logits, random_rows, chosen)
        else:
            tokens[random_rows] = _sample_random(logits[random_rows], chosen)
    token_ids = tokens.tolist()
    logprobs: list[PositionLogprobs | None] = [None] * len(rows)
    sampled: list[float | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.need_logprob or r.params.logprobs is not None]
    if want:
        ks = [rows[i].params.logprobs or 0 for i in want]
        lp = torch.log_softmax(raw[want], dim=-1)
        entries = logprob_entries(lp, [token_ids[i] for i in want], ks)
        for i, entry in zip(want, entries, strict=True):
            sampled[i] = entry[token_ids[i]]
            if rows[i].params.logprobs is not None:
                logprobs[i] = entry
    return SamplerOutput(token_ids, logprobs, sampled)


def _is_cpu(t: torch.Tensor) -> bool:
    return CPU_PATHS and t.device.type == "cpu"


_ARGMAX_CHUNK = 1024


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` of an (N, V) tensor, the same indices (the first maximum; NaN counts as the
    maximum), ~6x faster on the CPU for a large vocabulary: torch's last-dim argmax is not
    vectorized (measured 13.8 vs 2.3 ms for 64 x 262144 fp32), its amax is. The maximum of each
    chunk of 1024, the first chunk holding the row's maximum, then the argmax inside it.
    Elsewhere (CUDA) torch's own argmax is used: it is a single fast reduction there."""
    n, v = x.shape
    if v % _ARGMAX_CHUNK or x.device.type != "cpu" or not x.is_contiguous():
        return x.argmax(-1)
    chunks = x.view(n, v // _ARGMAX_CHUNK, _ARGMAX_CHUNK)
    best = chunks.amax(-1).argmax(-1)  # (N,) the first chunk with the maximum
    inside = chunks[torch.arange(n, device=x.device), best].argmax(-1)
    return best * _ARGMAX_CHUNK + inside


def logprob_entries(
    lp: torch.Tensor, token_ids: list[int], ks: list[int]
) -> list[PositionLogprobs]:
    """Per row of `lp` (R, V) logprobs: its top-k_r (descending), then its token if not among
    them. One gather and one top-k for all rows (one device sync each, not one per row)."""
    chosen = lp.gather(1, torch.tensor(token_ids, device=lp.device).unsqueeze(1))[:, 0].tolist()
    k_max = max(ks, default=0)
    top_ids: list[list[int]] = [[] for _ in token_ids]
    top_values: list[list[float]] = [[] for _ in token_ids]
    if k_max > 0:
        values, ids = lp.topk(k_max, dim=-1)
        top_ids, top_values = ids.tolist(), values.tolist()
    entries: list[PositionLogprobs] = []
    for token_id, k, lp_token, ids_r, values_r in zip(
        token_ids, ks, chosen, top_ids, top_values, strict=True
    ):
        entry: PositionLogprobs = dict(zip(ids_r[:k], values_r[:k], strict=True))
        entry.setdefault(token_id, lp_token)
        entries.append(entry)
    return entries


def prompt_logprobs(
    hidden: torch.Tensor,
    targets: list[int],
    k: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
    max_logits_bytes: int = PROMPT_LOGITS_BYTES,
) -> list[PositionLogprobs]:
    """Logprobs of each target token under the logits of the position before it.

    `hidden` holds those positions' final hidden states, one row per target; their logits are
    computed a slice of rows at a time (at most `max_logits_bytes` of fp32 logits), so scoring a
    long prompt over a large vocabulary needs bounded memory. Each row's result does not depend
    on the slicing.
    """
    rows = max(1, max_logits_bytes // (vocab_size * 4))
    out: list[PositionLogprobs] = []
    for start in range(0, len(targets), rows):
        logprobs = torch.log_softmax(compute_logits(hidden[start : start + rows]), dim=-1)
        part = targets[start : start + rows]
        out.extend(logprob_entries(logprobs, part, [k] * len(part)))
    return out


def _has_processors(r: SamplerRow) -> bool:
    p = r.params
    return bool(
        p.logit_bias
        or (len(r.output_token_ids) < p.min_tokens and r.stop_ids)
        or p.repetition_penalty != 1.0
        or ((p.presence_penalty or p.frequency_penalty) and r.output_token_ids)
    )


def _apply_processors(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    dev, dtype = logits.device, logits.dtype
    for i, r in enumerate(rows):
        p = r.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=dtype, device=dev)
        if len(r.output_token_ids) < p.min_tokens and r.stop_ids:
            logits[i, torch.tensor(r.stop_ids, dtype=torch.long, device=dev)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen_ids = sorted(set(r.prompt_token_ids) | set(r.output_token_ids))
            seen = torch.tensor(seen_ids, dtype=torch.long, device=dev)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
            output_ids = torch.tensor(r.output_token_ids, dtype=torch.long, device=dev)
            counts = torch.bincount(output_ids, minlength=logits.shape[1]).to(dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(dtype)
    return logits


def _apply_bitmasks(
    logits: torch.Tensor, raw: torch.Tensor, constrained: list[tuple[int, npt.NDArray[np.int32]]]
) -> None:
    """In place, after the other processors: in each constrained row ((row, bitmask) pairs),
    every token its grammar forbids gets -inf. A row left with no finite logit (min_tokens,
    ignore_eos or logit_bias banned every token the grammar allows) is redone from its raw
    logits with the grammar's mask alone: the constraint wins. Elementwise per row, so the
    other rows are untouched (batch invariance)."""
    rows = [i for i, _ in constrained]
    words = np.stack([bitmask for _, bitmask in constrained])  # (C, W) int32
    # one byte per token, 1 = forbidden (a bit unset), viewed as bools: (C, V)
    bits = np.unpackbits((~words).view(np.uint8), axis=1, bitorder="little")
    forbidden = bits[:, : logits.shape[1]].view(np.bool_)
    dead = _mask_rows(logits, rows, forbidden)
    if dead:
        again = [rows[j] for j in dead]
        logits[again] = raw[again]
        _mask_rows(logits, again, forbidden[dead])


def _mask_rows(
    logits: torch.Tensor, rows: list[int], forbidden: npt.NDArray[np.bool_]
) -> list[int]:
    """logits[rows[j]] = -inf where forbidden[j], in place; returns the j whose row has no
    finite logit left."""
    if _is_cpu(logits):
        # NOTE: numpy, not masked_fill_: torch's CPU kernel with a bool mask was ~8x slower
        # (measured 23 vs 2.7 ms for 16 rows of Gemma's 262k logits).
        view = logits.numpy()
        for j, i in enumerate(rows):
            np.copyto(view[i], -np.inf, where=forbidden[j])
        return [j for j, i in enumerate(rows) if view[i].max() == -np.inf]
    mask = torch.from_numpy(forbidden).to(logits.device)
    for j, i in enumerate(rows):
        logits[i].masked_fill_(mask[j], float("-inf"))
    empty = logits[rows].amax(-1) == float("-inf")
    return [j for j, is_empty in enumerate(empty.tolist()) if is_empty]


def _sample_random(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    dev = logits.device
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=dev)
    logits = logits / temps.unsqueeze(1)
    for i, r in enumerate(rows):
        p = r.params
        if p.top_k > 0 and p.top_k < logits.shape[1]:
            kth = logits[i].topk(p.top_k).values[-1]
            logits[i].masked_fill_(logits[i] < kth, float("-inf"))
        if p.top_p < 1.0:
            _top_p_(logits[i], p.top_p)
    probs = torch.softmax(logits, dim=-1)
    for i, r in enumerate(rows):
        if r.params.min_p > 0:
            row = probs[i]
            row.masked_fill_(row < r.params.min_p * row.max(), 0.0)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
    noise = torch.empty_like(probs)
    for i, r in enumerate(rows):
        if r.seed is None:
            noise[i].exponential_()
        else:
            # a generator of the logits' device: a CPU one cannot fill a CUDA tensor
            gen = torch.Generator(device=dev)
            gen.manual_seed(hash((r.seed, len(r.output_token_ids))) & _MASK64)
            noise[i].exponential_(generator=gen)
    return argmax_rows(probs / noise)


# CPU sampling: top-k / top-p look for their tokens among this many of the highest first, and
# the inverse-CDF search sums chunks of this many weights before it walks one chunk.
_CANDIDATES = 1024
_CHUNK = 1024
_scratch_space = threading.local()  # each sampling thread's (rows x vocab) working buffer


def _scratch(n: int, v: int) -> torch.Tensor:
    buf: torch.Tensor | None = getattr(_scratch_space, "buf", None)
    # NOTE: a buffer made under inference mode cannot be written outside it (the engine samples
    # inside it; a caller of the sampler in the same thread may not)
    stale = buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled()
    if buf is None or stale or buf.numel() < n * v:
        buf = _scratch_space.buf = torch.empty(n * v)
    return buf[: n * v].view(n, v)


def _sample_random_cpu(
    logits: torch.Tensor, idx: list[int], rows: list[SamplerRow]
) -> torch.Tensor:
    """Rows `idx` of `logits` (left as they are), sampled on the CPU by inverse CDF: one uniform
    draw per row (from the row's own generator when seeded) against the cumulative weights
    exp(l / T - max) of the tokens that top-k, top-p and min-p keep.

    NOTE: the exponential race of `_sample_random` draws one random number per vocabulary entry;
    on the CPU that, the gather copy and four fresh (rows x vocab) tensors made a step's sampling
    at 64 rows of Gemma 3's 262144 logits cost 0.76 s (top-p: 2.9 s, a full sort per row). Here
    the weights are computed in place in a buffer this thread reuses, top-k and top-p look among
    the highest `_CANDIDATES` tokens (a full sort only when the nucleus reaches past them, or
    ties of non-zero weight straddle the k-th value), and the search walks chunk sums, then one
    chunk, in float64. Each row's token depends on its own logits, parameters and draw alone
    (batch invariance).
    """
    n, v = len(idx), logits.shape[1]
    w = _scratch(n, v)
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype).unsqueeze(1)
    if n == logits.shape[0]:
        torch.div(logits, temps, out=w)
    else:
        torch.index_select(logits, 0, torch.tensor(idx), out=w).div_(temps)
    w.sub_(w.amax(-1, keepdim=True)).exp_()  # unnormalised probabilities, the largest 1.0
    tokens = []
    for j, r in enumerate(rows):
        if r.seed is None:
            u = float(torch.rand((), dtype=torch.float64))
        else:
            gen = torch.Generator()
            gen.manual_seed(hash((r.seed, len(r.output_token_ids))) & _MASK64)
            u = float(torch.rand((), dtype=torch.float64, generator=gen))
        p, row = r.params, w[j]
        if 0 < p.top_k < v or p.top_p < 1.0:
            tokens.append(_sample_filtered(row, p.top_k if 0 < p.top_k < v else 0, p, u))
            continue
        if p.min_p > 0:
            row.masked_fill_(row < p.min_p, 0.0)  # p < min_p * p_max, and p_max is 1.0
        tokens.append(_inverse_cdf(row, u))
    return torch.tensor(tokens, dtype=torch.long)


def _sample_filtered(row: torch.Tensor, top_k: int, p: SamplingParams, u: float) -> int:
    """One token of `row` (weights) under top-k (0: none), then top-p over the kept tokens'
    renormalised probabilities, then min-p; `u` in [0, 1)."""
    v = row.shape[0]
    if top_k:
        vals, ids = _top_k(row, top_k)
        total = vals.sum(dtype=torch.float64)
    else:
        vals, ids = row.topk(min(_CANDIDATES, v))
        total = row.sum(dtype=torch.float64)
    keep = len(vals)
    if p.top_p < 1.0:
        keep = _nucleus(vals, total, p.top_p)
        if not top_k and keep == len(vals) < v:  # it may reach past the candidates
            vals, ids = _at_least_mass(row, float(vals[-1]), p.top_p * float(total))
            keep = _nucleus(vals, total, p.top_p)
    if p.min_p > 0:  # sorted: the kept tokens are a prefix
        keep = min(keep, int((vals[:keep] >= p.min_p * vals[0]).sum()))
    keep = max(keep, 1)  # the top token always stays (here even for NaN logits)
    c = vals[:keep].cumsum(0, dtype=torch.float64)
    at = int(torch.searchsorted(c, u * float(c[-1]), right=True))
    return int(ids[min(at, keep - 1)])


def _top_k(row: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k highest weights of `row`, descending, and their ids; ties at the k-th value are all
    kept, unless it is 0 (every weight that underflowed at a low temperature would tie, and the
    row be sorted whole): a token of weight 0 is never drawn."""
    vals, ids = row.topk(k)
    if vals[-1] > 0:
        tied = int((row >= vals[-1]).sum())
        if tied > k:
            vals, ids = row.topk(tied)
    return vals, ids


def _at_least_mass(
    row: torch.Tensor, below: float, mass: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights of `row` at or above the highest of below / 16, below / 256, ... whose sum
    reaches `mass`, sorted descending, with their ids (every weight, sorted, if none does): a set
    that holds the whole top-p nucleus, without sorting the vocabulary."""
    t = below
    for _ in range(8):
        t /= 16
        if float(torch.where(row >= t, row, 0.0).sum(dtype=torch.float64)) >= mass:
            ids = torch.nonzero(row >= t).squeeze(1)
            vals, order = row[ids].sort(descending=True)
            return vals, ids[order]
    return row.sort(descending=True)


def _nucleus(vals: torch.Tensor, total: torch.Tensor, top_p: float) -> int:
    """How many of `vals` (descending weights of a row whose weights sum to `total`) the top-p
    set keeps: each token whose predecessors' probability mass is below top_p."""
    probs = vals.double() / total
    return int(((probs.cumsum(0) - probs) < top_p).sum())


def _inverse_cdf(row: torch.Tensor, u: float) -> int:
    """The token at cumulative weight u * sum(row), u in [0, 1): never one of weight 0."""
    v = row.shape[0]
    full = v - v % _CHUNK
    sums = row[:full].view(-1, _CHUNK).sum(-1, dtype=torch.float64)
    if full < v:
        sums = torch.cat([sums, row[full:].sum(dtype=torch.float64).view(1)])
    csum = sums.cumsum(0)
    target = u * float(csum[-1])
    k = min(int(torch.searchsorted(csum, target, right=True)), len(sums) - 1)
    if float(sums[k]) == 0.0:  # rounding ran past the last chunk with weight
        k = int(torch.nonzero(sums).max())
    seg = row[k * _CHUNK : (k + 1) * _CHUNK]
    c = seg.cumsum(0, dtype=torch.float64)
    at = int(torch.searchsorted(c, target - (float(csum[k - 1]) if k else 0.0), right=True))
    if at >= len(seg):
        at = int(torch.nonzero(seg).max())
    return k * _CHUNK + at


def _top_p_(row: torch.Tensor, top_p: float) -> None:
    """Keep the smallest set of highest tokens whose probability reaches top_p (in place)."""
    sorted_logits, order = row.sort(descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = probs.cumsum(-1) - probs >= top_p  # mass before this token already >= p
    row[order[drop]] = float("-inf")
