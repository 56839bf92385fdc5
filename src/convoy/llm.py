"""Offline batched generation: `LLM(model).generate(prompts, params)`, every prompt in one engine;
`LLM(model).embed(prompts)` for embeddings."""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace
from pathlib import Path

import numpy as np
import numpy.typing as npt

from convoy.config import EngineConfig
from convoy.engine.core import EngineCore
from convoy.engine.frontend import EngineFrontend
from convoy.engine.request import EngineRequest
from convoy.outputs import RequestOutput
from convoy.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: object) -> None:
        """engine_kwargs: any EngineConfig setting by its flat name (dtype, device, block_size,
        kv_cache_memory, num_kv_blocks, enable_prefix_caching, max_num_seqs, ...); defaults as
        in convoy/config.py."""
        config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        self.core = EngineCore(config)
        self.frontend = EngineFrontend(self.core)
        self.tokenizer = self.core.tokenizer
        self.model_path: Path = self.core.worker.model_path
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
        requests = [self._process(prompt, p) for prompt, p in zip(prompts, param_list, strict=True)]
        results: dict[int, RequestOutput] = {}
        for i, request in enumerate(requests):  # every prompt passed the checks: queue them all
            self.frontend.add(request, functools.partial(results.__setitem__, i))
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="Generating", unit="prompt")
        while self.frontend.has_work():
            done = len(results)
            self.frontend.step()
            if bar is not None:
                bar.update(len(results) - done)
        if bar is not None:
            bar.close()
        return [results[i] for i in range(len(prompts))]

    def embed(self, prompts: str | list[str] | list[list[int]]) -> list[npt.NDArray[np.float32]]:
        """Each prompt's embedding (its final hidden states pooled as the engine's `pooling`
        setting says, L2-normalised), every prompt in the same steps; in input order."""
        params = SamplingParams(max_tokens=0, pooling=self.core.pooling)
        outputs = self.generate(prompts, params)
        return [out.embedding for out in outputs if out.embedding is not None]

    def _process(self, prompt: str | list[int], params: SamplingParams) -> EngineRequest:
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        return self.frontend.inputs.process(token_ids, params, f"offline-{next(self._ids)}", text)
