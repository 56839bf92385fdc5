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
from contextlib import aclosing
from typing import Any

from pydantic import ValidationError

from convoy.api.engine_client import ClosingGenerator
from convoy.api.errors import APIError, from_exception
from convoy.api.metrics import RequestRecord
from convoy.api.protocol_chat import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from convoy.api.protocol_common import UsageInfo
from convoy.api.protocol_responses import Item, ResponseBody, ResponsesRequest, new_item_id
from convoy.api.reasoning import is_thinking_template
from convoy.api.responses_background import BackgroundResponses
from convoy.api.responses_items import (
    call_item,
    call_status,
    completed,
    finish_response,
    not_found,
    part,
    responses_params,
    text_item,
)
from convoy.api.responses_store import ResponseStore, StoredResponse
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
        items = request.input_items()
        if request.previous_response_id:
            previous = await self.load(request.previous_response_id, "previous_response_id")
            items = previous.conversation + items
        if request.truncation == "auto":  # renders the conversation a few times: off the loop
            chat = await asyncio.to_thread(self.to_chat, request, items)
        else:
            chat = self.to_chat(request, items)
        response = self.new_response(request)
        if request.background:
            return await self.background.submit(request, response, items, chat, record)
        with responses_params():
            result = await self.chat.create(chat, record, size, priority=priority)
        if isinstance(result, ChatCompletionResponse):
            completed(response, result)
            await self._save(request, response, items)
            return ResponseBody(**response)
        # closing the events closes the chat chunks (and so aborts the engine requests) even
        # when the client left before the first event
        return ClosingGenerator(_EventStream(self, request, response, items).run(result),
                                result.aclose)  # fmt: skip

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
            raise SamplingParamsError(f"{err['msg']} at {err['loc']}", "input") from None

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
        if effort is not None and not is_thinking_template(
            self.chat.client.tokenizer.chat_template
        ):
            raise SamplingParamsError("this model does not reason", "reasoning.effort")
        return effort

    async def _save(self, request: ResponsesRequest, response: Item, items: list[Item]) -> None:
        if request.store is not False and self.store is not None:
            await asyncio.to_thread(self.store.put, response, items)


class _EventStream:
    """Chat chunks -> Responses' events, each with its type and a sequence number from 0."""

    def __init__(
        self, serving: ResponsesServing, request: ResponsesRequest, response: Item,
        items: list[Item],
    ) -> None:  # fmt: skip
        self.serving, self.request, self.response, self.items = serving, request, response, items
        self.seq = 0
        self.open: dict[str, tuple[str, str]] = {}  # kind -> (item id, text) of an open item
        self.calls: dict[int, Item] = {}  # chat's call index -> its function_call item
        self.output: list[Item] = []  # items in output order (dicts updated in place)

    def event(self, kind: str, **fields: Any) -> ResponseBody:
        body = ResponseBody.model_validate({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return body

    def snapshot(self) -> Item:
        return {**self.response, "output": list(self.output)}

    async def run(
        self, chunks: AsyncGenerator[ChatCompletionChunk, None]
    ) -> AsyncGenerator[ResponseBody, None]:
        yield self.event("response.created", response=self.snapshot())
        yield self.event("response.in_progress", response=self.snapshot())
        finish: str | None = None
        usage: UsageInfo | None = None
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        finish = choice.finish_reason or finish
                        delta = choice.delta
                        events = self.text_delta("reasoning", delta.reasoning_content)
                        events += self.text_delta("message", delta.content)
                        for ev in events + self.calls_delta(delta.tool_calls):
                            yield ev
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
            err = from_exception(e)
            yield self.event("error", code=err.code, message=err.message, param=err.param)
            self.response.update(status="failed", output=self.output,
                                 error={"code": "server_error",
                                        "message": err.message})  # fmt: skip
            yield self.event("response.failed", response=self.snapshot())
            return
        for ev in self.close_all():
            yield ev
        self.response["output"] = self.output
        finish_response(self.response, finish, usage)
        await self.serving._save(self.request, self.response, self.items)
        kind = "response.incomplete" if finish == "length" else "response.completed"
        yield self.event(kind, response=self.response)

    def text_delta(self, kind: str, text: str | None) -> list[ResponseBody]:
        """A piece of the message's text, or of the reasoning item's (which closes when the
        message opens)."""
        if not text:
            return []
        events = self.close_text("reasoning") if kind == "message" else []
        if kind not in self.open:
            events += self.open_text(kind)
        item_id, so_far = self.open[kind]
        self.open[kind] = (item_id, so_far + text)
        extra: Item = {"logprobs": []} if kind == "message" else {}
        events.append(self.event(f"{_EVENTS[kind]}.delta", item_id=item_id,
                                 output_index=self.index(item_id), content_index=0, delta=text,
                                 **extra))  # fmt: skip
        return events

    def calls_delta(self, calls: list[Any] | None) -> list[ResponseBody]:
        events: list[ResponseBody] = []
        for call in calls or []:
            if call.id is not None:
                events += self.close_text("reasoning") + self.close_text("message")
                item = call_item(new_item_id("fc"), call.id, call.function.name or "", "",
                                  "in_progress")  # fmt: skip
                self.calls[call.index] = item
                self.output.append(item)
                events.append(
                    self.event(
                        "response.output_item.added",
                        output_index=len(self.output) - 1,
                        item=dict(item),
                    )
                )
            item = self.calls[call.index]
            if call.function.arguments:
                item["arguments"] += call.function.arguments
                events.append(self.event("response.function_call_arguments.delta",
                                         item_id=item["id"], output_index=self.index(item["id"]),
                                         delta=call.function.arguments))  # fmt: skip
        return events

    def index(self, item_id: str) -> int:
        return next(i for i, item in enumerate(self.output) if item["id"] == item_id)

    def open_text(self, kind: str) -> list[ResponseBody]:
        item_id = new_item_id(_ID_PREFIX[kind])
        self.open[kind] = (item_id, "")
        item = text_item(item_id, "", "in_progress", kind)
        item["content"] = []
        self.output.append(item)
        i = len(self.output) - 1
        return [
            self.event("response.output_item.added", output_index=i, item=dict(item)),
            self.event("response.content_part.added", item_id=item_id, output_index=i,
                       content_index=0, part=part(kind, "")),
        ]  # fmt: skip

    def close_text(self, kind: str) -> list[ResponseBody]:
        if kind not in self.open:
            return []
        item_id, text = self.open.pop(kind)
        i = self.index(item_id)
        done = text_item(item_id, text, "completed", kind)
        self.output[i] = done
        part = done["content"][0]
        extra: Item = {"logprobs": []} if kind == "message" else {}
        return [
            self.event(f"{_EVENTS[kind]}.done", item_id=item_id, output_index=i,
                       content_index=0, text=text, **extra),
            self.event("response.content_part.done", item_id=item_id, output_index=i,
                       content_index=0, part=part),
            self.event("response.output_item.done", output_index=i, item=done),
        ]  # fmt: skip

    def close_all(self) -> list[ResponseBody]:
        events = self.close_text("reasoning")
        if not any(item["type"] != "reasoning" for item in self.output):
            events += self.open_text("message")  # no message or call: still one (empty) message
        events += self.close_text("message")
        for item in self.calls.values():
            item["status"] = call_status(item["arguments"])
            i = self.index(item["id"])
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=i, name=item["name"],
                                     arguments=item["arguments"]))  # fmt: skip
            events.append(self.event("response.output_item.done", output_index=i, item=item))
        return events


_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}
_ID_PREFIX = {"message": "msg", "reasoning": "rs"}
