"""The Batch API with the official client against the session server: upload, create, poll,
download; both endpoints, per-line errors, validation failures naming the line, cancel, listing,
and a file a running batch uses cannot be deleted."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest
from openai import OpenAI
from openai.types import Batch

from tests.e2e.conftest import Server
from tests.e2e.helpers import MODEL, PROMPTS, poll

DONE = ("completed", "failed", "expired", "cancelled")


def jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def completion_line(i: int, **body: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 6,
            "temperature": 0, **body}  # fmt: skip
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body}


def chat_line(i: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0}
    return {"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def submit(client: OpenAI, lines: list[Any], endpoint: str = "/v1/completions") -> Batch:
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint=endpoint, completion_window="24h",  # type: ignore[arg-type]
        metadata={"test": "yes"},
    )  # fmt: skip
    assert batch.status == "validating" and batch.input_file_id == file.id
    assert batch.metadata == {"test": "yes"}
    return batch


def wait(
    client: OpenAI, batch_id: str, statuses: tuple[str, ...] = DONE, timeout_s: float = 120
) -> Batch:
    return poll(lambda: client.batches.retrieve(batch_id), lambda b: b.status in statuses,
                f"batch {batch_id}", timeout_s)  # fmt: skip


def results(client: OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    """custom_id -> output line of a result file (each custom_id exactly once)."""
    if file_id is None:
        return {}
    lines = [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id answered twice"
    return by_id


def test_completions_batch_round_trip(client: OpenAI, server: Server) -> None:
    lines = [completion_line(i) for i in range(6)]
    lines.append(completion_line(6, max_tokens=-1))  # invalid body: its 400 goes to the error file
    batch = wait(client, submit(client, lines).id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed) == (7, 6)
    assert batch.request_counts.failed == 1
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    out, err = results(client, batch.output_file_id), results(client, batch.error_file_id)
    assert sorted(out) == [f"req-{i}" for i in range(6)] and list(err) == ["req-6"]
    bad = err["req-6"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "max_tokens"
    for i in (0, 3):  # a line's body is exactly what the same request returns over HTTP
        alone = client.completions.create(**lines[i]["body"])
        body = out[f"req-{i}"]["response"]["body"]
        assert out[f"req-{i}"]["response"]["status_code"] == 200
        assert body["object"] == "text_completion" and body["model"] == alone.model
        assert body["choices"][0]["text"] == alone.choices[0].text
        want = alone.usage.model_dump(exclude_none=True)
        for usage in (body["usage"], want):  # cached prompt tokens depend on the runs before
            usage.pop("prompt_tokens_details", None)
        assert body["usage"] == want
    usage = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in out.values())
    assert batch.usage is not None and batch.usage.output_tokens == usage
    assert server.metric("convoy_batch_generation_tokens_total") >= usage
    assert server.metric("convoy_batch_queue_lines") == 0
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"  # type: ignore[arg-type]


def test_chat_batch(client: OpenAI) -> None:
    lines = [chat_line(i) for i in range(3)]
    batch = wait(client, submit(client, lines, "/v1/chat/completions").id)
    assert batch.status == "completed" and batch.error_file_id is None
    out = results(client, batch.output_file_id)
    alone = client.chat.completions.create(**lines[1]["body"])
    body = out["chat-1"]["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == alone.choices[0].message.content


@pytest.mark.parametrize(
    ("bad_line", "code", "param"),
    [
        ("{not json", "invalid_json_line", None),
        ({**completion_line(1), "url": "/v1/chat/completions"}, "mismatched_endpoint", "url"),
        ({**completion_line(1), "custom_id": "req-0"}, "duplicate_custom_id", "custom_id"),
        (completion_line(1, stream=True), "invalid_request", "body.stream"),
        (completion_line(1, model="gpt-4o"), "model_not_found", "body.model"),
    ],
)
def test_invalid_file_fails_naming_the_line(
    client: OpenAI, bad_line: Any, code: str, param: str | None
) -> None:
    batch = wait(client, submit(client, [completion_line(0), bad_line, completion_line(2)]).id)
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors is not None and batch.errors.data
    error = batch.errors.data[0]
    assert (error.code, error.line, error.param) == (code, 2, param)
    assert batch.output_file_id is None


def test_create_rejects_bad_requests(client: OpenAI) -> None:
    file = client.files.create(file=("in.jsonl", jsonl([completion_line(0)])), purpose="batch")
    cases = [
        ({"endpoint": "/v1/moderations"}, 400, "endpoint"),
        ({"completion_window": "1h"}, 400, "completion_window"),
        ({"input_file_id": "file-missing"}, 404, "input_file_id"),
    ]
    for change, status, param in cases:
        args = {
            "input_file_id": file.id,
            "endpoint": "/v1/completions",
            "completion_window": "24h",
            **change,
        }
        with pytest.raises(openai.APIStatusError) as info:
            client.batches.create(**args)  # type: ignore[arg-type]
        assert info.value.status_code == status and info.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")


def test_cancel_keeps_partial_output(client: OpenAI, server: Server) -> None:
    # lengths 4..316: lines finish one after another, so the cancel lands mid-way
    lines = [completion_line(i, max_tokens=4 + 8 * i, ignore_eos=True) for i in range(40)]
    batch = submit(client, lines)
    running = wait(client, batch.id, ("in_progress", *DONE))
    with pytest.raises(openai.ConflictError):  # the input of a running batch
        client.files.delete(running.input_file_id)
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < 2:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "no line finished"
        time.sleep(0.1)  # polling interval
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    counts = done.request_counts
    assert counts is not None and 2 <= counts.completed < 40
    assert len(results(client, done.output_file_id)) == counts.completed
    server.wait_for_metric("convoy_kv_blocks_used", 0)  # aborted lines freed their blocks
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: unchanged
    assert client.files.delete(running.input_file_id).deleted  # no longer in use


def test_list_pages_newest_first(client: OpenAI) -> None:
    ids = [submit(client, [completion_line(i)]).id for i in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    listed = [b.id for b in client.batches.list(limit=2)]  # auto-pagination follows `after`
    assert listed[:3] == ids[::-1] and len(listed) == len(set(listed))
    for batch_id in ids:
        assert wait(client, batch_id).status == "completed"
    with pytest.raises(openai.APIStatusError) as info:
        client.batches.list(after="batch_missing")
    assert info.value.status_code == 404
