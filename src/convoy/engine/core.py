"""EngineCore: the synchronous engine. `step()` is schedule -> run -> sample -> process outputs."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from convoy.config import EngineConfig
from convoy.engine.block_manager import BlockManager
from convoy.engine.fanout import FanOut
from convoy.engine.output_processor import OutputProcessor, SeqDelta
from convoy.engine.request import Request, RequestStatus
from convoy.engine.scheduler import Scheduler, SchedulerOutput
from convoy.engine.tokenizer import Tokenizer
from convoy.outputs import FinishReason
from convoy.sampling_params import SamplingParams, SamplingParamsError
from convoy.worker.model_runner import ScheduledSeq
from convoy.worker.sampler import SamplerRow
from convoy.worker.worker import PromptScoring, Worker, WorkerOutput

if TYPE_CHECKING:
    from convoy.engine.async_engine import EngineStats

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.worker = Worker(config)
        self.model_name: str = self.worker.model_name
        model_cfg = self.worker.model_config
        self.tokenizer = Tokenizer(self.worker.model_dir, model_cfg.model_type)
        self.vocab_size = model_cfg.vocab_size
        self.block_manager = BlockManager(
            self.worker.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        # NOTE: one sequence must always fit in the pool, or preempting it could never help.
        self.max_model_len = min(
            config.scheduler.max_model_len or model_cfg.max_position_embeddings,
            model_cfg.max_position_embeddings,
            self.worker.num_blocks * config.cache.block_size,
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.eos_token_ids = self._eos_ids()
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.fanout_of: dict[str, FanOut] = {}  # child req_id -> its fan-out
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_computed_tokens = 0  # tokens run through the model (prompts, chunks, decodes)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise SamplingParamsError("the prompt must contain at least one token", "prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise SamplingParamsError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens and at least one must be left to generate",
                "prompt",
            )
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise SamplingParamsError(f"token ids must be in [0, {self.vocab_size})", "prompt")
        checks = (
            ("logit_bias", list(params.logit_bias or {})),
            ("stop_token_ids", params.stop_token_ids),
        )
        for param, token_ids in checks:
            for token_id in token_ids:
                if not 0 <= token_id < self.vocab_size:
                    raise SamplingParamsError(
                        f"token id {token_id} is outside the vocabulary", param
                    )

    def add_fanout(self, fanout: FanOut) -> None:
        for req in fanout.make_children():
            self.requests[req.req_id] = req
            self.fanout_of[req.req_id] = fanout
            self.output.add(req)
            self.scheduler.add_request(req)
        self.num_prompt_tokens += len(fanout.prompt_token_ids)

    def abort_fanout(self, fanout: FanOut, emit: bool = True) -> None:
        deltas = []
        for req in fanout.children:
            if req.finish_reason is None:
                req.finish_reason = FinishReason.ABORT
                deltas.append(self.output.delta(req))
            self._release(req)
        if emit and deltas:
            fanout.update(deltas)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[str]:
        """Run one step; returns the ids of the fan-outs (API prompts) that finished in it."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        self.num_computed_tokens += sched.num_batched_tokens
        seqs, rows, scoring = self._prepare(sched)
        result = self.worker.execute(seqs, rows, scoring)
        return self._process(sched, result)

    def stats(self) -> EngineStats:
        from convoy.engine.async_engine import EngineStats

        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_used=self.block_manager.num_used_blocks,
            num_kv_blocks_total=self.block_manager.num_blocks,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def _prepare(
        self, sched: SchedulerOutput
    ) -> tuple[list[ScheduledSeq], list[SamplerRow], list[PromptScoring | None]]:
        seqs: list[ScheduledSeq] = []
        rows: list[SamplerRow] = []
        scoring: list[PromptScoring | None] = []
        for req, num_new in sched.scheduled:
            start = req.num_computed_tokens
            samples = start + num_new == req.num_tokens
            score = self._scoring(req, start, num_new)
            seqs.append(
                ScheduledSeq(
                    req.token_ids[start : start + num_new], start, req.block_table, samples,
                    prompt_logits_from=None if score is None else score.first - 1 - start,
                )
            )  # fmt: skip
            scoring.append(score)
            if samples:
                p = req.params
                stop_ids = [] if p.ignore_eos else sorted(self.eos_token_ids)
                rows.append(
                    SamplerRow(
                        p, req.seed, req.prompt_token_ids, req.output_token_ids,
                        stop_ids + p.stop_token_ids, need_logprob=p.num_seqs > p.n,
                    )
                )  # fmt: skip
        return seqs, rows, scoring

    @staticmethod
    def _scoring(req: Request, start: int, num_new: int) -> PromptScoring | None:
        """Prompt logprobs this chunk must produce (position i predicts token i + 1); after a
        preemption, positions already scored are not scored again."""
        k = req.params.prompt_logprobs
        first = max(start + 1, len(req.prompt_logprobs) or 1)
        end = min(start + num_new + 1, req.num_prompt_tokens)
        if k is None or first >= end:
            return None
        return PromptScoring(first, req.token_ids[first:end], k)

    def _process(self, sched: SchedulerOutput, result: WorkerOutput) -> list[str]:
        now = time.monotonic()
        touched: dict[int, tuple[FanOut, list[SeqDelta]]] = {}
        rows = iter(result.sampled)
        for (req, num_new), scored in zip(sched.scheduled, result.prompt_logprobs, strict=True):
            if scored is not None:
                if not req.prompt_logprobs:
                    req.prompt_logprobs.append(None)  # nothing predicts the first prompt token
                req.prompt_logprobs.extend(scored)
            req.num_computed_tokens += num_new
            self.block_manager.cache_computed(req)
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk that does not reach the end of the prompt
            token_id, token_lp, position_lp = next(rows)
            if req.params.max_tokens != 0:
                if token_lp is not None:
                    req.cumulative_logprob += token_lp
                if position_lp is not None:
                    req.logprobs.append(position_lp)
            if req.first_token_time is None:
                req.first_token_time = now
            if req.params.max_tokens == 0:  # scoring only: the prompt is computed, nothing sampled
                req.finish_reason = FinishReason.LENGTH
            else:
                self.output.append_token(req, token_id)
                self.num_generation_tokens += 1
            fanout = self.fanout_of[req.req_id]
            touched.setdefault(id(fanout), (fanout, []))[1].append(self.output.delta(req))
        finished: list[str] = []
        for fanout, deltas in touched.values():
            for d in deltas:
                if d.finished:
                    self._release(d.req)
            fanout.update(deltas)
            if fanout.finished:
                finished.append(fanout.request_id)
        return finished

    def _release(self, req: Request) -> None:
        if req.status != RequestStatus.FINISHED:
            self.scheduler.finish(req)
        self.output.remove(req)
        self.requests.pop(req.req_id, None)
        self.fanout_of.pop(req.req_id, None)

    def _eos_ids(self) -> set[int]:
        ids = set(self.worker.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        if self.worker.model_config.model_type.startswith("gemma"):
            end_of_turn = self.tokenizer.encode("<end_of_turn>", add_special_tokens=False)
            if len(end_of_turn) == 1:
                ids.add(end_of_turn[0])
        return ids
