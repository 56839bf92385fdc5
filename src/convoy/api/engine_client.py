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
    from convoy.engine.request import EngineRequest
    from convoy.engine.tokenizer import Tokenizer


@dataclass(slots=True)
class Prompt:
    text: str | None  # the text the user sent (None for token ids until decoded)
    token_ids: list[int]


@dataclass(slots=True)
class ServingLimits:
    """The server's admission limits (defaults: ServerConfig)."""

    max_prompts_per_request: int
    max_queue: int | None  # engine requests in flight before answering 429


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
        """Token ids from a client (e.g. /detokenize) must lie in the model's vocabulary."""
        self.engine.frontend.inputs.check_token_ids(token_ids, param)

    def process(
        self, api_id: str, prompts: list[Prompt], params: SamplingParams, param: str
    ) -> list[EngineRequest]:
        """The engine's front-door checks for every prompt, before any prompt is queued.

        Prompt i becomes engine request `{api_id}-{i}`; all share the group `api_id`.
        """
        return [
            self.engine.frontend.inputs.process(
                p.token_ids,
                params,
                f"{api_id}-{i}",
                p.text,
                api_id,
                param=param,
                max_tokens_must_fit=True,
            )  # fmt: skip
            for i, p in enumerate(prompts)
        ]

    async def generate(
        self, requests: list[EngineRequest], record: RequestRecord
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Run every prompt as its own engine request; yield (prompt index, output) as they come."""
        queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(queue, i, r)) for i, r in enumerate(requests)]
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
        request: EngineRequest,
    ) -> None:
        self.num_in_flight += 1
        try:
            async for out in self.engine.generate(request):
                queue.put_nowait((index, out))
            queue.put_nowait((index, _END))
        except Exception as e:  # noqa: BLE001 - hand it to the consumer, which re-raises it
            queue.put_nowait((index, e))
        finally:
            self.num_in_flight -= 1


def new_id(prefix: str) -> str:
    """OpenAI-style object id, e.g. `cmpl-3f2a...`."""
    return f"{prefix}-{uuid.uuid4().hex}"
