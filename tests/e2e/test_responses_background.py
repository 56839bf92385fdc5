"""Background responses through the real server with the official client: one runs in the
batch class and ends as the same request would in the foreground; one is cancelled (its KV
blocks given back); one survives a kill -9 (resumed once at the next start, never again after);
/v1/responses lines in a batch; the 400s and 404s of cancel."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.responses import Response

from tests.e2e.conftest import Server, running_server, start_server, stop_server
from tests.e2e.helpers import API_KEY, MODEL, poll
from tests.e2e.test_batches import results, submit, wait

ARGS = [MODEL, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "128MiB"]
LONG = {"input": "Count from 1 to 500, one number a line.", "max_output_tokens": 1500,
        "temperature": 0}  # fmt: skip
TERMINAL = ("completed", "incomplete", "failed", "cancelled")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("background")


@pytest.fixture(scope="module")
def bserver(data_dir: Path) -> Iterator[Server]:
    with running_server(ARGS, data_dir) as server:
        yield server


def _client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _until(client: OpenAI, rid: str, statuses: tuple[str, ...], timeout_s: float = 180) -> Response:
    return poll(lambda: client.responses.retrieve(rid), lambda r: r.status in statuses,
                f"response {rid}", timeout_s)  # fmt: skip


def test_background_ends_as_the_foreground_request(bserver: Server) -> None:
    client = _client(bserver)
    kwargs = {"model": MODEL, "input": "Name three colours.", "max_output_tokens": 24,
              "temperature": 0}  # fmt: skip
    queued = client.responses.create(background=True, **kwargs)  # type: ignore[call-overload]
    assert queued.background is True and queued.status in ("queued", "in_progress")
    done = _until(client, queued.id, TERMINAL)
    fore = client.responses.create(**kwargs)  # type: ignore[call-overload]
    assert done.status == fore.status and done.output_text == fore.output_text
    assert done.usage is not None and fore.usage is not None
    assert done.usage.output_tokens == fore.usage.output_tokens


def test_cancel_frees_the_engine(bserver: Server) -> None:
    client = _client(bserver)
    r = client.responses.create(model=MODEL, background=True, **LONG)  # type: ignore[call-overload]
    _until(client, r.id, ("in_progress", *TERMINAL))
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.cancel(r.id).status == "cancelled"  # again: the same answer
    bserver.wait_for_metric("convoy_kv_blocks_used", 0)


def test_cancel_needs_a_background_response(bserver: Server) -> None:
    client = _client(bserver)
    fore = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(fore.id)
    assert err.value.body["param"] == "response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")


def test_responses_lines_in_a_batch(bserver: Server) -> None:
    client = _client(bserver)
    body = {"model": MODEL, "input": "Say hi.", "max_output_tokens": 4, "temperature": 0}
    lines = [
        {"custom_id": "r0", "method": "POST", "url": "/v1/responses", "body": body},
        {"custom_id": "r1", "method": "POST", "url": "/v1/responses",
         "body": {**body, "background": True}},
    ]  # fmt: skip
    batch = wait(client, submit(client, lines, "/v1/responses").id)
    assert batch.status == "completed"
    out, errors = results(client, batch.output_file_id), results(client, batch.error_file_id)
    answer = out["r0"]["response"]["body"]
    fore = client.responses.create(**body)  # type: ignore[call-overload]
    assert answer["object"] == "response" and answer["output"][0]["content"][0]["text"] == (
        fore.output_text
    )
    assert errors["r1"]["response"]["status_code"] == 400
    assert errors["r1"]["response"]["body"]["error"]["param"] == "background"


# NOTE: last: it stops the module's server.
def test_kill_9_resumes_once(bserver: Server, data_dir: Path) -> None:
    client = _client(bserver)
    body = {**LONG, "max_output_tokens": 160}  # running when killed, short once resumed
    r = client.responses.create(model=MODEL, background=True, **body)  # type: ignore[call-overload]
    _until(client, r.id, ("in_progress",))
    bserver.proc.kill()  # SIGKILL: nothing is recorded on the way out
    bserver.proc.wait()
    again = start_server(ARGS, data_dir)
    try:
        assert again.log().count(f"resuming background response {r.id}") == 1
        done = _until(_client(again), r.id, TERMINAL, timeout_s=300)
        assert done.status in ("completed", "incomplete") and done.output_text
        assert done.usage is not None and done.usage.output_tokens > 0
    finally:
        stop_server(again)
    third = start_server(ARGS, data_dir)  # a finished response is never run again
    try:
        assert "resuming background response" not in third.log()
        assert _client(third).responses.retrieve(r.id).output_text == done.output_text
        assert httpx.get(f"{third.base_url}/metrics", headers=third.headers).status_code == 200
        assert third.metric("convoy_generation_tokens_total") == 0
    finally:
        stop_server(third)
