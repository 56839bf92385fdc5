"""The serving objects without HTTP: a parsed request in, a response model or chunk models out.

This is the seam the Batch API builds on: the same code an HTTP route runs, called directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from convoy.api.engine_client import EngineClient, ServingLimits
from convoy.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from convoy.api.serving_chat import ChatServing
from convoy.api.serving_completion import CompletionServing
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
