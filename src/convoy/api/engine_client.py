"""What both generation routes need from the engine: checks before any work, admission, fan-out.

One API request with P prompts becomes P engine requests `{api_id}-{i}`, all started at once so
they batch inside the engine; their outputs are merged into one stream of (prompt index, output)
in arrival order. Closing that stream (client gone) cancels every sub-request, which aborts it in
the engine and frees its KV blocks.

Admission counts sequences (prompts x max(n, best_of)), not requests: one request may start at
most `max_seqs_per_request` (more: 400), and all requests together hold at most `max_queue_seqs`
(more: 429 with Retry-After). A request reserves all its sequences in one synchronous step (no
await between the check and the reservation, so concurrent requests cannot race past the bound)
and gives each engine request's share back when that request ends; closing the stream (its
owner always does: `aclosing`, the SSE response) gives back what is left, whether or not it was
ever read. Batch API lines (priority BATCH) are outside `max_queue_seqs`: the batch executor
bounds them with its own window, and the scheduler runs them after interactive work, so they
never make an interactive request see 429.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from convoy.api.errors import APIError
from convoy.api.metrics import RequestRecord
from convoy.engine.request import Priority
from convoy.outputs import RequestOutput
from convoy.sampling_params import SamplingParams

if TYPE_CHECKING:
    from convoy.config import ServerConfig
    from convoy.engine.async_engine import AsyncEngine
    from convoy.engine.request import EngineRequest
    from convoy.engine.tokenizer import Tokenizer
    from convoy.structured.compiler import GrammarCompiler

RETRY_AFTER_S = 1  # sequences finish continuously; a short wait is usually enough
T = TypeVar("T")


@dataclass(slots=True)
class Prompt:
    text: str | None  # the text the user sent (None for token ids until decoded)
    token_ids: list[int]


@dataclass(slots=True)
class ServingLimits:
    """The server's admission limits (defaults: ServerConfig; None = unbounded)."""

    max_prompts_per_request: int
    max_seqs_per_request: int | None = None  # prompts x max(n, best_of) in one request
    max_queue_seqs: int | None = None  # sequences in flight, all requests together
    max_logprobs_in_flight: int | None = None  # whole responses' logprob entries, all together

    @classmethod
    def of(cls, config: ServerConfig) -> ServingLimits:
        return cls(
            config.max_prompts_per_request, config.max_seqs_per_request, config.max_queue_seqs,
            config.max_logprobs_in_flight,
        )  # fmt: skip


