"""Side steps on the real engine (AsyncEngine, SmolLM2 fp32): a request that arrives while a step
is in flight runs its prompt between two of that step's layers (EngineCore, --side-step-ms),
with the tokens it gets alone; a failed side step ends its own requests only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from convoy.config import EngineConfig
from convoy.engine.async_engine import AsyncEngine
from convoy.engine.errors import EngineStepError
from convoy.engine.faults import ENV_VAR, request_fault
from convoy.outputs import FinishReason, RequestOutput
from convoy.sampling_params import RequestOutputKind, SamplingParams
from tests.engine.conftest import prompts16

TIMEOUT_S = 120
STREAM_TOKENS = 48  # the streams outlast two or three newcomers, 8 tokens each
NEWCOMERS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Dear Sir,"]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )  # fmt: skip


async def _final(stream: AsyncIterator[RequestOutput]) -> list[int]:
    async def last() -> list[int]:
        outs = [o async for o in stream]
        assert outs[-1].outputs[0].finish_reason == FinishReason.LENGTH
        return list(outs[-1].outputs[0].token_ids)

    return await asyncio.wait_for(last(), TIMEOUT_S)


async def _until(cond: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), TIMEOUT_S)


def _engine(dtype: str = "float32", **kwargs: object) -> AsyncEngine:
    # any time left in a step is enough: every newcomer that finds one in flight takes a side
    # step (the default, 100 ms, needs longer steps than these few rows of this model take)
    return AsyncEngine(EngineConfig.from_kwargs(dtype=dtype, side_step_ms=1e-3, **kwargs))


@pytest.mark.parametrize("dtype", ["float32", "auto"])  # the exact mode; the quantized default
def test_newcomers_beside_a_step_in_flight_get_their_tokens_alone_in_side_steps(
    dtype: str,
) -> None:
    async def scenario() -> None:
        engine = _engine(dtype, speculative="off")  # a step is one token a stream: they outlast
        await engine.start()
        process = engine.frontend.inputs.process
        encode = engine.tokenizer.encode
        streams = [encode(p) for p in prompts16()[:8]]
        newcomers = [encode(p) for p in NEWCOMERS]

        def start_streams(tag: str) -> list[asyncio.Future[list[int]]]:
            return [
                asyncio.ensure_future(
                    _final(engine.generate(process(ids, _greedy(STREAM_TOKENS), f"{tag}{i}")))
                )
                for i, ids in enumerate(streams)
            ]

        # first with nothing beside them: the streams together, each newcomer alone
        alone = await asyncio.gather(*start_streams("alone-s"))
        for i, ids in enumerate(newcomers):
            alone.append(await _final(engine.generate(process(ids, _greedy(8), f"alone-n{i}"))))
        assert engine.core.num_side_steps == 0  # nothing was in flight when they came
        busy = start_streams("s")
        await _until(lambda: engine.stats().num_running == len(streams))
        # one after the other into the streams' steps, until two of them took side steps
        # (a newcomer that comes in the gap between two steps joins the next one instead)
        together: list[list[int]] = []
        for i, ids in enumerate(newcomers * 3):
            if engine.core.num_side_steps >= 2:
                break
            await asyncio.sleep(0.005)  # from a step's end into the next step's layers
            together.append(await _final(engine.generate(process(ids, _greedy(8), f"n{i}"))))
        assert engine.stats().num_running == len(streams)  # they all ran beside the streams
        streamed = await asyncio.gather(*busy)
        assert engine.core.num_side_steps >= 1
        # greedy: the same tokens, side step or not
        assert streamed == alone[: len(streams)]
        assert together == [alone[len(streams) + i % len(newcomers)] for i in range(len(together))]
        assert engine.stats().num_kv_blocks_used == 0 and engine.stats().num_running == 0
        await engine.shutdown()

    asyncio.run(scenario())


def test_a_failed_side_step_ends_its_requests_and_the_step_in_flight_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault = tmp_path / "fault"
    monkeypatch.setenv(ENV_VAR, str(fault))

    async def scenario() -> None:
        engine = _engine()
        await engine.start()
        process = engine.frontend.inputs.process
        encode = engine.tokenizer.encode
        busy = [
            asyncio.ensure_future(_final(engine.generate(process(encode(p), _greedy(40), f"s{i}"))))
            for i, p in enumerate(prompts16()[:8])
        ]
        await _until(lambda: engine.stats().num_running == 8)
        request_fault(fault, "side")  # ordinary steps leave it for a side step
        failed = 0
        for i, prompt in enumerate(NEWCOMERS * 2):
            try:
                await _final(engine.generate(process(encode(prompt), _greedy(4), f"n{i}")))
            except EngineStepError:
                failed += 1
            if not fault.exists():
                break
        assert failed == 1 and engine.core.num_side_steps >= 1
        for tokens in await asyncio.gather(*busy):  # the steps in flight were not touched
            assert len(tokens) == 40
        after = await _final(engine.generate(process(encode("Hello"), _greedy(4), "after")))
        assert len(after) == 4 and engine.is_running
        assert engine.stats().num_kv_blocks_used == 0 and engine.stats().num_running == 0
        await engine.shutdown()

    asyncio.run(scenario())
