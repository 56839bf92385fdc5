"""Batch API lines beside interactive requests, with the real model: interactive ones overtake
them within a step or two, pausing does not change what the lines generate, and admission keeps
lines out of the interactive queue bound."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import replace

import pytest

from convoy import LLM, SamplingParams
from convoy.api.engine_client import EngineClient, ServingLimits
from convoy.api.errors import APIError
from convoy.api.protocol_completions import CompletionRequest, CompletionResponse
from convoy.api.serving_completion import CompletionServing
from convoy.config import EngineConfig
from convoy.engine.async_engine import AsyncEngine
from convoy.engine.request import Priority
from convoy.outputs import RequestOutput
from convoy.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _add(llm: LLM, req_id: str, prompt: str, priority: Priority, sink: list[RequestOutput]) -> None:
    """One prompt as its own API request (a batch line is one), streamed into `sink`."""
    params = replace(GREEDY, output_kind=RequestOutputKind.DELTA)
    ids = llm.tokenizer.encode(prompt)
    request = llm.frontend.inputs.process(ids, params, req_id, prompt, priority=priority)
    llm.frontend.add(request, sink.append)


def test_interactive_overtakes_running_lines_and_pausing_does_not_change_them() -> None:
    # Lines keep 1 of 4 while interactive work runs; no grace period after (generate() below).
    llm = LLM(dtype="float32", max_num_seqs=4, batch_grace=0.0)
    prompts = [f"Item {i}: describe it in detail." for i in range(6)]
    unpaused = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    lines: list[list[RequestOutput]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        _add(llm, f"line-{i}", p, Priority.BATCH, lines[i])
    for _ in range(2):
        llm.frontend.step()
    batch = llm.core.scheduler.batch
    assert len(batch.running) == 4  # the lines fill the sequence cap
    user: list[RequestOutput] = []
    _add(llm, "user", "Hello!", Priority.INTERACTIVE, user)
    steps = 0
    while not user:
        llm.frontend.step()
        steps += 1
    assert steps == 1  # a slot and blocks taken from the newest line at once
    while not user[-1].finished:
        before = {r.req_id: r.num_computed_tokens for r in batch.running}
        llm.frontend.step()
        moved = [r for r in batch.running if before.get(r.req_id, 0) != r.num_computed_tokens]
        assert len(moved) <= 1 < len(batch.running)  # the other running lines are paused
    while llm.frontend.has_work():
        llm.frontend.step()
    assert [[t for o in out for t in o.outputs[0].token_ids] for out in lines] == unpaused
    assert llm.core.scheduler.num_preemptions == 1  # the paused lines resumed, not recomputed
    assert llm.core.block_manager.num_used_blocks == 0


async def _drain(chunks: object) -> str:
    assert isinstance(chunks, AsyncGenerator)
    text = ""
    async for chunk in chunks:
        text += "".join(c.text for c in chunk.choices)
    return text


def test_batch_priority_skips_the_queue_bound_but_not_the_per_request_limit() -> None:
    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig(dtype="float32"))
        await engine.start()
        limits = ServingLimits(max_prompts_per_request=8, max_seqs_per_request=4, max_queue_seqs=2)
        client = EngineClient(engine, "m", limits)
        serving = CompletionServing(client)
        body = {"prompt": ["a", "b", "c"], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        with pytest.raises(APIError) as err:
            await serving.create(CompletionRequest(**body))
        assert err.value.status == 429
        lines = await serving.create(
            CompletionRequest(**body, stream=True), priority=Priority.BATCH
        )
        # Counted as in flight (the /metrics gauge), not against the interactive bound.
        assert client.num_in_flight == 3 and client.num_seqs_in_flight == 0
        user = await serving.create(CompletionRequest(prompt="hi", max_tokens=2))
        assert isinstance(user, CompletionResponse)
        assert await _drain(lines)
        assert client.num_in_flight == 0 and client.num_seqs_in_flight == 0
        whole = await serving.create(CompletionRequest(**body), priority=Priority.BATCH)
        assert isinstance(whole, CompletionResponse) and len(whole.choices) == 3
        with pytest.raises(APIError) as err:
            await serving.create(
                CompletionRequest(**{**body, "prompt": ["a"] * 5}), priority=Priority.BATCH
            )
        assert (err.value.status, err.value.param) == (400, "prompt")
        assert engine.stats().num_kv_blocks_used == 0
        await engine.shutdown()

    asyncio.run(scenario())
