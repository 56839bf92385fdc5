"""Many clients at once, clients that go away, and a full queue."""

from __future__ import annotations

import asyncio

import httpx
from openai import AsyncOpenAI, OpenAI

from tests.e2e.conftest import MAX_QUEUE, Server
from tests.e2e.helpers import MAX_TOKENS, MODEL, PROMPTS, complete

KV_USED = "convoy_kv_blocks_used"
IN_FLIGHT = "convoy_engine_requests_in_flight"
SIDE_STEPS = "convoy_side_steps_total"


async def test_16_concurrent_clients_get_the_sequential_results(
    client: OpenAI, aclient: AsyncOpenAI
) -> None:
    sequential = [complete(client, p).choices[0].text for p in PROMPTS]

    async def one(prompt: str) -> str:
        completion = await aclient.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS
        )
        return completion.choices[0].text

    concurrent = await asyncio.gather(*(one(p) for p in PROMPTS))
    assert list(concurrent) == sequential


async def test_a_request_that_finds_a_step_in_flight_gets_its_tokens_in_a_side_step(
    server: Server, client: OpenAI, aclient: AsyncOpenAI
) -> None:
    """The session server takes a side step for any newcomer that finds a step in flight
    (--side-step-ms): its prompt runs between two layers of the streams' step, and its greedy
    text is the text it gets alone."""
    newcomers = PROMPTS[:4]
    alone = [complete(client, p).choices[0].text for p in newcomers]
    before = server.metric(SIDE_STEPS)

    async def stream(prompt: str) -> int:
        chunks = await aclient.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=64, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return len([c async for c in chunks])

    streams = [asyncio.ensure_future(stream(p)) for p in PROMPTS[4:12]]
    while server.metric(IN_FLIGHT) < 8:
        assert not any(s.done() for s in streams)  # (an error there would end one at once)
        await asyncio.sleep(0.01)
    texts = []
    for prompt in newcomers * 2:  # until two took side steps (one coming between steps doesn't)
        if server.metric(SIDE_STEPS) >= before + 2 or all(s.done() for s in streams):
            break
        completion = await aclient.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS
        )
        texts.append(completion.choices[0].text)
    assert server.metric(SIDE_STEPS) > before
    assert texts == (alone * 2)[: len(texts)]
    assert all(n > 0 for n in await asyncio.gather(*streams))
    server.wait_for_metric(KV_USED, 0)


def _long_request(prompts: list[str], stream: bool) -> dict[str, object]:
    # ignore_eos + a large max_tokens: it runs until it is dropped
    return {
        "model": MODEL,
        "prompt": prompts,
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def test_dropped_stream_frees_its_kv_blocks(
    server: Server, http: httpx.Client, client: OpenAI
) -> None:
    server.wait_for_metric(KV_USED, 0)
    with http.stream("POST", "/v1/completions", json=_long_request(PROMPTS[:2], True)) as stream:
        lines = stream.iter_lines()  # NOTE: keep it referenced; dropping it closes the stream
        assert next(lines).startswith("data: ")
        assert server.metric(KV_USED) > 0
        assert server.metric(IN_FLIGHT) == 2
    # leaving the block closes the connection mid-stream
    server.wait_for_metric(IN_FLIGHT, 0)
    server.wait_for_metric(KV_USED, 0)
    assert complete(client, PROMPTS[0]).choices[0].text  # still serving


async def test_disconnected_non_stream_request_is_aborted(server: Server) -> None:
    server.wait_for_metric(KV_USED, 0)
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers) as ac:
        task = asyncio.create_task(
            ac.post("/v1/completions", json=_long_request(PROMPTS[:3], False))
        )
        await asyncio.to_thread(server.wait_for_metric, IN_FLIGHT, 3)
        task.cancel()  # the client gives up: its connection closes
        await asyncio.gather(task, return_exceptions=True)
    await asyncio.to_thread(server.wait_for_metric, IN_FLIGHT, 0)
    await asyncio.to_thread(server.wait_for_metric, KV_USED, 0)


def test_full_queue_answers_429_then_recovers(server: Server, http: httpx.Client) -> None:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(MAX_QUEUE)]
    with http.stream("POST", "/v1/completions", json=_long_request(prompts, True)) as stream:
        lines = stream.iter_lines()  # NOTE: keep it referenced; dropping it closes the stream
        assert next(lines).startswith("data: ")
        assert server.metric(IN_FLIGHT) == MAX_QUEUE
        response = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}
        )
        assert response.status_code == 429
        error = response.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
    server.wait_for_metric(IN_FLIGHT, 0)
    server.wait_for_metric(KV_USED, 0)
    assert (
        http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}
        ).status_code
        == 200
    )
