"""Offline batched generation: `LLM(model).generate(prompts, params)`, every prompt in one engine."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from convoy.config import CacheConfig, EngineConfig, SchedulerConfig
from convoy.engine.core import EngineCore
from convoy.engine.fanout import FanOut
from convoy.outputs import RequestOutput
from convoy.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        *,
        kv_cache_memory: int = 2 << 30,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        prepack_linears: bool = True,
        cpu_kernels: bool = True,
    ) -> None:
        config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            cache=CacheConfig(block_size, kv_cache_memory, num_kv_blocks, enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len),
            prepack_linears=prepack_linears,
            cpu_kernels=cpu_kernels,
        )
        self.engine = EngineCore(config)
        self.tokenizer = self.engine.tokenizer
        self.model_path: Path = self.engine.worker.model_path
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt together; results come back in input order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        param_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        results: dict[int, RequestOutput] = {}
        for i, (prompt, p) in enumerate(zip(prompts, param_list, strict=True)):
            self._add(i, prompt, p, results)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="Generating", unit="prompt")
        while self.engine.has_work():
            done = len(results)
            self.engine.step()
            if bar is not None:
                bar.update(len(results) - done)
        if bar is not None:
            bar.close()
        return [results[i] for i in range(len(prompts))]

    def _add(
        self,
        index: int,
        prompt: str | list[int],
        params: SamplingParams,
        results: dict[int, RequestOutput],
    ) -> None:
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.engine.validate(token_ids, params)
        params = _final_only(params)
        req_id = f"offline-{next(self._ids)}"

        def emit(out: RequestOutput) -> None:
            results[index] = out

        self.engine.add_fanout(
            FanOut(req_id, text, token_ids, params, req_id, time.monotonic(), emit)
        )


def _final_only(params: SamplingParams) -> SamplingParams:
    from dataclasses import replace

    return replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
