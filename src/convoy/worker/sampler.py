"""Batched sampling: logit bias, min_tokens, penalties, greedy / temperature / top-k / top-p / min-p,
per-sequence seeds, and logprobs of the raw distribution.

A seeded sequence draws from its own generator, seeded from (seed, output position): its tokens
do not depend on what else is in the batch, nor on whether it was preempted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from convoy.outputs import PositionLogprobs
from convoy.worker.batch import SamplerRow

_MASK64 = (1 << 63) - 1


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]  # per row, when params.logprobs is set
    sampled_logprobs: list[float | None]  # per row, when need_logprob


def sample(logits: torch.Tensor, rows: list[SamplerRow]) -> SamplerOutput:
    """logits: (N, V) fp32 raw model logits, one row per sequence that samples."""
    raw = logits
    if any(_has_processors(r) for r in rows):
        logits = _apply_processors(logits.clone(), rows)
    tokens = torch.empty(len(rows), dtype=torch.long)
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    if len(greedy) == len(rows):  # all greedy: no (N, V) gather copy
        tokens = argmax_rows(logits)
    elif greedy:
        tokens[greedy] = argmax_rows(logits[greedy])
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        tokens[random_rows] = _sample_random(logits[random_rows], [rows[i] for i in random_rows])
    token_ids = tokens.tolist()
    logprobs: list[PositionLogprobs | None] = [None] * len(rows)
    sampled: list[float | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.need_logprob or r.params.logprobs is not None]
    if want:
        lp = torch.log_softmax(raw[want], dim=-1)
        for j, i in enumerate(want):
            k = rows[i].params.logprobs
            entry = position_logprobs(lp[j], token_ids[i], k or 0)
            sampled[i] = entry[token_ids[i]]
            if k is not None:
                logprobs[i] = entry
    return SamplerOutput(token_ids, logprobs, sampled)


_ARGMAX_CHUNK = 1024


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` of an (N, V) tensor, the same indices (the first maximum; NaN counts as the
    maximum), ~6x faster on the CPU for a large vocabulary: torch's last-dim argmax is not
    vectorized (measured 13.8 vs 2.3 ms for 64 x 262144 fp32), its amax is. The maximum of each
    chunk of 1024, the first chunk holding the row's maximum, then the argmax inside it."""
    n, v = x.shape
    if v % _ARGMAX_CHUNK or x.device.type != "cpu" or not x.is_contiguous():
        return x.argmax(-1)
    chunks = x.view(n, v // _ARGMAX_CHUNK, _ARGMAX_CHUNK)
    best = chunks.amax(-1).argmax(-1)  # (N,) the first chunk with the maximum
    inside = chunks[torch.arange(n), best].argmax(-1)
    return best * _ARGMAX_CHUNK + inside


def position_logprobs(lp: torch.Tensor, token_id: int, k: int) -> PositionLogprobs:
    """Top-k of one position's logprobs (descending), then `token_id` if not among them."""
    entry: PositionLogprobs = {}
    if k > 0:
        values, ids = lp.topk(k)
        entry = dict(zip(ids.tolist(), values.tolist(), strict=True))
    if token_id not in entry:
        entry[token_id] = float(lp[token_id])
    return entry


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[PositionLogprobs]:
    """Logprobs of each target token under the logits of the position before it."""
    lp = torch.log_softmax(logits, dim=-1)
    return [position_logprobs(lp[i], t, k) for i, t in enumerate(targets)]


def _has_processors(r: SamplerRow) -> bool:
    p = r.params
    return bool(
        p.logit_bias
        or (len(r.output_token_ids) < p.min_tokens and r.stop_ids)
        or p.repetition_penalty != 1.0
        or ((p.presence_penalty or p.frequency_penalty) and r.output_token_ids)
    )


def _apply_processors(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    for i, r in enumerate(rows):
        p = r.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
        if len(r.output_token_ids) < p.min_tokens and r.stop_ids:
            logits[i, r.stop_ids] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)))
            vals = logits[i, seen]
            logits[i, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
            counts = torch.bincount(torch.tensor(r.output_token_ids), minlength=logits.shape[1]).to(
                logits.dtype
            )
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
                logits.dtype
            )
    return logits


def _sample_random(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype).unsqueeze(1)
    logits = logits / temps
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
            gen = torch.Generator().manual_seed(hash((r.seed, len(r.output_token_ids))) & _MASK64)
            noise[i].exponential_(generator=gen)
    return argmax_rows(probs / noise)


def _top_p_(row: torch.Tensor, top_p: float) -> None:
    """Keep the smallest set of highest tokens whose probability reaches top_p (in place)."""
    sorted_logits, order = row.sort(descending=True)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    drop = (
        cum - torch.softmax(sorted_logits, dim=-1) >= top_p
    )  # mass before this token already >= p
    row[order[drop]] = float("-inf")
