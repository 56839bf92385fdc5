"""The worker's view of a scheduled sequence (`ScheduledSeq`): the tokens it computes this step,
where they go in its block table, and the sampling rows of the positions that sample (a draft's
positions included), or the pooling / prompt scoring it asks for. No torch here."""

from __future__ import annotations

from convoy.engine.request import Request
from convoy.sampling_params import Pooling
from convoy.worker.batch import PromptScoring, SamplerRow, ScheduledSeq


def scheduled_seq(req: Request, num_new: int) -> ScheduledSeq:
    """The worker's view of one scheduled sequence; a draft's tokens follow the sequence's
    own, each with the sampling row that plain decoding would use at its position."""
    start = req.num_computed_tokens
    draft = req.draft
    num_own = num_new - len(draft)
    seq = ScheduledSeq(
        req.req_id, req.token_ids[start : start + num_own] + draft, start, req.block_table
    )
    seq.prompt_len = req.num_prompt_tokens
    seq.scoring = _scoring(req, start, num_own)
    is_last = start + num_own == req.num_tokens
    if req.params.pooling is not None:  # an embedding: pools, never samples
        if is_last or req.params.pooling is Pooling.MEAN:
            seq.pooling = req.params.pooling
        return seq
    if is_last:
        p = req.params
        stop_ids = [] if p.ignore_eos else sorted(req.eos_token_ids)
        output = req.output_token_ids
        seq.sampling, *seq.draft_rows = (
            SamplerRow(
                p,
                req.seed,
                req.prompt_token_ids,
                output + draft[:i],
                stop_ids + p.stop_token_ids,
                need_logprob=p.num_seqs > p.n,
            )  # fmt: skip
            for i in range(len(draft) + 1)
        )
        seq.draft = draft
    return seq


def _scoring(req: Request, start: int, num_new: int) -> PromptScoring | None:
    """Prompt logprobs this chunk must produce (position i predicts token i + 1); after a
    preemption, positions already scored are not scored again."""
    k = req.params.prompt_logprobs
    first = max(start + 1, len(req.prompt_logprobs) or 1)
    end = min(start + num_new + 1, req.num_prompt_tokens)
    if k is None or not req.wants_prompt_logprobs or first >= end:
        return None
    return PromptScoring(first, req.token_ids[first:end], k)
