"""One prompt with `n` / `best_of` samples: child sequences in the engine, one RequestOutput out.

The front end (AsyncEngine, LLM) expands a prompt here, in front of the engine core, which only
sees sequences. Child j is `{request_id}#{j}` with `index = j`. A seeded request gives child 0 its
seed and child j a seed derived from (seed, j), so each child's text is reproducible alone and in
any batch. With best_of > n, the n children with the highest mean logprob per generated token
(of the raw distribution, as the API reports logprobs) are returned, best first, when all have
finished; `num_generated_tokens` still counts every candidate (usage bills them all).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from convoy.engine.output_processor import SeqDelta
from convoy.engine.request import EngineRequest, Request
from convoy.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from convoy.sampling_params import RequestOutputKind

_MASK63 = (1 << 63) - 1


def child_seed(seed: int | None, index: int) -> int | None:
    if seed is None or index == 0:
        return seed
    return hash((seed, index)) & _MASK63


@dataclass(slots=True, eq=False)
class ParentRequest:
    request: EngineRequest
    emit: Callable[[RequestOutput], object]  # called from the engine thread
    children: list[Request] = field(default_factory=list)
    outputs: list[CompletionOutput] = field(default_factory=list)
    sent_prompt_logprobs: bool = False

    def make_children(self, eos_token_ids: frozenset[int]) -> list[Request]:
        r = self.request
        self.children = [
            Request(
                req_id=f"{r.request_id}#{j}",
                prompt_token_ids=r.prompt_token_ids,
                params=r.params,
                group_id=r.group_id,
                arrival=r.arrival,
                parent_id=r.request_id,
                index=j,
                seed=child_seed(r.params.seed, j),
                eos_token_ids=eos_token_ids,
                priority=r.priority,
                grammar=r.new_matcher(),
            )
            for j in range(r.params.num_seqs)
        ]
        self.outputs = [
            CompletionOutput(index=j, text="", token_ids=[]) for j in range(len(self.children))
        ]
        return self.children

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    def update(self, deltas: list[SeqDelta]) -> None:
        """Fold one step's child deltas in and emit per the output kind."""
        kind = self.request.params.output_kind
        changed: list[CompletionOutput] = []
        for d in deltas:
            out = self.outputs[d.req.index]
            out.text += d.text
            out.token_ids.extend(d.token_ids)
            if d.logprobs is not None:
                out.logprobs = (out.logprobs or []) + d.logprobs
            out.cumulative_logprob = d.req.cumulative_logprob
            out.finish_reason, out.stop_reason = d.req.finish_reason, d.req.stop_reason
            if kind == RequestOutputKind.DELTA:  # only what is new
                out = replace(out, text=d.text, token_ids=list(d.token_ids), logprobs=d.logprobs)
            changed.append(out)
        finished = self.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return
        if kind == RequestOutputKind.DELTA:
            if changed or finished:
                self.emit(self._request_output(sorted(changed, key=lambda o: o.index), finished))
            return
        self.emit(
            self._request_output(self._final_choices() if finished else self.outputs, finished)
        )

    def _final_choices(self) -> list[CompletionOutput]:
        n = self.request.params.n
        if len(self.outputs) == n:
            return self.outputs
        ranked = sorted(self.outputs, key=_mean_logprob, reverse=True)[:n]
        return [replace(o, index=j) for j, o in enumerate(ranked)]

    def _request_output(self, outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
        r = self.request
        prompt_lp: list[PositionLogprobs | None] | None = None
        if r.params.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            prompt_lp = self.children[0].prompt_logprobs
            self.sent_prompt_logprobs = True
        first = [c.first_token_time for c in self.children if c.first_token_time is not None]
        metrics = {"arrival": r.arrival}
        if first:
            metrics["first_token"] = min(first)
        if finished:
            metrics["finished"] = time.monotonic()
        drafters = [c.drafter for c in self.children if c.drafter is not None]
        return RequestOutput(
            request_id=r.request_id,
            prompt=r.prompt,
            prompt_token_ids=r.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_lp,
            num_cached_tokens=self.children[0].num_cached_tokens,
            num_generated_tokens=sum(c.num_output_tokens for c in self.children),
            num_accepted_prediction_tokens=sum(d.num_prediction_matched for d in drafters),
            num_rejected_prediction_tokens=sum(d.num_prediction_rejected for d in drafters),
            metrics=metrics,
            embedding=self.children[0].embedding,
        )


def _mean_logprob(o: CompletionOutput) -> float:
    """Rank of a best_of candidate: its mean logprob per generated token."""
    return (o.cumulative_logprob or 0.0) / max(len(o.token_ids), 1)
