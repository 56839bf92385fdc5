"""A streamed chat completion recast as Responses' typed events (serving_responses.py), and the
response it ends with.

The message's logprobs (`include: ["message.output_text.logprobs"]`) are the entries of the
tokens that wrote its text: a chunk's entries wait until a message delta is sent and go with it
(a tool-call parser may hold a token's text back before it hands it out as content); held
entries are dropped when a call's delta comes (they wrote its marker), and at the end (tokens
that wrote nothing: the end-of-sequence token, a stop string). So the deltas' logprobs add up to
the done event's and the final part's. A whole (non-streamed) response that asks for logprobs
runs this stream too and answers with the response it ends with, so whole and streamed list the
same tokens.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from convoy.api.errors import from_exception
from convoy.api.protocol_chat import ChatChoiceLogprobs, ChatCompletionChunk
from convoy.api.protocol_common import UsageInfo
from convoy.api.protocol_responses import Item, ResponseBody, new_item_id
from convoy.api.responses_items import call_item, call_status, finish_response, part, text_item


class EventStream:
    """Chat chunks -> Responses' events, each with its type and a sequence number from 0;
    `response` (the dict sent in response.created) is updated in place to the final one.

    `logprobs`: the message's logprobs are asked for; `sealed`: a reasoning item's
    encrypted_content (include reasoning.encrypted_content). `save`: called with the finished
    response before the last event (storing it). `whole`: the events are drained for a whole
    response, so an error mid-stream is raised (the client has no stream to read it in) rather
    than sent in-band."""

    def __init__(
        self, response: Item, *, logprobs: bool = False, sealed: bool = False,
        save: Callable[[Item], Awaitable[None]] | None = None, whole: bool = False,
    ) -> None:  # fmt: skip
        self.response, self.save, self.whole, self.sealed = response, save, whole, sealed
        self.seq = 0
        self.open: dict[str, tuple[str, str]] = {}  # kind -> (item id, text) of an open item
        self.calls: dict[int, Item] = {}  # chat's call index -> its function_call item
        self.output: list[Item] = []  # items in output order (dicts updated in place)
        self.logprobs: list[Item] | None = [] if logprobs else None  # the message's so far
        self.held: list[Item] = []  # entries of tokens whose text has not been sent yet

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
                        self.hold(choice.logprobs)
                        delta = choice.delta
                        events = self.text_delta("reasoning", delta.reasoning_content)
                        events += self.text_delta("message", delta.content)
                        for ev in events + self.calls_delta(delta.tool_calls):
                            yield ev
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
            if self.whole:
                raise
            err = from_exception(e)
            yield self.event("error", code=err.code, message=err.message, param=err.param)
            self.response.update(status="failed", output=self.output,
                                 error={"code": "server_error",
                                        "message": err.message})  # fmt: skip
            yield self.event("response.failed", response=self.snapshot())
            return
        self.held = []  # wrote nothing the message shows
        for ev in self.close_all():
            yield ev
        self.response["output"] = self.output
        finish_response(self.response, finish, usage)
        if self.save is not None:
            await self.save(self.response)
        kind = "response.incomplete" if finish == "length" else "response.completed"
        yield self.event(kind, response=self.response)

    def hold(self, logprobs: ChatChoiceLogprobs | None) -> None:
        if self.logprobs is not None and logprobs is not None and logprobs.content:
            self.held += [e.model_dump() for e in logprobs.content]

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
        extra: Item = {}
        if kind == "message":  # the held tokens wrote this text
            extra["logprobs"], self.held = self.held, []
            if self.logprobs is not None:
                self.logprobs += extra["logprobs"]
        else:
            self.held = []  # they wrote the reasoning
        events.append(self.event(f"{_EVENTS[kind]}.delta", item_id=item_id,
                                 output_index=self.index(item_id), content_index=0, delta=text,
                                 **extra))  # fmt: skip
        return events

    def calls_delta(self, calls: list[Any] | None) -> list[ResponseBody]:
        events: list[ResponseBody] = []
        if calls:
            self.held = []  # the tokens of a call (its marker, name, arguments)
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
        logprobs = self.logprobs if kind == "message" else None
        done = text_item(item_id, text, "completed", kind, logprobs, sealed=self.sealed)
        self.output[i] = done
        part = done["content"][0]
        extra: Item = {"logprobs": list(logprobs or [])} if kind == "message" else {}
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


async def assemble(stream: EventStream, chunks: AsyncGenerator[ChatCompletionChunk, None]) -> Item:
    """The response a whole request answers with: `stream` (whole=True) run to its end."""
    events = stream.run(chunks)
    async with aclosing(events):
        async for _ in events:
            pass
    return stream.response


_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}
_ID_PREFIX = {"message": "msg", "reasoning": "rs"}
