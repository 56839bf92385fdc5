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


def test_serve_replicas_without_ray_installed_exits_2_with_the_install_command() -> None:
    cmd = [sys.executable, "-c", NO_RAY, "serve", "--replicas", "2", "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--replicas needs Ray, which is not installed: pip install 'convoy[ray]'" in done.stderr


def test_serve_replica_flags_are_checked_before_ray_starts() -> None:
    cli = [sys.executable, "-m", "convoy.cli", "serve", "--port", "0"]
    done = subprocess.run(
        [*cli, "--replica-cpus", "1"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "--replica-cpus needs --replicas or --ray" in done.stderr
    bad = [*cli, "--replicas", "2", "--ray", "local:0"]
    done = subprocess.run(bad, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--ray local:N takes a positive number of CPUs, got local:0" in done.stderr
