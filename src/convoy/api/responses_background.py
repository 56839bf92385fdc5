"""Background responses (`background: true`): stored, then run in the batch priority class.

    create --checks (400s), chat prepared--> row (status queued + the request) written -->
      answer: the queued response --task--> in_progress --chat.run--> completed / incomplete /
      failed (the row without its request: never run again)
    POST .../cancel --> the task cancelled --> cancelled
    restart --> every row still queued or in_progress runs again from its request (nothing of
      the first run was recorded: resumed, never run twice); one that no longer prepares fails
      with the reason

A server that shuts down (SIGTERM) leaves its running background responses in_progress for the
next start; so does an engine that dies under them. No HTTP here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from convoy.api.errors import APIError, from_exception
from convoy.api.metrics import RequestRecord
from convoy.api.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from convoy.api.protocol_responses import Item, ResponseBody, ResponsesRequest
from convoy.api.responses_items import check_logprobs, completed, not_found, responses_params
from convoy.api.responses_store import ResponseStore, StoredResponse
from convoy.api.responses_stream import EventStream, assemble
from convoy.api.serving_base import Job
from convoy.api.serving_chat import ChatServing
from convoy.engine.errors import EngineUnavailableError
from convoy.engine.request import EngineRequest, Priority

logger = logging.getLogger(__name__)

ToChat = Callable[[ResponsesRequest, list[Item]], ChatCompletionRequest]
_Prepared = tuple[Job[ChatCompletionRequest], list[EngineRequest]]


class BackgroundResponses:
    def __init__(self, chat: ChatServing, store: ResponseStore | None, to_chat: ToChat) -> None:
        self.chat, self.store, self.to_chat = chat, store, to_chat
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelled: set[str] = set()  # ids whose task a client cancelled (not a shutdown)

    async def submit(
        self, request: ResponsesRequest, response: Item, items: list[Item],
        chat: ChatCompletionRequest, record: RequestRecord | None,
    ) -> ResponseBody:  # fmt: skip
        """Check and prepare now (a 400 is the client's answer), store the response queued
        with its request, start it; the answer is the queued response."""
        if self.store is None:
            raise APIError(400, "background responses need the data folder", param="background")
        prepared = await self._prepare(chat, record)
        response.update(status="queued", background=True)
        request_json = request.model_dump_json()
        await asyncio.to_thread(self.store.put, response, items, request_json)
        self._start(response, items, prepared, request_json)
        return ResponseBody(**response)

    async def cancel(self, response_id: str) -> Item:
        """Cancel a queued or running background response; a finished one is returned as is."""
        stored = await self._load(response_id)
        if not stored.response.get("background"):
            raise APIError(400, "only a background response can be cancelled",
                           param="response_id")  # fmt: skip
        if response_id in self.tasks:
            await self.stop_one(response_id)
            stored = await self._load(response_id)
        return stored.response

    async def resume(self) -> None:
        """At start: run again every background response a stopped server left unfinished."""
        if self.store is None:
            return
        for stored, request_json in await asyncio.to_thread(self.store.unfinished):
            response, items = stored.response, stored.input_items
            try:
                request = ResponsesRequest.model_validate_json(request_json)
                prepared = await self._prepare(self.to_chat(request, items), None)
            except Exception as e:  # noqa: BLE001 - recorded as the response's failure
                err = from_exception(e)
                message = f"could not resume after a restart: {err.message}"
                await self._end(response, items, "failed", {"code": "server_error",
                                                            "message": message})  # fmt: skip
                continue
            logger.info("resuming background response %s", response["id"])
            response["status"] = "queued"
            self._start(response, items, prepared, request_json)

    async def stop_one(self, response_id: str) -> None:
        """Cancel a queued or running background response's task; its row says cancelled."""
        task = self.tasks.get(response_id)
        if task is not None:
            self._cancelled.add(response_id)
            task.cancel()
            await asyncio.wait({task})

    async def stop(self) -> None:
        """At shutdown: stop the tasks, leaving their rows to resume at the next start."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _prepare(self, chat: ChatCompletionRequest, record: RequestRecord | None) -> _Prepared:
        with responses_params():
            prepared = await self.chat.prepare(chat, record, None, Priority.BATCH)
        check_logprobs(chat, self.chat.think_start(prepared[0].prompts))
        return prepared

    def _start(self, response: Item, items: list[Item], prepared: _Prepared, request: str) -> None:
        response_id = response["id"]
        task = asyncio.create_task(self._run(response, items, prepared, request))
        self.tasks[response_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(response_id, None))

    async def _run(
        self, response: Item, items: list[Item], prepared: _Prepared, request: str
    ) -> None:
        assert self.store is not None
        response_id = response["id"]
        response["status"] = "in_progress"
        # still resumable; written before any later status even when cancelled meanwhile
        write = asyncio.ensure_future(
            asyncio.to_thread(self.store.put, dict(response), items, request)
        )
        try:
            await asyncio.shield(write)
            result = await self.chat.run(*prepared)
            sealed = ResponsesRequest.model_validate_json(request).wants_encrypted_reasoning()
            if isinstance(result, ChatCompletionResponse):
                completed(response, result, sealed)
            else:  # logprobs: run as a stream (responses_stream.py)
                stream = EventStream(response, logprobs=True, sealed=sealed, whole=True)
                await assemble(stream, result)
        except asyncio.CancelledError:
            await asyncio.gather(write, return_exceptions=True)
            if response_id in self._cancelled:
                self._cancelled.discard(response_id)
                await asyncio.shield(self._end(response, items, "cancelled"))
            raise  # else a shutdown: the row stays unfinished and resumes at the next start
        except EngineUnavailableError:
            logger.warning("background response %s stopped with the engine", response_id)
            return  # resumes at the next start
        except Exception as e:  # noqa: BLE001 - the response's failure, kept in its row
            err = from_exception(e)
            await self._end(response, items, "failed", {"code": "server_error",
                                                        "message": err.message})  # fmt: skip
            return
        await self._end(response, items, response["status"])

    async def _end(
        self, response: Item, items: list[Item], status: str, error: Item | None = None
    ) -> None:
        """The final row: its status (and error); without its request, so never run again."""
        assert self.store is not None
        response.update(status=status, error=error)
        await asyncio.to_thread(self.store.put, response, items, None)

    async def _load(self, response_id: str) -> StoredResponse:
        stored = None if self.store is None else await asyncio.to_thread(self.store.get, response_id)
        if stored is None:
            raise not_found(response_id)
        return stored

