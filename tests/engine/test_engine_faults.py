"""Engine faults and endings without HTTP: a failed step, shutdown, a partial UTF-8 character.

The HTTP side (status codes, SSE frames from a real server) is tests/e2e/test_faults.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from convoy import LLM
from convoy.api.engine_client import EngineClient, ServingLimits
from convoy.api.errors import from_exception
from convoy.api.protocol_completions import CompletionRequest
from convoy.api.serving_completion import CompletionServing
from convoy.api.sse import DONE, sse_events
from convoy.config import EngineConfig
from convoy.engine.async_engine import AsyncEngine
from convoy.engine.errors import EngineShutdownError, EngineStepError
from convoy.engine.faults import ENV_VAR, request_fault
from convoy.outputs import FinishReason, RequestOutput
from convoy.sampling_params import RequestOutputKind, SamplingParams

TIMEOUT_S = 120  # generous on a loaded machine; a hang fails instead of blocking the suite
LONG = dict(temperature=0, max_tokens=1000, ignore_eos=True)


def test_partial_utf8_character_at_the_end_is_kept(llm: LLM) -> None:
    """A sequence ending inside a multi-byte character ends with what a whole decode gives
    (U+FFFD, as Hugging Face decodes it), not with nothing."""
    first_byte = llm.tokenizer.encode("🙂", add_special_tokens=False)[0]
    assert llm.tokenizer.decode([first_byte]) == "\ufffd"  # half of the emoji's bytes
    params = SamplingParams(temperature=0, max_tokens=1, logit_bias={first_byte: 100.0})
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA):
        out = llm.generate(["Smile:"], replace(params, output_kind=kind))
        choice = out[0].outputs[0]
        assert choice.token_ids == [first_byte] and choice.finish_reason == FinishReason.LENGTH
        assert choice.text == llm.tokenizer.decode(choice.token_ids) == "\ufffd"


async def _next(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await asyncio.wait_for(anext(stream), TIMEOUT_S)


async def _drain(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    async def all_of() -> list[RequestOutput]:
        return [o async for o in stream]

    return await asyncio.wait_for(all_of(), TIMEOUT_S)


def test_failed_step_ends_its_requests_and_shutdown_ends_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One sequence at a time: the running request fails with its step, the waiting one is
    untouched and finishes; at shutdown the requests in flight and new ones get 503s."""
    fault = tmp_path / "fault"
    monkeypatch.setenv(ENV_VAR, str(fault))

    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig.from_kwargs(dtype="float32", max_num_seqs=1))
        await engine.start()
        process = engine.frontend.inputs.process
        ids = engine.tokenizer.encode("Count to a thousand: 1, 2, 3,")
        delta = SamplingParams(**LONG, output_kind=RequestOutputKind.DELTA)
        short = SamplingParams(
            temperature=0, max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY
        )
        running = engine.generate(process(ids, delta, "running"))
        waiting = engine.generate(process(ids, short, "waiting"))
        waiting_task = asyncio.ensure_future(_drain(waiting))
        await _next(running)
        await _until(lambda: engine.stats().num_waiting == 1)  # stats: after the next step
        request_fault(fault, "step")
        with pytest.raises(EngineStepError) as err:
            await _drain(running)
        assert from_exception(err.value).status == 500
        assert from_exception(err.value).code == "internal_error"
        (final,) = await waiting_task  # admitted after the failure, runs to its end
        assert final.outputs[0].finish_reason == FinishReason.LENGTH
        assert len(final.outputs[0].token_ids) == 4
        assert engine.stats().num_kv_blocks_used == 0 and engine.stats().num_running == 0
        assert engine.is_running

        # Shutdown: a stream and a whole response in flight, then a new request.
        serving = CompletionServing(
            EngineClient(engine, "m", ServingLimits(max_prompts_per_request=8))
        )
        stream = await serving.create(CompletionRequest(prompt="Hi", stream=True, **LONG))
        assert isinstance(stream, AsyncGenerator)
        frames = sse_events(stream, "cmpl-x")
        first = await asyncio.wait_for(anext(frames), TIMEOUT_S)
        assert first.startswith(b"data: {")
        whole = asyncio.ensure_future(serving.create(CompletionRequest(prompt="Hey", **LONG)))
        await _until(lambda: engine.stats().num_waiting == 1)  # queued behind the stream
        await engine.shutdown()
        rest = await asyncio.wait_for(_collect(frames), TIMEOUT_S)
        assert rest[-1] == DONE
        assert b'"code":"engine_unavailable"' in rest[-2] and b'"error"' in rest[-2]
        assert b'"finish_reason":"abort"' not in b"".join(rest)
        with pytest.raises(EngineShutdownError) as err:
            await asyncio.wait_for(whole, TIMEOUT_S)
        assert from_exception(err.value).status == 503
        with pytest.raises(EngineShutdownError):
            await serving.create(CompletionRequest(prompt="Late", max_tokens=2))
        with pytest.raises(EngineShutdownError):
            await anext(engine.generate(process(ids, short, "late")))
        assert not engine.is_running

    asyncio.run(scenario())


async def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)  # polling interval, not synchronisation


async def _collect(frames: AsyncIterator[bytes]) -> list[bytes]:
    return [f async for f in frames]
