"""The Batch API's durable pieces without a server: the part files' crash rule, the ledger's
status moves, and the input file's one-pass validation."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from convoy.batch import lines as lines_mod
from convoy.batch.db import BatchDB, DataDirBusy, FileRow
from convoy.batch.executor import LineResult
from convoy.batch.ledger import PartFiles
from convoy.batch.lines import InputLine, request_lines, validate
from convoy.batch.store import BatchStore, Progress

EP = "/v1/completions"


def _result(i: int, ok: bool) -> LineResult:
    return LineResult(i, f"c{i}", ok, json.dumps({"custom_id": f"c{i}", "ok": ok}) + "\n")


def test_part_files_cut_uncommitted_bytes_on_reopen(tmp_path: Path) -> None:
    out, err = tmp_path / "out.part", tmp_path / "err.part"
    recorded: list[tuple[int, int]] = []
    parts = PartFiles(out, err, 0, 0)
    parts.append([_result(0, True), _result(1, False)], lambda o, e: recorded.append((o, e)))
    committed = recorded[-1]
    assert committed == (out.stat().st_size, err.stat().st_size) and all(committed)
    with open(out, "ab") as f:  # a crash after the append, before the ledger recorded it
        f.write(b'{"custom_id": "c2", "half')
    parts = PartFiles(out, err, *committed)
    assert out.stat().st_size == committed[0]
    parts.append([_result(2, True)], lambda o, e: recorded.append((o, e)))
    ids = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]
    assert ids == ["c0", "c2"]


def _db_with_file(tmp_path: Path, text: str) -> tuple[BatchDB, str]:
    db = BatchDB(tmp_path / "data")
    db.file_path("file-1").write_text(text)
    with db.transaction() as conn:
        db.insert_file(conn, FileRow("file-1", len(text), 0, "in.jsonl", "batch"))
    return db, "file-1"


def test_one_process_per_data_dir(tmp_path: Path) -> None:
    db = BatchDB(tmp_path / "data")
    with pytest.raises(DataDirBusy):
        BatchDB(tmp_path / "data")
    db.close()
    BatchDB(tmp_path / "data").close()  # free again once the holder closed it


def test_store_moves_are_compare_and_set(tmp_path: Path) -> None:
    db, file_id = _db_with_file(tmp_path, "{}\n")
    store = BatchStore(db)
    assert store.create(EP, "file-missing", "24h", None, 60) is None
    batch = store.create(EP, file_id, "24h", {"k": "v"}, 60)
    assert batch is not None and batch.expires_at == batch.created_at + 60
    assert db.file_in_use(file_id)
    assert store.move(batch.id, "in_progress", ["validating"], total=3)
    assert not store.move(batch.id, "failed", ["validating"])  # it moved on already
    store.commit(batch.id, Progress([0, 2], completed=1, failed=1, output_tokens=5,
                                    output_bytes=10, error_bytes=7))  # fmt: skip
    store.commit(batch.id, Progress([2], output_bytes=10, error_bytes=7))  # a retried commit
    assert store.done_lines(batch.id) == {0, 2}
    got = store.get(batch.id)
    assert got is not None and got.request_counts.completed == 1 and got.usage.output_tokens == 5
    assert got.in_progress_at is not None and store.refresh_pending() == 1
    assert store.move(batch.id, "cancelling", ["in_progress"])
    assert db.file_in_use(file_id)  # still, until the cancel has ended
    assert store.move(batch.id, "cancelled", ["cancelling"])
    assert not db.file_in_use(file_id)
    db.close()


def _line(i: int, **change: object) -> str:
    line = {"custom_id": f"c{i}", "method": "POST", "url": EP, "body": {"prompt": "x"}}
    return json.dumps({**line, **change})


def test_validation_names_lines_and_skips_blank_ones(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([_line(0), "", "  ", _line(1, method="GET"), "[1]", _line(0)]))
    total, errors = validate(path, EP, "m", 1 << 20)
    assert total == 4
    assert [(e.line, e.code) for e in errors] == [
        (4, "invalid_method"), (5, "invalid_json_line"), (6, "duplicate_custom_id"),
    ]  # fmt: skip
    items = list(request_lines(path, EP, "m", 1 << 20))
    assert isinstance(items[0], InputLine) and items[0].index == 0 and items[0].number == 1
    path.write_text(_line(0, body={"prompt": "y" * 200}) + "\n" + _line(1) + "\n")
    total, errors = validate(path, EP, "m", 100)  # the first line is over the limit
    assert total == 2 and [(e.line, e.code) for e in errors] == [(1, "line_too_long")]
    path.write_text("\n\n")
    assert [e.code for e in validate(path, EP, "m", 100)[1]] == ["empty_file"]


def test_too_many_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lines_mod, "MAX_BATCH_LINES", 3)
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(_line(i) for i in range(5)))
    total, errors = validate(path, EP, "m", 1 << 20)
    assert total == 5 and [(e.line, e.code) for e in errors] == [
        (4, "too_many_requests"), (5, "too_many_requests"),
    ]  # fmt: skip


LINE_CASES = [
    b'{"a": 1, "body": {"x": [1, 2, {"y": "z"}]}, "body": {"q": 2}}', b"  {}  ", b"{ }",
    b"[1,2]", b'"s"', b'{"a":1,}', b'{"a" 1}', b'{"a":1} x', b'{"a":1', b"{", b"", b"{",
    b'\n{"body":{"m":"\\u00e9"}}\n', b'{"a":{"b":1}}}', b'{"a":1}{}', b'{"\xff":1}',
    b'{"a":NaN}', b'{ "body" :  {"k": 1} , "x": 2 }', b'\xef\xbb\xbf{"a":1}', b'{"a":1,',
    b"[1] 2", b'{"a":1 "b":2}', b'{"body": "text"}', b'{"body": [1, {"a": "}"}]}',
]  # fmt: skip


def _random_json(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.randint(-(10**6), 10**6) * rng.choice([1, 0.5])
    if kind in (2, 3):
        return "".join(rng.choice('ab"\\\n}{,:é\u2028 ') for _ in range(rng.randrange(6)))
    if kind == 4:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["body", "custom_id", "url", "x", 'q"}']
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def test_a_line_loads_as_json_loads_does_and_keeps_its_body_text() -> None:
    """load_line parses member by member (to keep the body's own text): the same objects and
    the same refusals as json.loads, on fixed cases and a seeded random slice."""
    rng = random.Random(29)
    randoms = []
    for _ in range(400):
        value = _random_json(rng)
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        randoms.append(text.encode())
        if rng.random() < 0.3:  # damaged: a byte cut or doubled
            cut = rng.randrange(len(text) + 1)
            randoms.append((text[:cut] + text[cut:][1:] if rng.random() < 0.5 else text[:cut]
                            + text[cut:cut + 1] + text[cut:]).encode())  # fmt: skip
    for raw in LINE_CASES + randoms:
        try:
            expected = json.loads(raw)
        except ValueError:
            expected = ValueError
        try:
            got = lines_mod.load_line(raw)
        except lines_mod.LineError:
            assert expected is ValueError or not isinstance(expected, dict), raw
            continue
        assert isinstance(expected, dict) and dict(got) == expected, raw
        if "body" in expected:
            assert got.body_text is not None and json.loads(got.body_text) == expected["body"]
        else:
            assert got.body_text is None


def test_expired_files_are_swept_except_a_running_batchs_input(tmp_path: Path) -> None:
    from convoy.batch import files

    db = BatchDB(tmp_path / "data")
    for i, expires in enumerate([100, 200, None, 100]):
        db.file_path(f"f{i}").write_bytes(b"x\n")
        with db.transaction() as conn:
            db.insert_file(conn, FileRow(f"f{i}", 2, 0, "x.jsonl", "batch", expires))
    store = BatchStore(db)
    batch = store.create(EP, "f3", "24h", None, 60)  # validating: it holds its input
    assert batch is not None
    assert files.sweep_expired(db, now=99) == []
    assert files.sweep_expired(db, now=150) == ["f0"]
    assert not db.file_path("f0").exists() and db.get_file("f0") is None
    assert store.move(batch.id, "failed", ["validating"])
    assert files.sweep_expired(db, now=10**9) == ["f1", "f3"]  # f2 never expires
    assert db.get_file("f2") is not None and db.get_file("f2").expires_at is None  # type: ignore[union-attr]
    db.close()


def test_an_older_database_gains_the_expiry_columns(tmp_path: Path) -> None:
    import sqlite3

    root = tmp_path / "data"
    root.mkdir()
    conn = sqlite3.connect(root / "convoy.db")
    conn.execute(
        "CREATE TABLE files (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL,"
        " bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, filename TEXT NOT NULL,"
        " purpose TEXT NOT NULL)"
    )
    conn.execute("INSERT INTO files (id, bytes, created_at, filename, purpose)"
                 " VALUES ('old', 1, 5, 'a', 'batch')")  # fmt: skip
    conn.commit()
    conn.close()
    db = BatchDB(root)
    old = db.get_file("old")
    assert old is not None and old.created_at == 5 and old.expires_at is None
    db.close()
