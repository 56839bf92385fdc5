"""Folding a step's sampled tokens into a sequence: its tokens, logprobs and constraint state,
and whether it ends (EOS, a stop token id, its grammar, max_tokens or the context). No torch."""

from __future__ import annotations

from convoy.engine.request import Request
from convoy.outputs import FinishReason, PositionLogprobs
from convoy.worker.batch import ModelRunnerOutput


def append_tokens(
    req: Request, token_ids: list[int], runner_out: ModelRunnerOutput, max_model_len: int
) -> int:
    """Append a step's kept tokens in order, up to the first that ends the sequence; returns
    how many were appended."""
    lps = runner_out.sampled_logprobs.get(req.req_id)
    entries = runner_out.logprobs.get(req.req_id)
    req.num_step_tokens = 0
    for j, token_id in enumerate(token_ids):
        req.num_step_tokens += 1
        lp = None if lps is None else lps[j]
        _append_token(req, token_id, lp, None if entries is None else entries[j], max_model_len)
        if req.finish_reason is not None:
            break
    return req.num_step_tokens


def _append_token(
    req: Request,
    token_id: int,
    lp: float | None,
    entry: PositionLogprobs | None,
    max_model_len: int,
) -> None:
    req.token_ids.append(token_id)
    if lp is not None:
        req.cumulative_logprob += lp
    if entry is not None:
        req.logprobs.append(entry)
    if req.grammar is not None and _grammar_ends(req, token_id):
        return
    p = req.params
    num_out = req.num_output_tokens
    if num_out >= p.min_tokens:
        if not p.ignore_eos and token_id in req.eos_token_ids:
            req.finish_reason = FinishReason.STOP
        elif token_id in p.stop_token_ids:
            req.finish_reason, req.stop_reason = FinishReason.STOP, token_id
    if req.finish_reason is None and (
        (p.max_tokens is not None and num_out >= p.max_tokens) or req.num_tokens >= max_model_len
    ):
        req.finish_reason = FinishReason.LENGTH


def _grammar_ends(req: Request, token_id: int) -> bool:
    """Advance a constrained sequence's matcher by its new token. A grammar that has fully
    matched ends the sequence with stop (even under min_tokens or ignore_eos: the constraint
    wins); a matcher that fails ends it with abort and `req.error` (the caller reports it)."""
    assert req.grammar is not None
    if not req.grammar.accept(token_id):
        req.finish_reason, req.error = FinishReason.ABORT, req.grammar.error()
    elif req.grammar.is_finished:
        req.finish_reason = FinishReason.STOP
    return req.finish_reason is not None
