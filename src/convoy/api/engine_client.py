"""What both generation routes need from the engine: checks before any work, and fan-out.

One API request with P prompts becomes P engine requests `{api_id}-{i}`, all started at once so
they batch inside the engine; their outputs are merged into one stream of (prompt index, output)
in arrival order. Closing that stream (client gone) cancels every sub-request, which aborts it in
the engine and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from convoy.api.errors import APIError
from convoy.api.metrics import RequestRecord
from convoy.outputs import RequestOutput
from convoy.sampling_params import SamplingParams

if TYPE_CHECKING:
    from convoy.engine.async_engine import AsyncEngine
    from convoy.engine.tokenizer import Tokenizer


@dataclass(slots=True)
class Prompt:
    text: str | None  # the text the user sent (None for token ids until decoded)
    token_ids: list[int]


@dataclass(slots=True)
class ServingLimits:
    max_prompts_per_request: int = 1024
    max_queue: int | None = None  # engine requests in flight before answering 429


_END = object()


class EngineClient:
    """The engine plus the server's admission rules; shared by the completion and chat routes."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, limits: ServingLimits) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.limits = limits
        self.num_in_flight = 0  # engine requests started and not yet finished

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, model: str | None) -> None:
        """The `model` field must name the served model (omitting it means the served one)."""
        if model is not None and model != self.served_model_name:
            raise APIError(
                404, f"the model {model!r} does not exist", param="model", code="model_not_found"
            )

    def check_capacity(self) -> None:
        limit = self.limits.max_queue
        if limit is not None and self.num_in_flight >= limit:
            raise APIError(
                429,
                f"the server is at capacity ({self.num_in_flight} requests queued); retry later",
                code="queue_full",
            )

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise APIError(400, f"{param} must not be empty", param=param)
        vocab_size = self.tokenizer.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(
                400, f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param=param
            )

    def validate(self, prompts: list[Prompt], params: SamplingParams, param: str) -> None:
        """Every check that can fail, for every prompt, before any prompt is queued."""
        if params.stop_token_ids:
            self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        for prompt in prompts:
            self.check_token_ids(prompt.token_ids, param)
            num_tokens = len(prompt.token_ids)
            if num_tokens >= self.max_model_len:
                raise APIError(400, self._too_long(num_tokens, 0), param=param)
            if (
                params.max_tokens is not None
                and num_tokens + params.max_tokens > self.max_model_len
            ):
                raise APIError(400, self._too_long(num_tokens, params.max_tokens), "max_tokens")
            self.engine.validate(prompt.token_ids, params)

    def _too_long(self, num_prompt_tokens: int, max_tokens: int) -> str:
        return (
            f"this model's maximum context length is {self.max_model_len} tokens; the request"
            f" has {num_prompt_tokens} prompt tokens and asks for {max_tokens} completion tokens"
        )

    async def generate(
        self, api_id: str, prompts: list[Prompt], params: SamplingParams, record: RequestRecord
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Run every prompt as its own engine request; yield (prompt index, output) as they come."""
        queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        tasks = [
            asyncio.create_task(self._pump(queue, i, f"{api_id}-{i}", p, params, api_id))
            for i, p in enumerate(prompts)
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
                yield i, item
        finally:
            # NOTE: cancelling a pump closes its engine generator, which aborts the request.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _pump(
        self,
        queue: asyncio.Queue[tuple[int, object]],
        index: int,
        req_id: str,
        prompt: Prompt,
        params: SamplingParams,
        group_id: str,
    ) -> None:
        self.num_in_flight += 1
        try:
            outputs = self.engine.generate(
                prompt.token_ids, params, req_id, prompt=prompt.text, group_id=group_id
            )
            async for out in outputs:
                queue.put_nowait((index, out))
            queue.put_nowait((index, _END))
        except Exception as e:  # noqa: BLE001 - hand it to the consumer, which re-raises it
            queue.put_nowait((index, e))
        finally:
            self.num_in_flight -= 1


def new_id(prefix: str) -> str:
    """OpenAI-style object id, e.g. `cmpl-3f2a...`."""
    return f"{prefix}-{uuid.uuid4().hex}"
