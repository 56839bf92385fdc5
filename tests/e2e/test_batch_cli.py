"""`convoy batch`, as a user runs it: real subprocesses of `python -m convoy.cli batch`.

The embedded model in fp32 on the CPU (the exact mode, as the session server runs it), so a
line's greedy answer can be compared with the same request sent alone to the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from openai import OpenAI

from tests.e2e.helpers import MODEL, PROMPTS

ENGINE_ARGS = [MODEL, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "64MiB"]
RUN_TIMEOUT_S = 300
MAX_LINE_BYTES = 4096
# For the longer runs: one thread slows gracefully when a neighbour is busy (two spinning threads
# on a shared 2-core machine ran this file's 60 lines 20x slower). Not where outputs are compared
# with the session server's: its thread count must match for bit-equal fp32 sums.
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def _command(inp: Path, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "convoy.cli", "batch", "-i", str(inp), "-o", str(out), *args]


def run_cli(
    inp: Path, out: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _command(inp, out, *args), capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env
    )


def request(custom_id: str, url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}}


def completion(custom_id: str, prompt: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return request(
        custom_id, "/v1/completions", prompt=prompt, max_tokens=max_tokens, temperature=0, **extra
    )


def chat(custom_id: str, content: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    return request(
        custom_id, "/v1/chat/completions", messages=messages, max_tokens=8, temperature=0
    )


def write_jsonl(path: Path, lines: list[dict[str, Any] | str]) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_custom_id(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    ids = [line["custom_id"] for line in lines if line["custom_id"] is not None]
    assert [i for i, n in Counter(ids).items() if n > 1] == []  # each custom_id answered once
    return {line["custom_id"]: line for line in lines if line["custom_id"] is not None}


def test_mixed_file_answers_every_line_once(tmp_path: Path, client: OpenAI) -> None:
    good = [completion(f"c{k}", p) for k, p in enumerate(PROMPTS[:5])]
    good += [chat(f"h{k}", p) for k, p in enumerate(PROMPTS[5:9])]
    bad_lines: list[dict[str, Any] | str] = [
        "this is not JSON",  # line 11 (line 10 is blank)
        completion("c0", "a duplicate custom_id"),  # 12
        completion("neg", "x", max_tokens=-1),  # 13: the serving code answers 400
        {**completion("get", "x"), "method": "GET"},  # 14
        request("emb", "/v1/moderations", input="x"),  # 15
        request("stream", "/v1/completions", prompt="x", stream=True),  # 16
        completion("long", "y" * MAX_LINE_BYTES),  # 17
    ]
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    write_jsonl(inp, [*good, "   ", *bad_lines])  # a blank line is skipped, not counted
    args = ("--error-file", str(err), "--max-request-bytes", str(MAX_LINE_BYTES), *ENGINE_ARGS)
    done = run_cli(inp, out, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "9 ok, 7 errors" in done.stderr

    answers, errors = read_jsonl(out), read_jsonl(err)
    assert len(answers) + len(errors) == len(good) + len(bad_lines)
    ok = by_custom_id(answers)
    assert sorted(ok) == sorted(g["custom_id"] for g in good)
    assert {a["response"]["status_code"] for a in answers} == {200}
    failed = by_custom_id(errors)
    assert set(failed) == {"neg", "get", "emb", "stream"}  # unreadable, duplicate: custom_id null
    assert failed["neg"]["response"]["status_code"] == 400
    assert failed["neg"]["response"]["body"]["error"]["param"] == "max_tokens"
    codes = {e["error"]["code"]: e["error"]["message"] for e in errors if e["error"]}
    assert codes.keys() == {
        "invalid_json_line", "duplicate_custom_id", "invalid_method", "invalid_url",
        "invalid_request", "line_too_long",
    }  # fmt: skip
    assert codes["duplicate_custom_id"].startswith("line 12: custom_id 'c0'")  # the blank counts

    # A line's greedy answer is what the same request alone gets from the server.
    alone = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    body = ok["c0"]["response"]["body"]
    assert body["choices"][0]["text"] == alone.choices[0].text
    assert alone.usage is not None
    assert body["usage"]["completion_tokens"] == alone.usage.completion_tokens
    messages: Any = [{"role": "user", "content": PROMPTS[5]}]
    alone_chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    answer = ok["h0"]["response"]["body"]["choices"][0]["message"]["content"]
    assert answer == alone_chat.choices[0].message.content


def _committed(state: Path) -> list[dict[str, Any]]:
    """The complete commit records of a state file (a torn last line is not one yet)."""
    text = state.read_text() if state.exists() else ""
    return [json.loads(line) for line in text.splitlines(keepends=True)[1:] if line[-1] == "\n"]


def test_resume_after_kill_answers_each_line_exactly_once(tmp_path: Path) -> None:
    num_lines = 60
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    state = tmp_path / "out.jsonl.convoy-state"
    lines = [completion(f"r{k}", PROMPTS[k % 16], 16, ignore_eos=True) for k in range(num_lines)]
    write_jsonl(inp, lines)
    # 16 sequences at a time: lines finish (and commit) in waves, long before the last one.
    args = (*ENGINE_ARGS, "--max-num-seqs", "16")
    with open(tmp_path / "first.log", "wb") as log:
        proc = subprocess.Popen(
            _command(inp, out, *args), stdout=log, stderr=subprocess.STDOUT, env=ONE_THREAD
        )
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not _committed(state):
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no commit within the timeout"
            time.sleep(0.02)  # polling interval, not synchronisation
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    records = _committed(state)  # what the killed run had made durable
    done_ids = [i for r in records for i in r["custom_ids"]]
    assert 0 < len(done_ids) < num_lines
    durable = out.read_bytes()[: records[-1]["output_bytes"]]

    second = run_cli(inp, out, *args, env=ONE_THREAD)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"({num_lines - len(done_ids)} ok, 0 errors; {len(done_ids)} answered before)" in (
        second.stderr
    )
    assert out.read_bytes().startswith(durable)  # committed lines kept, not run again
    answers = by_custom_id(read_jsonl(out))
    assert sorted(answers) == sorted(f"r{k}" for k in range(num_lines))
    assert {a["response"]["body"]["usage"]["completion_tokens"] for a in answers.values()} == {16}

    before = out.read_bytes()
    third = run_cli(inp, out, *args, env=ONE_THREAD)  # the state file is kept: nothing to do
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"nothing to do: all {num_lines} lines" in third.stderr
    assert out.read_bytes() == before


def test_refuses_overlapping_or_foreign_files(tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [completion("a", "x")])
    original = inp.read_bytes()
    same = run_cli(inp, inp, *ENGINE_ARGS)
    assert same.returncode == 2
    assert "the output is the same file as the input" in same.stderr
    out = tmp_path / "out.jsonl"
    via_error = run_cli(inp, out, "--error-file", str(inp), *ENGINE_ARGS)
    assert via_error.returncode == 2
    assert "the error file is the same file as the input" in via_error.stderr
    assert inp.read_bytes() == original and not out.exists()

    out.write_text("someone else's results\n")  # no state file: not ours to truncate
    foreign = run_cli(inp, out, *ENGINE_ARGS)
    assert foreign.returncode == 2 and "was not written by `convoy batch`" in foreign.stderr
    assert out.read_text() == "someone else's results\n"

    missing = run_cli(tmp_path / "missing.jsonl", tmp_path / "o.jsonl", *ENGINE_ARGS)
    assert missing.returncode == 1 and "No such file or directory" in missing.stderr
