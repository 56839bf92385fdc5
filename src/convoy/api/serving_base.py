"""What the completion and chat serving objects share: one request's path from a parsed body to
a response model, or to an async iterator of chunk models. No HTTP here.

    create(request) -> check model and fields -> prompts -> engine front door (all prompts,
    before any work) -> capacity -> EngineClient.generate -> collect() | stream()

Routes wrap the result (JSON or SSE); the Batch API calls `create` directly. Tokenizing and the
front door's checks run in a worker thread for large requests (`off_loop`), and for every request
with an output constraint (the front door compiles it, or finds it in the compile cache).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import BaseModel

from convoy.api.engine_client import ClosingGenerator, EngineClient, Prompt, new_id
from convoy.api.logprobs import TokenNames
from convoy.api.metrics import RequestRecord
from convoy.api.protocol_common import UsageInfo
from convoy.engine.request import Priority
from convoy.outputs import CompletionOutput, RequestOutput
from convoy.sampling_params import MAX_PREDICTION_TOKENS, SamplingParams, SamplingParamsError

if TYPE_CHECKING:
    from convoy.engine.request import EngineRequest

Outputs = AsyncGenerator[tuple[int, RequestOutput], None]  # (prompt index, output)
RequestT = TypeVar("RequestT", bound=Any)
ResponseT = TypeVar("ResponseT", bound=BaseModel)
ChunkT = TypeVar("ChunkT", bound=BaseModel)
T = TypeVar("T")

# Request bodies up to this size are parsed and tokenized on the event loop: a thread hop costs
# more than the work. Larger ones (up to max_request_bytes, 32 MiB) go to a worker thread, since
# the event loop serves every stream and /health and seconds of tokenizing there stall them all.
OFF_LOOP_BYTES = 64 << 10


async def off_loop(size: int | None, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, in a worker thread unless `size` (bytes of the request body) is small."""
    if size is not None and size <= OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


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
    logprobs: int = 0  # the logprob entries its whole response could hold (0: streamed, none)


