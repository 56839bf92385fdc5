"""Engine faults seen by real clients: a failed step, a dead engine thread, /metrics under load.

The servers here run with the fault hook (`CONVOY_FAULT_FILE`, convoy/engine/faults.py): writing
`step` to that file makes the next engine step raise, `kill` ends the engine thread. Every client
must get an error (none hangs: each waits a bounded time), and what can go on must go on.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from convoy.engine.faults import ENV_VAR, request_fault
from tests.e2e.conftest import Server, start_server, stop_server
from tests.e2e.helpers import API_KEY, MODEL, PROMPTS, complete

TIMEOUT_S = 60  # per client: an error must come well before this; a hang fails the test
RUNNING = "convoy_num_requests_running"
KV_USED = "convoy_kv_blocks_used"
# ignore_eos + many tokens: still running when the fault comes
LONG = {"model": MODEL, "max_tokens": 2000, "temperature": 0, "extra_body": {"ignore_eos": True}}
LONG_BODY = {"model": MODEL, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


def _start(tmp_path: Path) -> tuple[Server, Path]:
    fault = tmp_path / "fault"
    args = [MODEL, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "256MiB"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_VAR, str(fault))  # the server process inherits it
        return start_server(args, tmp_path), fault


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    server, fault = _start(tmp_path_factory.mktemp("faulty"))
    try:
        yield server, fault
    finally:
        stop_server(server)


def _aclient(server: Server) -> AsyncOpenAI:
    # max_retries=0: the client must see the 500 / 503 itself, not retry it away
    return AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S
    )


async def _openai_stream(client: AsyncOpenAI, prompt: str) -> Exception | None:
    """The error a streaming client gets (openai raises on an error frame)."""
    try:
        stream = await client.completions.create(prompt=prompt, stream=True, **LONG)
        async for _ in stream:
            pass
    except openai.APIError as e:
        return e
    return None


async def _openai_whole(client: AsyncOpenAI, prompt: str) -> Exception | None:
    try:
        await client.completions.create(prompt=prompt, **LONG)
    except openai.APIError as e:
        return e
    return None


async def _raw_stream(server: Server, prompt: str) -> list[str]:
    """Every `data:` line of one stream, as sent."""
    body = {**LONG_BODY, "prompt": prompt, "stream": True}
    async with (
        httpx.AsyncClient(base_url=server.base_url, headers=server.headers) as http,
        http.stream("POST", "/v1/completions", json=body, timeout=TIMEOUT_S) as response,
    ):
        assert response.status_code == 200
        return [line async for line in response.aiter_lines() if line.startswith("data: ")]


def _error_frame(lines: list[str]) -> dict[str, Any]:
    """A stream that failed ends with an error frame, then `[DONE]`."""
    assert lines[-1] == "data: [DONE]", lines[-3:]
    frame: dict[str, Any] = json.loads(lines[-2].removeprefix("data: "))
    assert set(frame["error"]) == {"message", "type", "param", "code"}, frame
    return frame["error"]


async def _clients_then_fault(server: Server, fault: Path, command: str) -> list[Any]:
    """Two openai streams, two whole responses and one raw stream, all running; then the fault.
    Returns what each client got, in that order, within TIMEOUT_S."""
    client = _aclient(server)
    tasks = [
        *(asyncio.ensure_future(_openai_stream(client, p)) for p in PROMPTS[:2]),
        *(asyncio.ensure_future(_openai_whole(client, p)) for p in PROMPTS[2:4]),
        asyncio.ensure_future(_raw_stream(server, PROMPTS[4])),
    ]
    await asyncio.to_thread(server.wait_for_metric, RUNNING, len(tasks))
    request_fault(fault, command)
    return await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S + 10)


async def test_failed_step_fails_its_clients_and_the_server_keeps_serving(
    faulty: tuple[Server, Path],
) -> None:
    server, fault = faulty
    server.wait_for_metric(KV_USED, 0)
    *errors, raw = await _clients_then_fault(server, fault, "step")
    for e in errors[:2]:  # streams: an error frame
        assert isinstance(e, openai.APIError) and e.code == "internal_error", e
    for e in errors[2:]:  # whole responses: 500
        assert isinstance(e, openai.InternalServerError) and e.status_code == 500, e
        assert e.code == "internal_error"
    err = _error_frame(raw)
    assert (err["type"], err["code"]) == ("server_error", "internal_error")
    server.wait_for_metric(KV_USED, 0)  # the failed requests' blocks came back
    sync = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    assert complete(sync, PROMPTS[5]).choices[0].text  # and the next request is served
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


async def test_metrics_answer_200_while_streams_come_and_go(faulty: tuple[Server, Path]) -> None:
    """/metrics reads a snapshot the engine thread takes, never the scheduler's live dicts."""
    server, _ = faulty
    client = _aclient(server)
    short = {"model": MODEL, "max_tokens": 4, "temperature": 0}

    async def streamer(i: int) -> None:
        for j in range(3):
            prompt = PROMPTS[(i + j) % len(PROMPTS)]
            stream = await client.completions.create(prompt=prompt, stream=True, **short)
            assert [chunk async for chunk in stream]

    load = asyncio.ensure_future(asyncio.gather(*(streamer(i) for i in range(8))))
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers) as http:

        async def scraper() -> None:
            while not load.done():
                statuses.append((await http.get("/metrics", timeout=TIMEOUT_S)).status_code)
                # pacing, not synchronisation: back to back, scrapes starve the engine of the GIL
                await asyncio.sleep(0.02)

        await asyncio.wait_for(asyncio.gather(load, scraper(), scraper()), 120)
    assert len(statuses) >= 20 and set(statuses) == {200}, statuses


async def test_dead_engine_fails_every_client_and_answers_503(tmp_path: Path) -> None:
    server, fault = _start(tmp_path)
    try:
        *errors, raw = await _clients_then_fault(server, fault, "kill")
        for e in errors[:2]:  # streams: an error frame
            assert isinstance(e, openai.APIError) and e.code == "engine_unavailable", e
        for e in errors[2:]:  # whole responses: 503
            assert isinstance(e, openai.APIStatusError) and e.status_code == 503, e
        assert _error_frame(raw)["code"] == "engine_unavailable"
        client = _aclient(server)
        for stream in (False, True):  # new requests: 503 at once, streams too (no 200 first)
            with pytest.raises(openai.APIStatusError) as new:
                await client.completions.create(prompt="Hello", stream=stream, **LONG)
            assert new.value.status_code == 503 and new.value.code == "engine_unavailable"
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        assert health.status_code == 503
        assert "the engine thread died" in server.log()
    finally:
        stop_server(server)
