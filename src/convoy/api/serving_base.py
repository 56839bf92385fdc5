"""What the completion and chat serving objects share: one request's path from a parsed body to
a response model, or to an async iterator of chunk models. No HTTP here.

    create(request) -> check model and fields -> prompts -> engine front door (all prompts,
    before any work) -> capacity -> EngineClient.generate -> collect() | stream()

Routes wrap the result (JSON or SSE); the Batch API calls `create` directly.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from convoy.api.engine_client import EngineClient, Prompt, new_id
from convoy.api.logprobs import TokenNames
from convoy.api.metrics import RequestRecord
from convoy.api.protocol import UsageInfo
from convoy.outputs import CompletionOutput, RequestOutput
from convoy.sampling_params import SamplingParams

Outputs = AsyncGenerator[tuple[int, RequestOutput], None]  # (prompt index, output)
RequestT = TypeVar("RequestT", bound=Any)
ResponseT = TypeVar("ResponseT", bound=BaseModel)
ChunkT = TypeVar("ChunkT", bound=BaseModel)


@dataclass(slots=True)
class Job(Generic[RequestT]):
    """One validated request, running."""

    api_id: str
    created: int
    request: RequestT
    prompts: list[Prompt]
    n: int
    record: RequestRecord
    names: TokenNames


class ServingBase(Generic[RequestT, ResponseT, ChunkT]):
    id_prefix = ""  # cmpl / chatcmpl
    prompt_param = ""  # the request field holding the prompt (named by 400s about it)
    chunk_type: type[ChunkT]

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def create(
        self, request: RequestT, record: RequestRecord | None = None
    ) -> ResponseT | AsyncGenerator[ChunkT, None]:
        """Check everything, then run every prompt in the engine at once.

        Returns the response, or (stream: true) the chunks; `[DONE]` framing is the caller's.
        """
        self.client.check_model(request.model)
        request.check()
        params: SamplingParams = request.to_sampling_params()
        prompts = self.prompts(request)
        api_id = new_id(self.id_prefix)
        engine_requests = self.client.process(api_id, prompts, params, self.prompt_param)
        self.client.check_capacity()
        record = record or RequestRecord(request_id=api_id)
        job = Job(
            api_id, int(time.time()), request, prompts, params.n, record,
            TokenNames(self.client.tokenizer),
        )  # fmt: skip
        record.api_id, record.num_prompts = api_id, len(prompts)
        record.num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        outputs = self.client.generate(engine_requests, record)
        if request.stream:
            return self.stream(job, outputs)
        return await self.collect(job, outputs)

    def prompts(self, request: RequestT) -> list[Prompt]:
        raise NotImplementedError

    async def collect(self, job: Job[RequestT], outputs: Outputs) -> ResponseT:
        raise NotImplementedError

    def stream(self, job: Job[RequestT], outputs: Outputs) -> AsyncGenerator[ChunkT, None]:
        raise NotImplementedError

    def usage(self, job: Job[RequestT], num_completion_tokens: int) -> UsageInfo:
        """Usage counts each prompt once and every generated token (best_of candidates too)."""
        job.record.num_completion_tokens = num_completion_tokens
        return UsageInfo.of(job.record.num_prompt_tokens, num_completion_tokens)

    def usage_chunk(self, job: Job[RequestT], num_completion_tokens: int) -> ChunkT | None:
        """The last chunk (`choices: []`) when stream_options.include_usage is set."""
        if not job.request.include_usage:
            return None
        return self.chunk(job, [], self.usage(job, num_completion_tokens))

    def chunk(
        self, job: Job[RequestT], choices: list[Any], usage: UsageInfo | None = None
    ) -> ChunkT:
        return self.chunk_type(
            id=job.api_id,
            created=job.created,
            model=self.client.served_model_name,
            choices=choices,
            usage=usage,
        )


def finish_reason(c: CompletionOutput) -> str | None:
    return None if c.finish_reason is None else str(c.finish_reason)


def is_empty_delta(c: CompletionOutput) -> bool:
    """Nothing new for this choice in this step."""
    return not c.text and not c.token_ids and c.finish_reason is None