class ServingBase(Generic[RequestT, ResponseT, ChunkT]):
    id_prefix = ""  # cmpl / chatcmpl
    prompt_param = ""  # the request field holding the prompt (named by 400s about it)
    chunk_type: type[ChunkT]

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def create(
        self,
        request: RequestT,
        record: RequestRecord | None = None,
        body_size: int | None = None,
        *,
        priority: Priority = Priority.INTERACTIVE,
    ) -> ResponseT | AsyncGenerator[ChunkT, None]:
        """Check everything, then run every prompt in the engine at once.

        Returns the response, or (stream: true) the chunks; `[DONE]` framing is the caller's.
        `body_size`: the request's size in bytes, if known (unknown counts as large).
        `priority`: BATCH for Batch API lines (scheduled after interactive work, outside the
        queue bound).
        """
        job, engine_requests = await self.prepare(request, record, body_size, priority)
        return await self.run(job, engine_requests)

    async def prepare(
        self,
        request: RequestT,
        record: RequestRecord | None,
        body_size: int | None,
        priority: Priority = Priority.INTERACTIVE,
    ) -> tuple[Job[RequestT], list[EngineRequest]]:
        """Every check `create` makes (the 400s), before any work is queued: the job and its
        engine requests, for `run` now or later (a background response)."""
        self.client.engine.check_available()  # a dead engine: 503 now, not inside a 200 stream
        self.client.check_model(request.model)
        request.check()
        params = self.sampling_params(request)
        api_id = new_id(self.id_prefix)
        if params.structured_outputs is not None:
            body_size = None  # compiling a constraint is not cheap: a worker thread, any size
        prompts, engine_requests, logprobs = await off_loop(
            body_size, self._prepare, request, params, api_id, priority
        )
        record = record or RequestRecord(request_id=api_id)
        as_ids = bool(getattr(request, "return_tokens_as_token_ids", False))
        job = Job(
            api_id, int(time.time()), request, prompts, params.n, record,
            TokenNames(self.client.tokenizer, as_ids), logprobs,
        )  # fmt: skip
        record.api_id, record.num_prompts = api_id, len(prompts)
        if params.prediction is not None:
            record.num_accepted_prediction_tokens = record.num_rejected_prediction_tokens = 0
        record.num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        return job, engine_requests

    async def run(
        self, job: Job[RequestT], engine_requests: list[EngineRequest]
    ) -> ResponseT | AsyncGenerator[ChunkT, None]:
        """A prepared job in the engine: its response, or (stream: true) its chunks."""
        outputs = self.client.generate(engine_requests, job.record, job.logprobs)
        if job.request.stream:  # the caller owns (and must close) the chunks, and so the outputs
            return ClosingGenerator(self.stream(job, outputs), outputs.aclose)
        async with aclosing(outputs):
            return await self.collect(job, outputs)

    def _prepare(
        self, request: RequestT, params: SamplingParams, api_id: str, priority: Priority
    ) -> tuple[list[Prompt], list[EngineRequest], int]:
        """Tokenize (through the chat template) and pass the engine's front door: the heavy part.
        Also the logprob entries the whole response could hold (whole_logprobs)."""
        prompts = self.prompts(request)
        try:
            prediction = getattr(request, "prediction", None)
            if prediction is not None:
                params.prediction = self._prediction_tokens(prediction.text())
            self.adapt(params, prompts)
            if entries := self.whole_logprobs(request, params, prompts):
                self.client.check_logprobs(entries, self.logprobs_param(request, params))
            engine_requests = self.client.process(
                api_id, prompts, params, self.prompt_param, priority
            )
            return prompts, engine_requests, entries
        except BaseException:
            # NOTE: free rejected token ids here, one list at a time: the traceback would keep
            # them until the event loop drops the error, and freeing millions of ids in one go
            # holds the GIL (and stalls the loop) for a tenth of a second or more.
            for prompt in prompts:
                prompt.token_ids = []
            raise

    def logprobs_param(self, request: RequestT, params: SamplingParams) -> str:
        """The field that asked for logprobs (the prompt's alone: echo)."""
        return "logprobs" if params.logprobs is not None else "echo"

    def whole_logprobs(
        self, request: RequestT, params: SamplingParams, prompts: list[Prompt]
    ) -> int:
        """The logprob entries a response that is not streamed could hold, all at once until it
        is sent (a few KB each: the engine's, the response's objects, its JSON): each sequence's
        tokens up to max_tokens (else what the context leaves) with their alternatives, and
        each choice's copy of its prompt's (echo). 0 for a stream: it sends them as they come."""
        gen_k, prompt_k = params.logprobs, params.prompt_logprobs
        if getattr(request, "stream", False) or (gen_k is None and prompt_k is None):
            return 0
        context = self.client.max_model_len
        entries = 0
        for prompt in prompts:
            length = len(prompt.token_ids)
            if gen_k is not None:
                room = max(context - length, 0)
                tokens = room if params.max_tokens is None else min(params.max_tokens, room)
                entries += params.num_seqs * tokens * (gen_k + 1)
            if prompt_k is not None:
                entries += params.n * length * (prompt_k + 1)
        return entries

    def _prediction_tokens(self, text: str) -> list[int]:
        token_ids: list[int] = self.client.tokenizer.encode(text, add_special_tokens=False)
        if len(token_ids) > MAX_PREDICTION_TOKENS:
            raise SamplingParamsError(
                f"prediction may hold at most {MAX_PREDICTION_TOKENS} tokens", "prediction"
            )
        return token_ids

    def sampling_params(self, request: RequestT) -> SamplingParams:
        """The engine parameters every prompt of the request runs with (SamplingParamsError)."""
        params: SamplingParams = request.to_sampling_params()
        return params

    def prompts(self, request: RequestT) -> list[Prompt]:
        raise NotImplementedError

    def adapt(self, params: SamplingParams, prompts: list[Prompt]) -> None:
        """The last word on the parameters once the prompts are rendered (chat: a reasoning
        model's constraint)."""

    async def collect(self, job: Job[RequestT], outputs: Outputs) -> ResponseT:
        raise NotImplementedError

    def stream(self, job: Job[RequestT], outputs: Outputs) -> AsyncGenerator[ChunkT, None]:
        raise NotImplementedError

    def usage(
        self, job: Job[RequestT], num_completion_tokens: int, num_reasoning: int | None = None
    ) -> UsageInfo:
        """Usage counts each prompt once and every generated token (best_of candidates too),
        and the prompt tokens the prefix cache served (`prompt_tokens_details.cached_tokens`);
        `num_reasoning`: a reasoning model's think-block tokens (chat)."""
        record = job.record
        record.num_completion_tokens = num_completion_tokens
        prediction = None
        if record.num_accepted_prediction_tokens is not None:
            rejected = record.num_rejected_prediction_tokens or 0
            prediction = (record.num_accepted_prediction_tokens, rejected)
        return UsageInfo.of(
            record.num_prompt_tokens, num_completion_tokens, num_reasoning,
            record.num_cached_tokens, prediction,
        )  # fmt: skip

    def usage_chunk(
        self, job: Job[RequestT], num_completion_tokens: int, num_reasoning: int | None = None
    ) -> ChunkT | None:
        """The last chunk (`choices: []`) when stream_options.include_usage is set."""
        if not job.request.include_usage:
            return None
        return self.chunk(job, [], self.usage(job, num_completion_tokens, num_reasoning))

    def chunk(
        self, job: Job[RequestT], choices: list[Any], usage: UsageInfo | None = None
    ) -> ChunkT:
        """A stream chunk; with continuous_usage_stats (vLLM's) every one carries the usage
        so far (the record's completion tokens, which the stream keeps current)."""
        if usage is None and getattr(job.request, "continuous_usage", False):
            usage = self.usage(job, job.record.num_completion_tokens or 0)
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
