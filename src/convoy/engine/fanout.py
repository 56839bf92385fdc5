"""One prompt with `n` / `best_of` samples: child sequences in the engine, one RequestOutput out.

Children are `{request_id}#{j}`. A seeded request gives child 0 its seed and child j a seed derived
from (seed, j), so each child's text is reproducible alone and in any batch. With best_of > n, the
n children with the highest cumulative logprob are returned, best first, when all have finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from convoy.engine.output_processor import SeqDelta
from convoy.engine.request import Request
from convoy.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from convoy.sampling_params import RequestOutputKind, SamplingParams

_MASK63 = (1 << 63) - 1


def child_seed(seed: int | None, index: int) -> int | None:
    if seed is None or index == 0:
        return seed
    return hash((seed, index)) & _MASK63


@dataclass(slots=True, eq=False)
class FanOut:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    group_id: str
    arrival: float
    emit: Callable[[RequestOutput], object]  # called from the engine thread
    children: list[Request] = field(default_factory=list)
    outputs: list[CompletionOutput] = field(default_factory=list)
    sent_prompt_logprobs: bool = False

    def make_children(self) -> list[Request]:
        self.children = [
            Request(
                req_id=f"{self.request_id}#{j}",
                prompt_token_ids=self.prompt_token_ids,
                params=self.params,
                group_id=self.group_id,
                arrival=self.arrival,
                seed=child_seed(self.params.seed, j),
            )
            for j in range(self.params.num_seqs)
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
        kind = self.params.output_kind
        changed: list[CompletionOutput] = []
        for d in deltas:
            out = self.outputs[int(d.req.req_id.rsplit("#", 1)[1])]
            out.text += d.text
            out.token_ids.extend(d.token_ids)
            if d.logprobs is not None:
                out.logprobs = (out.logprobs or []) + d.logprobs
            out.cumulative_logprob = d.req.cumulative_logprob
            out.finish_reason, out.stop_reason = d.req.finish_reason, d.req.stop_reason
            changed.append(_delta_output(out, d) if kind == RequestOutputKind.DELTA else out)
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
        n = self.params.n
        if len(self.outputs) == n:
            return self.outputs
        ranked = sorted(self.outputs, key=lambda o: o.cumulative_logprob or 0.0, reverse=True)[:n]
        return [_reindexed(o, j) for j, o in enumerate(ranked)]

    def _request_output(self, outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
        prompt_lp: list[PositionLogprobs | None] | None = None
        if self.params.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            prompt_lp = self.children[0].prompt_logprobs
            self.sent_prompt_logprobs = True
        first = [c.first_token_time for c in self.children if c.first_token_time is not None]
        metrics = {"arrival": self.arrival}
        if first:
            metrics["first_token"] = min(first)
        if finished:
            metrics["finished"] = time.monotonic()
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_lp,
            num_cached_tokens=self.children[0].num_cached_tokens,
            metrics=metrics,
        )


def _delta_output(out: CompletionOutput, d: SeqDelta) -> CompletionOutput:
    return CompletionOutput(
        index=out.index,
        text=d.text,
        token_ids=list(d.token_ids),
        cumulative_logprob=out.cumulative_logprob,
        logprobs=d.logprobs,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
    )


def _reindexed(o: CompletionOutput, index: int) -> CompletionOutput:
    return CompletionOutput(
        index, o.text, o.token_ids, o.cumulative_logprob, o.logprobs, o.finish_reason, o.stop_reason
    )
