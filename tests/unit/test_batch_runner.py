"""BatchRunner and BatchExecutor over a fake line runner (no model, no server): crashes at each
window that matters, a ledger that cannot commit, part files shorter than their ledger.

A crash is a snapshot: at the chosen instant the data folder (SQLite files included) is copied
as it is, which is what `kill -9` at that instant would leave on disk (every write before it was
fsynced). A new runner then resumes the copy; every custom_id must be answered exactly once.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from convoy.batch import executor as executor_mod
from convoy.batch import runner as runner_mod
from convoy.batch.db import BatchDB, FileRow
from convoy.batch.executor import BatchExecutor, LedgerError, LineResult, response_line
from convoy.batch.ledger import PartFiles
from convoy.batch.lines import InputLine
from convoy.batch.runner import BatchRunner
from convoy.batch.store import BatchStore

EP = "/v1/completions"
MODEL = "m"
NUM_LINES = 150  # several flushes of FLUSH_LINES


class FakeLines:
    """A LineRunner: line i answers at once; a custom_id ending in 3 gets an error response."""

    def __init__(self) -> None:
        self.num_calls = 0
        self.gate: asyncio.Event | None = None  # when set: lines wait for it
        self.is_stuck = False  # when True: lines started from now on never finish by themselves

    async def __call__(self, line: InputLine) -> LineResult:
        self.num_calls += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.is_stuck:
            await asyncio.Event().wait()  # only a cancel ends it
        await asyncio.sleep(0)
        ok = not line.custom_id.endswith("3")
        body = json.dumps({"echo": line.custom_id})
        return LineResult(
            line.index, line.custom_id, ok, response_line(line.custom_id, 200 if ok else 400, body)
        )


@pytest.fixture(autouse=True)
def small_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Commit whatever finished at every turn of the flusher: many groups, many windows."""
    monkeypatch.setattr(executor_mod, "FLUSH_S", 0.0)


def _input(num_lines: int) -> str:
    return "".join(
        json.dumps({"custom_id": f"q{i}", "method": "POST", "url": EP,
                    "body": {"model": MODEL, "prompt": f"p{i}"}}) + "\n"
        for i in range(num_lines)
    )  # fmt: skip


def _new_batch(root: Path, num_lines: int = NUM_LINES) -> str:
    db = BatchDB(root)
    text = _input(num_lines)
    db.file_path("file-in").write_text(text)
    with db.transaction() as conn:
        db.insert_file(conn, FileRow("file-in", len(text), 0, "in.jsonl", "batch"))
    batch = BatchStore(db).create(EP, "file-in", "24h", None, 3600)
    assert batch is not None
    db.close()
    return batch.id


async def _run(root: Path, lines: FakeLines | None = None, window: int = 16) -> BatchDB:
    """Open the folder, resume every unfinished batch, wait until they end."""
    db = BatchDB(root)
    runner = BatchRunner(db, BatchExecutor({EP: lines or FakeLines()}, window), MODEL, 1 << 20)
    runner.start()
    await asyncio.gather(*runner.tasks.values())
    return db


def _answers(db: BatchDB, batch_id: str) -> tuple[str, list[str]]:
    """The batch's status and the custom_ids of its output and error files together."""
    row = BatchStore(db).row(batch_id)
    assert row is not None
    ids: list[str] = []
    for column in ("output_file_id", "error_file_id"):
        if row[column] and db.file_path(row[column]).exists():
            text = db.file_path(row[column]).read_text()
            assert "\0" not in text
            ids += [json.loads(x)["custom_id"] for x in text.splitlines()]
    return row["status"], ids


def _snapshot(src: Path, dst: Path) -> None:
    if not dst.exists():  # the first time the window is reached
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("lock"))


