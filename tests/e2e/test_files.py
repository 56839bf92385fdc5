"""/v1/files against the real server, with the official client and raw httpx.

- Round trip: create, retrieve, content (byte for byte), list, delete; then 404s naming `id`.
- Uploads have their own limit (--max-file-bytes 4 MiB, over the 1 MiB request limit): a file of
  exactly the limit is stored, one byte more is 413 (counted while streaming), a larger body is
  413 by its Content-Length; no failed upload leaves a temp file behind.
- Listing is a cursor page (limit / after / order / purpose, has_more) the client pages through.
- Bad purposes, missing fields, empty files and malformed bodies get 400 naming the field.
- A second server on the same data folder answers 503 on /v1/files and still serves completions.
- Expiry: an upload's expires_after, a batch's output_expires_after, --batch-retention sweeping.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import MAX_FILE_BYTES, Server, start_server, stop_server
from tests.e2e.helpers import API_KEY, MODEL, complete, error_object
from tests.e2e.test_batches import wait

LINES = b"".join(
    json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": "Hi", "max_tokens": 1}}).encode() + b"\n"
    for i in range(3)
)  # fmt: skip


def _data_dir(server: Server) -> Path:
    """The session server's data folder (conftest gives each server one beside its log)."""
    return server.log_path.parent / "data"


def _temp_files(server: Server) -> list[Path]:
    return list((_data_dir(server) / "tmp").iterdir())


def _upload(http: httpx.Client, content: bytes, purpose: str = "batch", **extra: Any) -> Any:
    files = {"file": ("in.jsonl", content, "application/jsonl")}
    return http.post("/v1/files", files=files, data={"purpose": purpose, **extra})


def test_round_trip(client: OpenAI, http: httpx.Client, server: Server) -> None:
    created = client.files.create(file=("requests.jsonl", LINES), purpose="batch")
    assert created.id.startswith("file-") and created.object == "file"
    assert (created.bytes, created.filename, created.purpose) == (
        len(LINES),
        "requests.jsonl",
        "batch",
    )
    assert created.status == "processed" and created.expires_at is None
    assert client.files.retrieve(created.id) == created
    assert client.files.content(created.id).content == LINES
    raw = http.get(f"/v1/files/{created.id}/content")
    assert raw.headers["content-type"] == "application/jsonl"
    assert int(raw.headers["content-length"]) == len(LINES)
    assert (_data_dir(server) / "files" / created.id).read_bytes() == LINES

    deleted = client.files.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "file", True)
    assert not (_data_dir(server) / "files" / created.id).exists()
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)
    for method, path in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
        error = error_object(http.request(method, f"/v1/files/{created.id}{path}"), 404)
        assert error["message"] == f"No such File object: {created.id}"
        assert error["param"] == "id"


def test_uploads_have_their_own_limit(client: OpenAI, http: httpx.Client, server: Server) -> None:
    largest = bytes(range(256)) * (MAX_FILE_BYTES // 256)  # over --max-request-bytes (1 MiB)
    created = client.files.create(file=("big.bin", largest), purpose="user_data")
    assert created.bytes == MAX_FILE_BYTES
    raw = http.get(f"/v1/files/{created.id}/content")
    assert raw.headers["content-type"] == "application/octet-stream"
    assert hashlib.sha256(raw.content).digest() == hashlib.sha256(largest).digest()
    client.files.delete(created.id)

    for size in (MAX_FILE_BYTES + 1, 2 * MAX_FILE_BYTES):  # counted / by Content-Length
        error = error_object(_upload(http, b"x" * size, "user_data"), 413)
        assert str(MAX_FILE_BYTES) in error["message"] and error["code"] == "request_too_large"
    assert _temp_files(server) == []


def test_list_pages_through_the_files(client: OpenAI, http: httpx.Client) -> None:
    purposes = ["user_data", "fine-tune", "user_data", "fine-tune", "user_data"]
    ids = [
        client.files.create(file=(f"f{i}", b"%d" % i), purpose=p).id for i, p in enumerate(purposes)
    ]

    newest = client.files.list(limit=2)
    assert [f.id for f in newest.data] == ids[:-3:-1] and newest.has_more
    everything = [f.id for f in client.files.list(limit=2)]  # the client follows `after`
    assert everything[:5] == ids[::-1] and len(set(everything)) == len(everything)
    page = client.files.list(after=ids[0], limit=2, order="asc")
    assert [f.id for f in page.data] == ids[1:3] and page.has_more
    last = client.files.list(after=ids[3], limit=2, order="asc")
    assert [f.id for f in last.data] == ids[4:] and not last.has_more
    tuned = client.files.list(purpose="fine-tune", order="asc")
    assert {f.purpose for f in tuned.data} == {"fine-tune"}
    assert [f.id for f in tuned.data][-2:] == [ids[1], ids[3]]

    body = http.get("/v1/files", params={"after": ids[4], "order": "asc"}).json()
    assert body == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }
    body = http.get("/v1/files", params={"after": ids[2]}).json()
    assert [f["id"] for f in body["data"]][:2] == ids[1::-1]
    assert (body["first_id"], body["last_id"]) == (ids[1], body["data"][-1]["id"])
    for file_id in ids:
        client.files.delete(file_id)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 10_001}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"order": "newest"}, "order"),
        ({"after": "file-nosuchfile"}, "after"),
    ],
)
def test_list_rejects_bad_parameters(
    http: httpx.Client, params: dict[str, Any], param: str
) -> None:
    assert error_object(http.get("/v1/files", params=params), 400)["param"] == param


