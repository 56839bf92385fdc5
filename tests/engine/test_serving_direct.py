"""The serving objects without HTTP: a parsed request in, a response model or chunk models out.

This is the seam the Batch API builds on: the same code an HTTP route runs, called directly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import pytest
from fastapi import Response
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from convoy.api.engine_client import EngineClient, ServingLimits
from convoy.api.errors import APIError
from convoy.api.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from convoy.api.protocol_completions import CompletionRequest, CompletionResponse
from convoy.api.serving_chat import ChatServing
from convoy.api.serving_completion import CompletionServing
from convoy.api.sse import sse_response
from convoy.config import EngineConfig
from convoy.engine.async_engine import AsyncEngine
from convoy.sampling_params import SamplingParamsError

PROMPTS = ["The capital of France is", "Once upon a time"]


def test_completion_and_chat_serving_run_without_http() -> None:
    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig(dtype="float32"))
        await engine.start()
        client = EngineClient(engine, "m", ServingLimits(max_prompts_per_request=8))
        completions, chat = CompletionServing(client), ChatServing(client)
        body = {"prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        full = await completions.create(CompletionRequest(**body))
        assert isinstance(full, CompletionResponse) and full.model == "m"
        assert [c.index for c in full.choices] == [0, 1]
        assert full.usage is not None and full.usage.completion_tokens == 12
        chunks = await completions.create(CompletionRequest(**body, stream=True))
        assert isinstance(chunks, AsyncGenerator)
        streamed = ["", ""]
        async for chunk in chunks:
            for c in chunk.choices:
                streamed[c.index] += c.text
        assert streamed == [c.text for c in full.choices]
        messages = [{"role": "user", "content": "Say hi."}]
        reply = await chat.create(ChatCompletionRequest(messages=messages, max_tokens=4))
        assert isinstance(reply, ChatCompletionResponse) and reply.choices[0].message.content
        with pytest.raises(SamplingParamsError) as err:  # checked before any work is queued
            await completions.create(CompletionRequest(prompt=[[1, 2], [10**9]], max_tokens=2))
        assert err.value.param == "prompt"
        assert engine.stats().num_kv_blocks_used == 0 and engine.stats().num_waiting == 0
        await engine.shutdown()

    asyncio.run(scenario())


async def _gone_before_the_response_started(response: Response, spec_version: str) -> None:
    """Serve `response` to a client that left before its first byte: ASGI 2.0 reports the
    disconnect while the start message waits; 2.4 raises OSError from `send`."""
    scope = {"type": "http", "asgi": {"spec_version": spec_version}}

    async def receive() -> dict[str, str]:
        return {"type": "http.disconnect"}

    async def send(message: object) -> None:
        if spec_version == "2.4":
            raise OSError("connection reset")
        await asyncio.Event().wait()  # never sent: the disconnect wins

    with contextlib.suppress(ClientDisconnect):
        await response(scope, receive, send)


def test_admission_slots_come_back_however_a_request_ends() -> None:
    """Completed, streamed to the end, closed after one chunk or before any, cancelled while
    it runs, refused (validation, 429), or its SSE client gone before the response started:
    every engine request and sequence it admitted is given back, with no garbage collection."""

    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig(dtype="float32"))
        await engine.start()
        client = EngineClient(engine, "m", ServingLimits(8, max_queue_seqs=4))
        completions = CompletionServing(client)

        def held() -> tuple[int, int]:
            return client.num_in_flight, client.num_seqs_in_flight

        body = {"prompt": PROMPTS, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        assert isinstance(await completions.create(CompletionRequest(**body)), BaseModel)
        assert held() == (0, 0)
        chunks = await completions.create(CompletionRequest(**body, stream=True))
        assert isinstance(chunks, AsyncGenerator)
        assert [chunk async for chunk in chunks] and held() == (0, 0)
        for num_read in (1, 0):
            chunks = await completions.create(CompletionRequest(**body, stream=True))
            assert isinstance(chunks, AsyncGenerator) and held() == (2, 2)
            for _ in range(num_read):
                await anext(chunks)
            await chunks.aclose()
            assert held() == (0, 0)
        task = asyncio.create_task(completions.create(CompletionRequest(**body), body_size=1))
        while held() == (0, 0):
            await asyncio.sleep(0)  # until the task is admitted (its first step, on the loop)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled() and held() == (0, 0)
        with pytest.raises(SamplingParamsError):
            await completions.create(CompletionRequest(prompt=[[1, 2], [10**9]], max_tokens=2))
        with pytest.raises(APIError) as err:
            await completions.create(CompletionRequest(prompt=PROMPTS, n=3))
        assert err.value.status == 429 and held() == (0, 0)
        for spec_version in ("2.0", "2.4"):
            chunks = await completions.create(CompletionRequest(**body, stream=True))
            assert isinstance(chunks, AsyncGenerator) and held() == (2, 2)
            await _gone_before_the_response_started(sse_response(chunks, "r"), spec_version)
            assert held() == (0, 0)
        await completions.create(CompletionRequest(prompt="x", max_tokens=2))
        stats = engine.stats()
        assert (stats.num_kv_blocks_used, stats.num_waiting, stats.num_running) == (0, 0, 0)
        await engine.shutdown()

    asyncio.run(scenario())
