"""Ray is optional: without it `convoy batch --ray` is refused with the install command, and the
cluster flags are refused without --ray. Runs whether or not the ray extra is installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# A Python in which `import ray` fails, as where the extra is not installed.
NO_RAY = "import sys; sys.modules['ray'] = None; from convoy.cli import main; main(sys.argv[1:])"


def _batch(tmp_path: Path, *args: str, python: list[str]) -> subprocess.CompletedProcess[str]:
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n')
    cmd = [*python, "batch", "-i", str(inp), "-o", str(tmp_path / "out.jsonl"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_ray_flag_without_ray_installed_exits_2_with_the_install_command(tmp_path: Path) -> None:
    done = _batch(tmp_path, "--ray", "local:2", python=[sys.executable, "-c", NO_RAY])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--ray needs Ray, which is not installed: pip install 'convoy[ray]'" in done.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_cluster_flags_need_ray(tmp_path: Path) -> None:
    done = _batch(tmp_path, "--replicas", "2", python=[sys.executable, "-m", "convoy.cli"])
    assert done.returncode == 2 and "--replicas needs --ray" in done.stderr
    assert not (tmp_path / "out.jsonl").exists()