def _crash_at(
    monkeypatch: pytest.MonkeyPatch, src: Path, dst: Path, window: str
) -> Callable[[], None]:
    """Snapshot `src` into `dst` the first time the run reaches `window`."""
    take = lambda: _snapshot(src, dst)  # noqa: E731
    if window == "appended, not committed":
        real = BatchStore.commit
        num_calls = 0

        def commit(self: BatchStore, batch_id: str, p: Any) -> None:
            nonlocal num_calls
            num_calls += 1
            if num_calls == 2:  # a later group: some lines are committed already
                take()
            real(self, batch_id, p)

        monkeypatch.setattr(BatchStore, "commit", commit)
    elif window == "committed, next group not flushed":
        real_commit = BatchStore.commit

        def commit_then(self: BatchStore, batch_id: str, p: Any) -> None:
            real_commit(self, batch_id, p)
            take()

        monkeypatch.setattr(BatchStore, "commit", commit_then)
    elif window == "renamed, not registered":
        real_fsync = runner_mod.fsync_dir

        def fsync_then(path: Path) -> None:
            real_fsync(path)
            take()

        monkeypatch.setattr(runner_mod, "fsync_dir", fsync_then)
    elif window == "finalised, folder not removed":
        real_rmtree = shutil.rmtree

        def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
            if Path(path).parent.name == "batches":  # the batch's own folder, not tmp/
                take()
            real_rmtree(path, *args, **kwargs)

        monkeypatch.setattr(runner_mod.shutil, "rmtree", rmtree)
    return take


WINDOWS = [
    "appended, not committed",
    "committed, next group not flushed",
    "renamed, not registered",
    "finalised, folder not removed",
]


@pytest.mark.parametrize("window", WINDOWS)
async def test_a_crash_at_each_window_answers_every_line_exactly_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: str
) -> None:
    root, crashed = tmp_path / "data", tmp_path / "crashed"
    batch_id = _new_batch(root)
    with monkeypatch.context() as m:
        _crash_at(m, root, crashed, window)
        db = await _run(root)
    status, ids = _answers(db, batch_id)
    db.close()
    assert status == "completed" and sorted(ids) == sorted(f"q{i}" for i in range(NUM_LINES))
    assert crashed.exists(), f"the run never reached {window!r}"
    lines = FakeLines()
    db = await _run(crashed, lines)  # the restart, on what the crash left
    status, ids = _answers(db, batch_id)
    assert status == "completed"
    assert sorted(ids) == sorted(f"q{i}" for i in range(NUM_LINES))  # each once
    if window.startswith(("renamed", "finalised")):
        assert lines.num_calls == 0  # every line was committed: none runs again
    db.close()


