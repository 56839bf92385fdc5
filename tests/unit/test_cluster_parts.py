"""The exactly-once bookkeeping of `convoy batch --ray`, without Ray: shards, part files, merge.

(The jobs themselves, on a Ray cluster: tests/cluster/.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from convoy.batch.executor import LineResult
from convoy.batch.lines import LineError
from convoy.batch.offline_state import JobError
from convoy.cluster.engines import fake_line
from convoy.cluster.parts import PartError, PartFolder, split_part
from convoy.cluster.shards import ShardAnswer, decode_payload, plan_shards


def _request(custom_id: str) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "x", "max_tokens": 1}})  # fmt: skip


def _input(path: Path, num: int) -> Path:
    lines = [_request(f"r{k}") for k in range(num)]
    lines[2] = "not JSON"
    path.write_text("\n".join(lines) + "\n\n")  # a blank line: not a request line
    return path


def _error(custom_id: str | None, status: int = 400) -> bytes:
    response = {"status_code": status, "body": {}} if status else None
    return json.dumps({"custom_id": custom_id, "response": response, "error": None}).encode()


def test_shards_are_line_ranges_named_by_the_input(tmp_path: Path) -> None:
    inp = _input(tmp_path / "in.jsonl", 10)
    shards = plan_shards(inp, 1 << 20, 4)
    assert [len(s.items) for s in shards] == [4, 4, 2]
    prefix = shards[0].id.split("-")[0]
    assert [s.id for s in shards] == [f"{prefix}-{a:09d}-{b:09d}" for a, b in
                                      [(1, 4), (5, 8), (9, 10)]]  # fmt: skip
    assert shards[0].custom_ids == ["r0", "r1", None, "r3"]
    assert [s.id for s in plan_shards(inp, 1 << 20, 4)] == [s.id for s in shards]  # determined
    inp.write_text(inp.read_text().replace("r9", "r99"))
    assert plan_shards(inp, 1 << 20, 4)[0].id.split("-")[0] != prefix  # another input

    items = decode_payload(shards[0].payload())  # what an actor gets: the same lines
    assert [(i.number, i.custom_id) for i in items] == [(1, "r0"), (2, "r1"), (3, None), (4, "r3")]
    assert isinstance(items[2].line, LineError) and items[2].line.code == "invalid_json_line"
    assert items[0].line == json.loads(_request("r0"))


def test_an_answer_is_written_in_line_order_and_must_answer_its_shard(tmp_path: Path) -> None:
    shard = plan_shards(_input(tmp_path / "in.jsonl", 4), 1 << 20, 4)[0]
    results = [
        LineResult(4, "r3", True, fake_line("r3")),
        LineResult(3, None, False, _error(None, 0).decode() + "\n"),
        LineResult(1, "r0", True, fake_line("r0")),
        LineResult(2, "r1", False, _error("r1").decode() + "\n"),
    ]
    answer = ShardAnswer.of(shard.id, results)
    assert (answer.completed, answer.failed) == (2, 2)
    split = split_part(shard, answer.text.encode())
    assert [ok for ok, _ in split] == [True, False, False, True]

    good = [fake_line("r0").encode().rstrip(), _error("r1"), _error(None, 0),
            fake_line("r3").encode().rstrip()]  # fmt: skip
    wrong = {
        "3 answers for 4 lines": good[:3],  # one missing
        "5 answers for 4 lines": [*good, good[0]],  # an answer twice
        "custom_id 'r1' where 'r0' belongs": [good[1], good[0], *good[2:]],
        "custom_id 'r0' where 'r1' belongs": [good[0], good[0], *good[2:]],
        "not an output line": [b"[]", *good[1:]],
    }
    for message, lines in wrong.items():
        with pytest.raises(PartError, match=message):
            split_part(shard, b"\n".join(lines) + b"\n")
    with pytest.raises(PartError, match="last line is not complete"):
        split_part(shard, b"\n".join(good))


def test_merge_writes_every_part_in_input_order(tmp_path: Path) -> None:
    shards = plan_shards(_input(tmp_path / "in.jsonl", 6), 1 << 20, 4)
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    folder = PartFolder(out, err)
    folder.open()
    texts = {s.id: "".join(fake_line(c) if c else _error(None, 0).decode() + "\n"
                           for c in s.custom_ids) for s in shards}  # fmt: skip
    folder.write(shards[1], texts[shards[1].id])
    with pytest.raises(PartError, match=f"shard {shards[0].id} has no part file"):
        folder.merge(shards)
    assert not out.exists()  # nothing half-merged
    with pytest.raises(PartError):
        folder.write(shards[0], texts[shards[1].id])  # another shard's answers: refused
    assert not folder.is_done(shards[0])
    folder.write(shards[0], texts[shards[0].id])
    folder.merge(shards)
    answered = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert answered == ["r0", "r1", "r3", "r4", "r5"]
    assert [json.loads(line)["custom_id"] for line in err.read_text().splitlines()] == [None]
    assert sorted(p.name for p in folder.path.iterdir()) == sorted(f"{s.id}.jsonl" for s in shards)


def test_outputs_not_written_by_a_ray_job_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("someone else's\n")
    with pytest.raises(JobError, match="was not written by `convoy batch --ray`") as refused:
        PartFolder(out, None).open()
    assert refused.value.exit_code == 2
    out.unlink()
    (tmp_path / "out.jsonl.convoy-state").write_text("{}\n")
    with pytest.raises(JobError, match="run without --ray"):
        PartFolder(out, None).open()
