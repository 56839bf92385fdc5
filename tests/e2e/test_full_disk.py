"""A full data disk (a small tmpfs mounted under the server's data folder): an upload that does
not fit gets a 507 naming the file and leaves nothing half-written, a batch whose outputs do not
fit fails with the ledger's error (recorded in the room of the data folder's reserve) and keeps
what it committed, interactive requests go on, and deleting a file frees its space."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from convoy.batch.db import RESERVE_BYTES
from tests.e2e.conftest import Server, start_server, stop_server
from tests.e2e.helpers import API_KEY, MODEL
from tests.e2e.test_batches import completion_line, jsonl, results, wait

DISK_BYTES = 8 << 20
NUM_LINES = 200


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    if not _can_mount():  # the precondition: mounting a tmpfs needs root
        pytest.skip("mounting a tmpfs needs root")
    root = tmp_path_factory.mktemp("full-disk")
    data = root / "data"
    data.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(data)],
                   check=True)  # fmt: skip
    try:
        args = [MODEL, "--device", "cpu", "--kv-cache-memory", "64MiB", "--max-file-bytes",
                str(2 * DISK_BYTES)]  # fmt: skip
        server = start_server(args, root)
        try:
            yield server, data
        finally:
            stop_server(server)
    finally:
        subprocess.run(["umount", "-l", str(data)], check=False)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def _leftovers(data: Path) -> list[str]:
    """What uploads in progress left in the data folder's tmp/."""
    return [p.name for p in (data / "tmp").iterdir()]


def test_a_full_disk_refuses_uploads_fails_batches_cleanly_and_serving_goes_on(
    full_disk: tuple[Server, Path],
) -> None:
    server, data = full_disk
    client = _client(server)
    batch_input = client.files.create(
        file=("in.jsonl", jsonl([completion_line(i, max_tokens=16) for i in range(NUM_LINES)])),
        purpose="batch",
    )
    # An upload larger than what is left: 507 naming the file, nothing of it left on disk.
    too_big = b"x" * (_free(data) + (256 << 10))
    r = httpx.post(f"{server.base_url}/v1/files", headers=server.headers,
                   files={"file": ("big.jsonl", too_big)}, data={"purpose": "user_data"},
                   timeout=60)  # fmt: skip
    assert r.status_code == 507, r.text
    err = r.json()["error"]
    assert err["param"] == "file" and err["code"] == "insufficient_storage"
    assert "disk is full" in err["message"]
    assert _leftovers(data) == []
    assert [f.id for f in client.files.list()] == [batch_input.id]

    # Fill the disk up to a little room: the batch starts, its outputs cannot all be stored.
    filler = data / "filler.bin"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, _free(data) - (48 << 10)))
    batch = client.batches.create(
        input_file_id=batch_input.id, endpoint="/v1/completions", completion_window="24h"
    )
    done = wait(client, batch.id, timeout_s=180)
    assert done.status == "failed", done
    assert done.errors is not None and done.errors.data
    message = done.errors.data[0].message or ""
    assert "full" in message or "No space" in message, message
    kept = results(client, done.output_file_id)
    assert len(kept) < NUM_LINES  # what was committed before the disk filled, each id once
    assert all(line["response"]["status_code"] == 200 for line in kept.values())

    # Interactive serving goes on beside the full disk.
    out = client.completions.create(model=MODEL, prompt="The capital of France is",
                                    max_tokens=4, temperature=0)  # fmt: skip
    assert out.choices[0].text

    # Deleting works on the full disk too (its log needs room: the reserve's); its bytes go.
    assert client.files.delete(batch_input.id).deleted
    assert not (data / "files" / batch_input.id).exists()
    filler.unlink()
    again = client.files.create(file=("small.jsonl", b'{"a": 1}\n'), purpose="user_data")
    assert client.files.retrieve(again.id).bytes == 9
    assert (data / "reserve").stat().st_size == RESERVE_BYTES  # made again once there is room