async def test_a_slow_ledger_holds_the_next_lines_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a commit hangs, finished lines pile up only to PENDING_LINES (plus the window):
    the feeder waits instead of running the whole batch ahead of its ledger; once the commit
    returns, every line is answered exactly once."""
    import threading

    root = tmp_path / "data"
    batch_id = _new_batch(root, 600)
    real = BatchStore.commit
    release, num_commits = threading.Event(), 0
    lines = FakeLines()
    calls_while_stuck: list[int] = []

    def commit(self: BatchStore, bid: str, p: Any) -> None:
        nonlocal num_commits
        num_commits += 1
        if num_commits == 2:  # the second commit hangs until the lines have had their chance
            release.wait(timeout=30)
        real(self, bid, p)

    async def watch() -> None:
        while num_commits < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # a long time for lines that answer at once
        calls_while_stuck.append(lines.num_calls)
        release.set()

    monkeypatch.setattr(BatchStore, "commit", commit)
    watcher = asyncio.create_task(watch())
    db = await _run(root, lines, window=8)
    await watcher
    status, ids = _answers(db, batch_id)
    assert status == "completed" and sorted(ids) == sorted(f"q{i}" for i in range(600))
    # the first group + what was pending when the second commit took it + at most the cap and
    # a window more
    bound = 2 * (executor_mod.PENDING_LINES + 8) + executor_mod.PENDING_LINES + 8
    assert calls_while_stuck and calls_while_stuck[0] <= bound < 600
    db.close()


async def test_a_ledger_that_cannot_commit_fails_the_batch_and_keeps_what_was_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "data"
    batch_id = _new_batch(root, 400)
    real = BatchStore.commit
    num_commits = 0
    lines = FakeLines()
    calls_at_failure = 0

    def commit(self: BatchStore, bid: str, p: Any) -> None:
        nonlocal num_commits, calls_at_failure
        num_commits += 1
        if num_commits == 2:
            lines.is_stuck, calls_at_failure = True, lines.num_calls  # (one flag, GIL-atomic)
            raise sqlite3.OperationalError("database or disk is full")
        real(self, bid, p)

    monkeypatch.setattr(BatchStore, "commit", commit)
    db = await _run(root, lines, window=8)
    batch = BatchStore(db).get(batch_id)
    assert batch is not None and batch.status == "failed"
    assert batch.errors is not None and batch.errors.data[0].code == "ledger_failed"
    assert "disk is full" in batch.errors.data[0].message
    _, ids = _answers(db, batch_id)
    committed = batch.request_counts.completed + batch.request_counts.failed
    assert 0 < len(ids) == committed == len(set(ids))  # the first group, whole
    # The run stopped at the failure: lines started after it never finish by themselves, so
    # the batch ended only because they were cancelled, and at most a window of them started.
    assert lines.num_calls <= calls_at_failure + 8 < 400
    assert not db.batch_dir(batch_id).exists()
    db.close()


async def test_the_executor_stops_lines_in_flight_when_a_commit_fails() -> None:
    lines = FakeLines()
    lines.gate = asyncio.Event()  # lines in flight wait: only the failed commit can end them
    failed = asyncio.Event()

    async def ledger(group: list[LineResult]) -> None:
        failed.set()
        raise OSError(28, "No space left on device")

    executor = BatchExecutor({EP: lines}, window=4)
    first = [LineResult(0, "q0", True, "x\n")]  # answered already: committed at once
    todo = (InputLine(i, i + 1, f"q{i}", "{}") for i in range(1, 100))
    with pytest.raises(LedgerError, match="No space left"):
        await asyncio.wait_for(executor.run(EP, [*first, *todo], ledger), timeout=30)
    assert failed.is_set() and lines.num_calls <= 4  # the window, never the whole input


def test_part_files_shorter_than_committed_are_an_error_never_padded(tmp_path: Path) -> None:
    out, err = tmp_path / "out.part", tmp_path / "err.part"
    out.write_bytes(b'{"a": 1}\n')
    err.write_bytes(b"")
    with pytest.raises(LedgerError, match="9 bytes but 100 were committed"):
        PartFiles(out, err, 100, 0)
    assert out.read_bytes() == b'{"a": 1}\n'  # untouched: no NUL bytes
    with pytest.raises(LedgerError, match="missing"):
        PartFiles(tmp_path / "gone.part", None, 5)


async def test_a_damaged_part_file_fails_its_batch_with_a_clear_error(tmp_path: Path) -> None:
    root, crashed = tmp_path / "data", tmp_path / "crashed"
    batch_id = _new_batch(root)
    with pytest.MonkeyPatch.context() as m:
        _crash_at(m, root, crashed, "committed, next group not flushed")
        (await _run(root)).close()
    part = crashed / "batches" / batch_id / "output.part"
    part.write_bytes(part.read_bytes()[:10])  # cut short outside Convoy
    db = await _run(crashed)
    batch = BatchStore(db).get(batch_id)
    assert batch is not None and batch.status == "failed"
    assert batch.errors is not None and "were committed" in batch.errors.data[0].message
    _, ids = _answers(db, batch_id)  # the damaged output file is left out, no NULs served
    assert ids and all(i.endswith("3") for i in ids) and len(ids) == len(set(ids))  # errors only
    assert batch.output_file_id is None
    db.close()


async def test_a_line_no_replica_can_run_fails_after_its_tries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`convoy serve --replicas`: a line is retried on replicas LINE_TRIES times, then answered
    with its 503 (it was retried forever)."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("the ray extra is not installed")
    from convoy.cluster import remote_lines  # a broken Ray import fails here, never skips

    calls: list[str] = []

    class Unavailable:  # ConvoyReplica.run_batch_line answering "my engine is unavailable"
        async def _none(self) -> None:
            return None

        def remote(self, endpoint: str, index: int, custom_id: str, body: str) -> Any:
            calls.append(custom_id)
            return self._none()

    class Handle:
        run_batch_line = Unavailable()

    monkeypatch.setattr(remote_lines, "RETRY_FIRST_S", 0.0)
    monkeypatch.setattr(remote_lines, "RETRY_MAX_S", 0.0)
    runner = remote_lines.RemoteLines("ConvoyReplica", "app", EP)
    runner._handle = Handle()
    result = await asyncio.wait_for(runner(InputLine(0, 1, "q0", "{}")), timeout=30)
    assert calls == ["q0"] * remote_lines.LINE_TRIES
    line = json.loads(result.text)
    assert not result.ok and line["response"]["status_code"] == 503
    assert "did not run on any replica" in line["response"]["body"]["error"]["message"]