def _at_capacity(message: str) -> APIError:
    """A 429 the client should retry after a while."""
    return APIError(429, message, code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


class _Admission:
    """The engine requests and sequences one API request holds; given back as they end."""

    __slots__ = ("client", "num_requests", "num_seqs", "is_queued", "logprobs")

    def __init__(
        self,
        client: EngineClient,
        num_requests: int,
        num_seqs: int,
        is_queued: bool = True,
        logprobs: int = 0,
    ) -> None:
        self.client, self.num_requests, self.num_seqs = client, num_requests, num_seqs
        self.is_queued = is_queued  # counted against max_queue_seqs (not for Batch API lines)
        self.logprobs = logprobs  # a whole response's logprob entries, at most
        client.num_in_flight += num_requests
        client.logprobs_in_flight += logprobs
        if is_queued:
            client.num_seqs_in_flight += num_seqs

    def release(self, num_requests: int, num_seqs: int) -> None:
        num_requests, num_seqs = min(num_requests, self.num_requests), min(num_seqs, self.num_seqs)
        self.num_requests -= num_requests
        self.num_seqs -= num_seqs
        self.client.num_in_flight -= num_requests
        if self.is_queued:
            self.client.num_seqs_in_flight -= num_seqs

    def release_all(self) -> None:
        self.release(self.num_requests, self.num_seqs)
        self.client.logprobs_in_flight -= self.logprobs
        self.logprobs = 0

    async def aclose(self) -> None:
        self.release_all()


class ClosingGenerator(AsyncGenerator[T, None], Generic[T]):
    """`gen`, then `after()` once it is closed, whether or not it ever started.

    NOTE: a plain async generator closed before its first step (a client gone before its
    response started) never runs its own `finally`: what must be given back goes in `after`.
    """

    __slots__ = ("_gen", "_after")

    def __init__(self, gen: AsyncGenerator[T, None], after: Callable[[], Awaitable[None]]) -> None:
        self._gen, self._after = gen, after

    async def asend(self, value: None) -> T:
        return await self._gen.asend(value)

    async def athrow(self, *args: Any) -> T:
        return await self._gen.athrow(*args)

    async def aclose(self) -> None:
        try:
            await self._gen.aclose()
        finally:
            await self._after()


_END = object()


class EngineClient:
    """The engine plus the server's admission rules; shared by the completion and chat routes."""

    def __init__(
        self,
        engine: AsyncEngine,
        served_model_name: str,
        limits: ServingLimits,
        reasoning_parser: str = "auto",
    ) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.limits = limits
        self.reasoning_parser = reasoning_parser  # --reasoning-parser (api/reasoning.py)
        # Engine requests admitted and not yet finished, Batch API lines too (a /metrics gauge).
        self.num_in_flight = 0
        self.num_seqs_in_flight = 0  # their sequences but batch ones: what max_queue_seqs bounds
        self.logprobs_in_flight = 0  # what whole responses' logprobs may come to (all of them)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def grammars(self) -> GrammarCompiler:
        """The front door's constraint compiler (and its cache)."""
        return self.engine.frontend.inputs.grammars

    def check_model(self, model: str | None) -> None:
        """The `model` field must name the served model (omitting it means the served one)."""
        if model is not None and model != self.served_model_name:
            raise APIError(
                404, f"the model {model!r} does not exist", param="model", code="model_not_found"
            )

    def check_capacity(self, num_seqs: int = 1) -> None:
        """429 unless `num_seqs` more sequences fit in the queue bound now."""
        limit = self.limits.max_queue_seqs
        if limit is not None and self.num_seqs_in_flight + num_seqs > limit:
            raise _at_capacity(
                f"the server is at capacity ({self.num_seqs_in_flight} of {limit} sequences in"
                f" flight, this request needs {num_seqs}); retry later"
            )

    def check_logprobs_room(self, logprobs: int) -> None:
        """429 unless a whole response's `logprobs` entries fit beside those in flight."""
        limit = self.limits.max_logprobs_in_flight
        if logprobs and limit is not None and self.logprobs_in_flight + logprobs > limit:
            raise _at_capacity(
                f"the responses in flight may hold {self.logprobs_in_flight} logprobs of the"
                f" {limit} the server allows, and this one {logprobs}; retry later, or stream it"
            )

    def check_logprobs(self, entries: int, param: str) -> None:
        """400 when one response that is not streamed could hold more logprob entries than all
        of them together may (max_logprobs_in_flight)."""
        limit = self.limits.max_logprobs_in_flight
        if limit is not None and entries > limit:
            raise APIError(
                400,
                f"this response could hold {entries} logprobs, more than the limit of {limit} for"
                " one that is not streamed: stream it (stream: true) or ask for fewer"
                f" (max_tokens, n, {param})",
                param=param,
            )

    def check_num_seqs(self, num_prompts: int, params: SamplingParams, param: str) -> None:
        """400 when prompts x max(n, best_of) passes max_seqs_per_request, naming the larger of
        best_of and n (or `param`, the prompt, when each prompt is one sequence)."""
        limit = self.limits.max_seqs_per_request
        num_seqs = num_prompts * params.num_seqs
        if limit is None or num_seqs <= limit:
            return
        if params.best_of is not None and params.best_of > params.n:
            field = "best_of"
        else:
            field = "n" if params.n > 1 else param
        raise APIError(
            400,
            f"{num_prompts} prompt(s) x {params.num_seqs} sequence(s) each ({field}) is"
            f" {num_seqs} sequences, more than the limit of {limit} per request",
            param=field,
        )

    def encode_prompt(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids; 400 without tokenizing a text that is certainly too long for
        the context (the front door would reject it after tokenizing, at a cost to every
        other request: see Tokenizer.min_tokens)."""
        at_least = self.tokenizer.min_tokens(text)
        if at_least >= self.max_model_len:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt"
                f" has {len(text)} characters, which is at least {at_least} tokens",
                param=param,
            )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_truncated(
        self, text: str, keep: int, add_special_tokens: bool = True
    ) -> tuple[list[int], bool]:
        """vLLM's truncate_prompt_tokens: the last `keep` token ids of the text (-1: as many as
        the context holds) and whether any were cut. A text certainly longer than the context
        is cut first (Tokenizer.tail), so a 32 MiB one is not tokenized whole."""
        too_long = self.tokenizer.min_tokens(text) >= self.max_model_len
        if too_long:
            text = self.tokenizer.tail(text, self.max_model_len)
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        kept = self.truncated(ids, keep)
        return kept, too_long or len(kept) < len(ids)

    def truncated(self, token_ids: list[int], keep: int | None) -> list[int]:
        """The last `keep` ids (-1: max_model_len; None: all)."""
        if keep is None:
            return token_ids
        return token_ids[-(self.max_model_len if keep == -1 else keep) :]

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Token ids from a client (e.g. /detokenize) must lie in the model's vocabulary."""
        self.engine.frontend.inputs.check_token_ids(token_ids, param)

    def process(
        self,
        api_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        param: str,
        priority: Priority = Priority.INTERACTIVE,
    ) -> list[EngineRequest]:
        """The engine's front-door checks for every prompt, before any prompt is queued.

        Prompt i becomes engine request `{api_id}-{i}`; all share the group `api_id` and
        `priority`.
        """
        self.check_num_seqs(len(prompts), params, param)
        return [
            self.engine.frontend.inputs.process(
                p.token_ids,
                params,
                f"{api_id}-{i}",
                p.text,
                api_id,
                param=param,
                max_tokens_must_fit=True,
                priority=priority,
            )  # fmt: skip
            for i, p in enumerate(prompts)
        ]

    def generate(
        self, requests: list[EngineRequest], record: RequestRecord, logprobs: int = 0
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Admit every prompt's sequences at once (or raise 429 now, before any response is
        started), then run each prompt as its own engine request; the returned stream yields
        (prompt index, output) as they come, and the caller must close it (what it still holds
        is given back then). Batch-priority requests skip the queue bound. `logprobs`: the
        entries a whole response could hold, admitted against max_logprobs_in_flight."""
        num_seqs = sum(r.params.num_seqs for r in requests)
        is_queued = not requests or requests[0].priority == Priority.INTERACTIVE
        if is_queued:  # Batch API lines are counted, never refused
            self.check_capacity(num_seqs)
            self.check_logprobs_room(logprobs)
        admission = _Admission(self, len(requests), num_seqs, is_queued, logprobs)
        return ClosingGenerator(self._run(requests, record, admission), admission.aclose)

    async def _run(
        self, requests: list[EngineRequest], record: RequestRecord, admission: _Admission
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        tasks = [
            asyncio.create_task(self._pump(queue, i, r, admission)) for i, r in enumerate(requests)
        ]
        try:
            num_running = len(tasks)
            while num_running:
                i, item = await queue.get()
                if item is _END:
                    num_running -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, RequestOutput)
                first_token = item.metrics.get("first_token")
                if first_token is not None:
                    record.mark_first_token(first_token)
                if item.finished:  # once per prompt, as usage counts prompts
                    record.num_cached_tokens += item.num_cached_tokens
                    if record.num_accepted_prediction_tokens is not None:
                        record.num_accepted_prediction_tokens += item.num_accepted_prediction_tokens
                        record.num_rejected_prediction_tokens = (
                            record.num_rejected_prediction_tokens or 0
                        ) + item.num_rejected_prediction_tokens
                yield i, item
        finally:
            # NOTE: cancelling a pump closes its engine generator, which aborts the request.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            admission.release_all()  # pumps cancelled before they started gave nothing back

    async def _pump(
        self,
        queue: asyncio.Queue[tuple[int, object]],
        index: int,
        request: EngineRequest,
        admission: _Admission,
    ) -> None:
        try:
            async for out in self.engine.generate(request):
                queue.put_nowait((index, out))
            queue.put_nowait((index, _END))
        except Exception as e:  # noqa: BLE001 - hand it to the consumer, which re-raises it
            queue.put_nowait((index, e))
        finally:
            admission.release(1, request.params.num_seqs)


def new_id(prefix: str) -> str:
    """OpenAI-style object id, e.g. `cmpl-3f2a...`."""
    return f"{prefix}-{uuid.uuid4().hex}"
