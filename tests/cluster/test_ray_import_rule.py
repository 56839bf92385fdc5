"""The cluster tests skip only when Ray is absent: an error inside an installed Ray fails them
(pytest.importorskip skips on ModuleNotFoundError, also when it is Ray's own dependency that
is missing, which would hide a broken Ray in CI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


FILES = ["test_ray_batch.py", "test_ray_serve.py"]


def test_a_broken_ray_fails_collection_instead_of_skipping(tmp_path: Path) -> None:
    """Both Ray test files in one collection run (one pytest start): each is an error."""
    broken = tmp_path / "ray"
    broken.mkdir()
    # what a Ray wheel whose own dependency is missing raises at import
    (broken / "__init__.py").write_text("import convoy_missing_ray_dependency  # noqa\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
         *(f"tests/cluster/{f}" for f in FILES)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0, run.stdout
    assert run.stdout.count("convoy_missing_ray_dependency") >= len(FILES), run.stdout
    for f in FILES:
        assert f"ERROR tests/cluster/{f}" in run.stdout, run.stdout
    assert "skipped" not in run.stdout.splitlines()[-1]