def _multipart(*parts: bytes, closed: bool = True) -> bytes:
    body = b"".join(b"--B\r\n" + part + b"\r\n" for part in parts)
    return body + (b"--B--\r\n" if closed else b"")


PURPOSE = b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch'
FILE = b'Content-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{"a": 1}'


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_multipart(PURPOSE), "file"),  # no file
        (_multipart(FILE), "purpose"),  # no purpose
        (_multipart(PURPOSE, FILE, FILE), "file"),  # two files
        (_multipart(PURPOSE.replace(b"batch", b"batch_output"), FILE), "purpose"),
        (_multipart(PURPOSE.replace(b"batch", b"b" * 2000), FILE), "purpose"),
        (_multipart(PURPOSE, FILE, closed=False), None),  # cut short
        (b"--B\r\nno headers end", None),
    ],
)
def test_malformed_uploads_get_400(
    http: httpx.Client, server: Server, body: bytes, param: str | None
) -> None:
    headers = {"Content-Type": "multipart/form-data; boundary=B"}
    response = http.post("/v1/files", content=body, headers=headers)
    assert error_object(response, 400)["param"] == param
    assert _temp_files(server) == []


def test_bad_uploads_get_400(client: OpenAI, http: httpx.Client, server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("a.jsonl", LINES), purpose="training")  # type: ignore[arg-type]
    assert e.value.status_code == 400 and e.value.param == "purpose"
    error = error_object(_upload(http, b""), 400)
    assert (error["message"], error["param"]) == ("the file is empty", "file")
    error = error_object(http.post("/v1/files", json={"purpose": "batch"}), 400)
    assert "multipart/form-data" in error["message"]
    assert _temp_files(server) == []


def test_a_second_server_on_the_same_folder_serves_no_files(
    server: Server, client: OpenAI, tmp_path: Path
) -> None:
    args = [MODEL, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "64MiB",
            "--data-dir", str(_data_dir(server))]  # fmt: skip
    second = start_server(args, tmp_path)
    try:
        with httpx.Client(base_url=second.base_url, headers=second.headers, timeout=60) as http:
            for method, path in (("GET", "/v1/files"), ("GET", "/v1/files/file-x/content")):
                error = error_object(http.request(method, path), 503)
                assert "--data-dir" in error["message"]
            error_object(_upload(http, LINES), 503)
        other = OpenAI(base_url=f"{second.base_url}/v1", api_key=API_KEY, max_retries=0)
        assert complete(other, "Hello", max_tokens=2).choices[0].text
    finally:
        stop_server(second)
    assert client.files.list(limit=1).object == "list"  # the folder's owner was not disturbed


def test_files_expire_after_what_the_upload_or_the_batch_says(
    client: OpenAI, http: httpx.Client
) -> None:
    """expires_after on an upload (OpenAI's bounds: an hour to 30 days, anchored at
    created_at) gives the file its expires_at; a batch's output_expires_after its outputs'."""
    week = 7 * 86400
    kept = client.files.create(file=("in.jsonl", LINES), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": week})  # fmt: skip
    assert kept.expires_at == kept.created_at + week
    assert client.files.retrieve(kept.id).expires_at == kept.expires_at
    assert client.files.create(file=("b.jsonl", LINES), purpose="batch").expires_at is None
    for fields, param in (
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"},
         "expires_after.seconds"),
        ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"},
         "expires_after.anchor"),
    ):  # fmt: skip
        response = http.post("/v1/files", files={"file": ("x.jsonl", LINES)},
                             data={"purpose": "batch", **fields})  # fmt: skip
        assert error_object(response, 400)["param"] == param
    batch = client.batches.create(
        input_file_id=kept.id, endpoint="/v1/completions", completion_window="24h",
        extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 3600}},
    )  # fmt: skip
    done = wait(client, batch.id)
    assert done.status == "completed" and done.output_file_id
    output = client.files.retrieve(done.output_file_id)
    assert output.expires_at == output.created_at + 3600
    bad = http.post("/v1/batches", json={
        "input_file_id": kept.id, "endpoint": "/v1/completions", "completion_window": "24h",
        "output_expires_after": {"anchor": "created_at", "seconds": 1},
    })  # fmt: skip
    assert error_object(bad, 400)["param"] == "output_expires_after.seconds"


def test_batch_retention_deletes_finished_outputs(tmp_path: Path) -> None:
    """--batch-retention: a finished batch's output file is deleted that long after it was
    made (bytes and row), its input file kept."""
    args = [MODEL, "--device", "cpu", "--kv-cache-memory", "64MiB", "--batch-retention", "1"]
    server = start_server(args, tmp_path)
    try:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
        source = client.files.create(file=("in.jsonl", LINES), purpose="batch")
        batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                      completion_window="24h")  # fmt: skip
        done = wait(client, batch.id)
        assert done.status == "completed" and done.output_file_id
        output_id = done.output_file_id
        deadline = time.monotonic() + 30
        while output_id in {f.id for f in client.files.list()}:
            assert time.monotonic() < deadline, "the output outlived its retention"
            time.sleep(0.2)  # polling interval: the sweep runs every second here
        assert not (tmp_path / "data" / "files" / output_id).exists()
        assert client.files.retrieve(source.id).expires_at is None
    finally:
        stop_server(server)
