"""Two processes converting the same GGUF into one empty cache at once both succeed, with one
whole folder left (each writes a private folder; the first rename wins, the other is dropped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from convoy.engine.tokenizer import Tokenizer
from convoy.models.gguf_convert import staging_dir

# Each process says it is ready, waits for the other (so both find the cache empty), converts.
SCRIPT = """
import logging, sys, time
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from convoy.models.resolve import resolve_model
here, there = Path(sys.argv[1]), Path(sys.argv[2])
here.touch()
deadline = time.monotonic() + 120
while not there.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
print(resolve_model("smollm2-135m-instruct").model_dir)
"""


def test_two_processes_convert_into_an_empty_cache_at_once(tmp_path: Path) -> None:
    env = {**os.environ, "CONVOY_CACHE_DIR": str(tmp_path / "cache")}
    flags = [tmp_path / "ready-0", tmp_path / "ready-1"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(flags[i]), str(flags[1 - i])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err[-3000:]
    folders = {Path(out.strip()) for out, _ in results}
    assert len(folders) == 1, folders
    logs = "".join(err for _, err in results)
    assert logs.count("first load only") == 2  # both converted
    assert "written by another process meanwhile" in logs  # and one found the other's folder
    (folder,) = folders
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp folder left
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert Tokenizer(folder).encode("Hello", add_special_tokens=False)


def test_staging_dirs_of_two_threads_never_mix(tmp_path: Path) -> None:
    """Two writers in one process (same pid) each get their own folder; both are inside their
    block before either renames, so one rename wins and the other writer's folder is dropped."""
    out = tmp_path / "converted" / "model"
    inside = threading.Barrier(2)
    errors: list[BaseException] = []

    def write(name: str) -> None:
        try:
            with staging_dir(out) as tmp:
                (tmp / "part-1").write_text(name)
                inside.wait(timeout=60)
                (tmp / "part-2").write_text(name)
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    parts = {(out / p).read_text() for p in ("part-1", "part-2")}
    assert len(parts) == 1  # one writer's whole folder, not a mix
    assert [p.name for p in out.parent.iterdir()] == ["model"]
