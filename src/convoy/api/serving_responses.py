"""/v1/responses over ChatServing: a Responses request runs as a chat completion (its template,
sampling, structured outputs and tool parsing) and its answer is recast as a response object,
or, streamed, as Responses' typed events. A reasoning model's think block (chat's
reasoning_content) is a `reasoning` item before the message, streamed as
`response.reasoning_text.*` events. No HTTP here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from pydantic import ValidationError

from convoy.api.engine_client import ClosingGenerator
from convoy.api.errors import APIError
from convoy.api.metrics import RequestRecord
from convoy.api.protocol_chat import (
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from convoy.api.protocol_responses import (
    InputTokenCount,
    Item,
    ResponseBody,
    ResponsesRequest,
    new_item_id,
)
from convoy.api.reasoning import check_reasons
from convoy.api.responses_background import BackgroundResponses
from convoy.api.responses_items import (
    check_logprobs,
    completed,
    not_found,
    responses_param,
    responses_params,
)
from convoy.api.responses_store import ResponseStore, StoredResponse
from convoy.api.responses_stream import EventStream, assemble
from convoy.api.serving_chat import ChatServing, render_chat
from convoy.engine.request import Priority
from convoy.sampling_params import SamplingParamsError


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore | None) -> None:
        self.chat, self.store = chat, store
        self.background = BackgroundResponses(chat, store, self.to_chat)

    async def load(self, response_id: str, param: str = "response_id") -> StoredResponse:
        stored = (
            None if self.store is None else await asyncio.to_thread(self.store.get, response_id)
        )
        if stored is None:
            raise not_found(response_id, param)
        return stored

    async def create(
        self,
        request: ResponsesRequest,
        record: RequestRecord | None = None,
        size: int | None = None,
        *,
        priority: Priority = Priority.INTERACTIVE,
    ) -> ResponseBody | AsyncGenerator[ResponseBody, None]:
        """The response (or its events); `background: true` answers at once with the stored,
        queued response, run by `self.background` in the batch priority class."""
        request.check_supported()
        if request.background and priority == Priority.BATCH:
            raise SamplingParamsError("a batch line cannot start a background response",
                                      "background")  # fmt: skip
        items = await self.conversation(request)
        if request.truncation == "auto":  # renders the conversation a few times: off the loop
            chat = await asyncio.to_thread(self.to_chat, request, items)
        else:
            chat = self.to_chat(request, items)
        response = self.new_response(request)
        if request.background:
            return await self.background.submit(request, response, items, chat, record)
        with responses_params():
            job, engine_requests = await self.chat.prepare(chat, record, size, priority)
        check_logprobs(chat, self.chat.think_start(job.prompts))
        result = await self.chat.run(job, engine_requests)
        sealed = request.wants_encrypted_reasoning()
        if isinstance(result, ChatCompletionResponse):
            completed(response, result, sealed)
            await self._save(request, response, items)
            return ResponseBody(**response)

        async def save(finished: Item) -> None:
            await self._save(request, finished, items)

        events = EventStream(response, logprobs=request.wants_logprobs(), sealed=sealed,
                             save=save, whole=not request.stream)  # fmt: skip
        if not request.stream:  # asked for logprobs: the stream's last response
            return ResponseBody(**await assemble(events, result))
        # closing the events closes the chat chunks (and so aborts the engine requests) even
        # when the client left before the first event
        return ClosingGenerator(events.run(result), result.aclose)

    async def conversation(self, request: ResponsesRequest) -> list[Item]:
        """The items the request runs over: previous_response_id's conversation, then its
        input (item references resolved)."""
        items = await self.input_items(request)
        if request.previous_response_id:
            previous = await self.load(request.previous_response_id, "previous_response_id")
            items = previous.conversation + items
        return items

    async def input_items(self, request: ResponsesRequest) -> list[Item]:
        """The request's input as items, each item_reference replaced by the stored item it
        names (an input or output item of a stored response; 404 naming it when none is)."""
        items = request.input_items()
        wanted = [item["id"] for item in items if item["type"] == "item_reference"]
        if not wanted:
            return items
        found = {} if self.store is None else await asyncio.to_thread(self.store.items, wanted)
        for i, item in enumerate(items):
            if item["type"] == "item_reference":
                if item["id"] not in found:
                    raise APIError(404, f"no stored item with id {item['id']!r}",
                                   param=f"input[{i}].id")  # fmt: skip
                items[i] = dict(found[item["id"]])
        return items

    async def count_input_tokens(self, request: ResponsesRequest) -> InputTokenCount:
        """POST /v1/responses/input_tokens: the prompt tokens `request` would run with (its
        conversation after previous_response_id, instructions, tools, truncation), the
        `usage.input_tokens` its response would report; nothing runs or is stored."""
        request.check_supported()
        items = await self.conversation(request)

        def count() -> int:
            chat = self.to_chat(request, items)
            with responses_params():
                return len(render_chat(self.chat.client, chat).token_ids)

        return InputTokenCount(input_tokens=await asyncio.to_thread(count))

    def to_chat(self, request: ResponsesRequest, items: list[Item]) -> ChatCompletionRequest:
        """The chat request that runs `request` over the conversation `items` (400s name the
        Responses field)."""
        thinking = self._thinking(request)
        try:
            if request.truncation == "auto":
                items = items[self._num_to_drop(request, items, thinking) :]
            return request.to_chat(items, thinking)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            where = str(err["loc"][0]) if err["loc"] else "messages"
            raise SamplingParamsError(f"{err['msg']} at {err['loc']}",
                                      responses_param(where)) from None  # fmt: skip

    def _num_to_drop(self, request: ResponsesRequest, items: list[Item],
                     thinking: bool | None) -> int:  # fmt: skip
        """`truncation: auto`: how many items to drop from the conversation's start so that its
        prompt fits the context with max_output_tokens (or one token) after it; 0 when it fits,
        and when not even the last item alone fits (the usual 400 then says so). The stored
        conversation keeps every item: each response truncates its own input."""
        client = self.chat.client
        room = client.max_model_len - (request.max_output_tokens or 1)

        def fits(k: int) -> bool:
            try:
                chat = request.to_chat(items[k:], thinking)
                return len(render_chat(client, chat).token_ids) <= room
            except (APIError, ValueError):  # ValidationError, SamplingParamsError are ValueErrors
                return False  # e.g. a template that wants a user turn first: drop more

        if len(items) <= 1 or fits(0) or not fits(len(items) - 1):
            return 0
        lo, hi = 1, len(items) - 1  # the fewest dropped that fits lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def new_response(self, request: ResponsesRequest) -> Item:
        return {
            "id": new_item_id("resp"), "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "error": None, "incomplete_details": None,
            "model": self.chat.client.served_model_name, "output": [], "usage": None,
            **request.echo(),
        }  # fmt: skip

    def _thinking(self, request: ResponsesRequest) -> bool | None:
        """`reasoning.effort` as a thinking model's enable_thinking (None: not set); 400 for a
        model whose template does not think."""
        effort = request.thinking()
        if effort is not None:
            check_reasons(self.chat.client.tokenizer.chat_template, "reasoning.effort")
        return effort

    async def _save(self, request: ResponsesRequest, response: Item, items: list[Item]) -> None:
        if request.store is not False and self.store is not None:
            await asyncio.to_thread(self.store.put, response, items)
