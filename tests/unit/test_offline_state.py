"""The state file of `convoy batch`: commits read back, a torn record cut off, foreign files refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from convoy.batch.executor import LineResult
from convoy.batch.ledger import PartFiles
from convoy.batch.offline_state import JobError, StateFile


def _files(tmp_path: Path) -> tuple[Path, Path, Path]:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("{}\n")
    return inp, out, tmp_path / "out.jsonl.convoy-state"


def _commit(state: StateFile, parts: PartFiles, results: list[LineResult]) -> None:
    parts.append(results, lambda out, err: state.commit(results, out, err))


def test_commits_are_read_back_and_a_torn_record_is_cut_off(tmp_path: Path) -> None:
    inp, out, path = _files(tmp_path)
    state = StateFile.open(path, inp, out, None)
    parts = PartFiles(out, None, state.output_bytes)  # one file: errors with the answers
    _commit(state, parts, [LineResult(1, "a", True, "A\n"), LineResult(2, None, False, "E\n")])
    _commit(state, parts, [LineResult(3, "b", True, "B\n")])
    committed = path.read_bytes()
    with open(path, "ab") as f:  # a crash in the middle of the next record
        f.write(b'{"custom_ids": ["c"], "li')
    with open(out, "ab") as f:  # ... after its line reached the output file
        f.write(b"C\n")

    again = StateFile.open(path, inp, out, None)
    assert path.read_bytes() == committed
    assert (again.custom_ids, again.lines, again.output_bytes) == ({"a", "b"}, {2}, 6)
    assert again.is_done("a", 9) and again.is_done(None, 2)
    assert not again.is_done("c", 4) and not again.is_done(None, 3)
    PartFiles(out, None, again.output_bytes)
    assert out.read_text() == "A\nE\nB\n"  # the uncommitted line is gone: it runs again


def test_another_jobs_state_and_foreign_outputs_are_refused(tmp_path: Path) -> None:
    inp, out, path = _files(tmp_path)
    err = tmp_path / "err.jsonl"
    StateFile.open(path, inp, out, None)
    with pytest.raises(JobError, match="records another job") as refused:
        StateFile.open(path, inp, out, err)  # the same output, now with an error file
    assert refused.value.exit_code == 2

    path.unlink()
    out.write_text("not ours\n")
    with pytest.raises(JobError, match="was not written by `convoy batch`"):
        StateFile.open(path, inp, out, None)
    assert out.read_text() == "not ours\n" and not path.exists()


def test_an_output_shorter_than_recorded_is_refused(tmp_path: Path) -> None:
    inp, out, path = _files(tmp_path)
    state = StateFile.open(path, inp, out, None)
    _commit(state, PartFiles(out, None, 0), [LineResult(1, "a", True, "A\n")])
    out.write_text("")
    with pytest.raises(JobError, match="shorter than"):
        StateFile.open(path, inp, out, None)
