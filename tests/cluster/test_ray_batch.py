"""`convoy batch --ray` on the session's local Ray cluster (conftest), as a user runs it.

Each job is a `python -m convoy.cli batch ... --ray ADDRESS` subprocess. Most use the fake engine
(`--fake-engine STEP_MS:CAP`: a good line's answer is a function of its custom_id), so outputs
compare byte for byte across actor counts and faults: one actor's run is the reference, and every
other run (2 or 4 actors, an actor that exits mid-shard, a driver killed and run again, a node
removed and added back) must merge to the same output file. The last test runs the real engine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import NODE_CPUS, require_ray
from tests.e2e.helpers import MODEL, PROMPTS

require_ray()

RUN_TIMEOUT_S = 240
SHARD_LINES = 8
NUM_GOOD = 90  # + 3 bad lines: 12 shards of 8 lines
FAKE = "100:4"  # a step of 100 ms answers up to 4 lines of the actor's shards
SLOW_FAKE = "250:4"  # for the faults: the job is still running when they strike
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def _line(custom_id: str, url: str, **body: Any) -> str:
    request = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
    return json.dumps(request)


def write_input(path: Path) -> list[str]:
    """NUM_GOOD good lines over both endpoints and 3 bad ones; the custom_ids they name."""
    lines = []
    for k in range(NUM_GOOD):
        if k % 3:
            lines.append(_line(f"c{k}", "/v1/completions", prompt=PROMPTS[k % 16], max_tokens=4))
        else:
            messages = [{"role": "user", "content": PROMPTS[k % 16]}]
            lines.append(_line(f"h{k}", "/v1/chat/completions", messages=messages))
    lines.insert(40, "not JSON")  # unreadable: custom_id null
    lines.insert(60, _line("c1", "/v1/completions", prompt="x"))  # a duplicate: custom_id null
    lines.append(_line("emb", "/v1/moderations", input="x"))  # an unknown url
    path.write_text("\n".join(lines) + "\n")
    return [f"{'h' if k % 3 == 0 else 'c'}{k}" for k in range(NUM_GOOD)]


class Job:
    """One job's files in `folder`, and how to run it on the cluster."""

    def __init__(self, folder: Path, address: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.address = folder, address
        self.inp, self.out, self.err = (
            folder / "in.jsonl",
            folder / "out.jsonl",
            folder / "err.jsonl",
        )
        self.parts = folder / "out.jsonl.convoy-shards"
        self.custom_ids = write_input(self.inp)

    def command(self, replicas: int, fake: str = FAKE, cpus: int = 1) -> list[str]:
        return [
            sys.executable, "-m", "convoy.cli", "batch", "-i", str(self.inp), "-o", str(self.out),
            "--error-file", str(self.err), "--ray", self.address, "--replicas", str(replicas),
            "--replica-cpus", str(cpus), "--shard-lines", str(SHARD_LINES), "--fake-engine", fake,
            "--log-level", "warning",
        ]  # fmt: skip

    def run(
        self, replicas: int, fake: str = FAKE, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        cmd = self.command(replicas, fake)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
        assert done.returncode == 0, done.stderr[-4000:]
        return done

    def outputs(self) -> tuple[bytes, list[dict[str, Any]]]:
        """The output file's bytes and the error lines (without their random ids), after
        checking that every good custom_id is answered once, in input order."""
        answers = [json.loads(line) for line in self.out.read_text().splitlines()]
        assert [a["custom_id"] for a in answers] == self.custom_ids
        errors = [json.loads(line) for line in self.err.read_text().splitlines()]
        assert [e["custom_id"] for e in errors] == [None, None, "emb"]
        for e in errors:
            del e["id"]
        return self.out.read_bytes(), errors


def shard_calls(folder: Path) -> Counter[str]:
    """How many times the engine was given each shard (the CONVOY_TEST_SHARD_CALLS hook)."""
    return Counter({f"{f.name}.jsonl": len(f.read_text().splitlines()) for f in folder.iterdir()})


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not condition():
        assert proc.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within the timeout"
        time.sleep(0.02)  # polling interval, not synchronisation


@pytest.fixture(scope="module")
def reference(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, Any]:
    """One actor's job and its outputs: what every other run must merge to."""
    job = Job(tmp_path_factory.mktemp("reference"), cluster.address)
    done = job.run(1)
    assert f"93 lines answered ({NUM_GOOD} ok, 3 errors; 0 answered before)" in done.stderr
    assert len(list(job.parts.iterdir())) == 12
    return job, job.outputs()


def test_four_actors_merge_to_the_outputs_of_one(
    reference: tuple[Job, Any], tmp_path: Path
) -> None:
    """(2 actors are compared with 1 by the fault tests below, which run 2.)"""
    job = Job(tmp_path, reference[0].address)
    job.run(4)
    assert job.outputs() == reference[1]


def test_actor_that_exits_mid_shard_is_replaced_and_its_shards_rerun(
    reference: tuple[Job, Any], tmp_path: Path
) -> None:
    job = Job(tmp_path / "job", reference[0].address)
    marker, calls = tmp_path / "exited", tmp_path / "calls"
    calls.mkdir()
    env = {**ONE_THREAD, "CONVOY_TEST_EXIT_MARKER": str(marker),
           "CONVOY_TEST_SHARD_CALLS": str(calls)}  # fmt: skip
    job.run(2, SLOW_FAKE, env)
    assert marker.exists()  # an actor exited once, on its first answered line
    counts = shard_calls(calls)
    assert len(counts) == 12 and sum(counts.values()) > 12  # its shards in flight ran again
    assert job.outputs() == reference[1]  # and were answered once


def test_driver_killed_then_rerun_resumes_without_recomputing(
    reference: tuple[Job, Any], tmp_path: Path
) -> None:
    job = Job(tmp_path / "job", reference[0].address)
    calls = tmp_path / "calls"
    calls.mkdir()
    env = {**ONE_THREAD, "CONVOY_TEST_SHARD_CALLS": str(calls)}
    with open(tmp_path / "first.log", "wb") as log:
        proc = subprocess.Popen(job.command(2, SLOW_FAKE), stdout=log, stderr=log, env=env)
    try:
        wait_for(lambda: len(list(job.parts.glob("*.jsonl"))) >= 2, proc, "2 part files")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    done_before = {p.name: len(p.read_text().splitlines()) for p in job.parts.glob("*.jsonl")}
    assert 2 <= len(done_before) < 12 and not job.out.exists()

    second = job.run(2, SLOW_FAKE, env)
    assert f"{sum(done_before.values())} answered before" in second.stderr
    counts = shard_calls(calls)
    assert len(counts) == 12
    assert all(counts[name] == 1 for name in done_before)  # finished shards: not recomputed
    assert job.outputs() == reference[1]


def test_worker_node_removed_while_busy_then_added_back(
    cluster: Any, reference: tuple[Job, Any], tmp_path: Path
) -> None:
    job = Job(tmp_path / "job", cluster.address)
    calls = tmp_path / "calls"
    calls.mkdir()
    env = {**ONE_THREAD, "CONVOY_TEST_SHARD_CALLS": str(calls)}
    command = job.command(2, SLOW_FAKE, cpus=NODE_CPUS)  # an actor a node

    def both_actors_busy() -> bool:
        return len({pid for f in calls.iterdir() for pid in f.read_text().split()}) == 2

    with open(tmp_path / "job.log", "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=log, env=env)
    try:
        wait_for(both_actors_busy, proc, "shards on both actors")
        victim = next(iter(cluster.worker_nodes))
        cluster.remove_node(victim, allow_graceful=False)  # its actor dies mid-shard
        cluster.add_node(num_cpus=NODE_CPUS)  # where it restarts: the other node is full
        assert proc.wait(timeout=RUN_TIMEOUT_S) == 0, (tmp_path / "job.log").read_text()[-4000:]
    finally:
        proc.kill()
        proc.wait()
    assert sum(shard_calls(calls).values()) > 12  # the lost actor's shards ran again
    assert len(list(job.parts.glob("*.jsonl"))) == 12
    assert job.outputs() == reference[1]


def test_a_part_file_that_does_not_answer_its_shard_fails_the_merge(
    reference: tuple[Job, Any], tmp_path: Path
) -> None:
    job = Job(tmp_path, reference[0].address)
    shutil.copytree(reference[0].parts, job.parts)  # every shard done: nothing runs
    part = sorted(job.parts.iterdir())[3]
    lines = part.read_text().splitlines(keepends=True)
    part.write_text("".join([*lines, lines[0]]))  # one custom_id answered twice
    cmd = job.command(1)
    failed = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert f"shard {part.stem}: 9 answers for 8 lines" in failed.stderr
    assert not job.out.exists()  # (tests/unit/test_cluster_parts.py: missing, misplaced ones)


def test_real_engine_answers_as_convoy_batch_without_ray(cluster: Any, tmp_path: Path) -> None:
    """2 actors x 1 CPU of the default model in fp32: the same greedy answers, line for line, as
    `convoy batch` in one process (one thread too: fp32 sums must add up in the same order)."""
    lines = [_line(f"c{k}", "/v1/completions", model=MODEL, prompt=p, max_tokens=8, temperature=0)
             for k, p in enumerate(PROMPTS[:12])]  # fmt: skip
    lines += [
        _line(f"h{k}", "/v1/chat/completions", model=MODEL, max_tokens=8, temperature=0,
              messages=[{"role": "user", "content": p}])
        for k, p in enumerate(PROMPTS[12:])
    ]  # fmt: skip
    lines += [_line("neg", "/v1/completions", model=MODEL, prompt="x", max_tokens=-1)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    engine = [MODEL, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "64MiB"]

    def answers(out: Path, *args: str) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "convoy.cli", "batch", "-i", str(inp), "-o", str(out),
               *engine, *args]  # fmt: skip
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=ONE_THREAD
        )
        assert done.returncode == 0, done.stderr[-4000:]
        assert "16 ok, 1 errors" in done.stderr
        by_id = {}
        for line in out.read_text().splitlines():
            answer = json.loads(line)
            assert answer["custom_id"] not in by_id
            response = answer["response"]
            body = response["body"]  # its ids and timestamps differ from run to run
            by_id[answer["custom_id"]] = (
                response["status_code"],
                body.get("choices"),
                _counts(body.get("usage")),
                body.get("error"),
            )
        return by_id

    alone = answers(tmp_path / "alone.jsonl")
    on_ray = answers(
        tmp_path / "ray.jsonl", "--ray", cluster.address, "--replicas", "2",
        "--replica-cpus", "1", "--shard-lines", "5",
    )  # fmt: skip
    assert len(alone) == 17 and on_ray == alone
    assert alone["neg"][0] == 400


def _counts(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A usage without prompt_tokens_details: the prompt tokens the prefix cache served depend
    on which lines ran before on that engine (sharding changes them)."""
    if usage is None:
        return None
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
