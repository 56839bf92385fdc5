"""Processes that run no model import neither torch nor transformers (~5 s a process here):
`import convoy` (the CLI's argument checks), and what a `convoy batch --ray` driver and a
fake-engine actor load (the Batch API's offline job, the shard worker)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers")


@pytest.mark.parametrize(
    "modules",
    [
        ["convoy", "convoy.cli"],
        ["convoy.cluster.worker", "convoy.cluster.engines", "convoy.batch.offline"],
        ["convoy.structured.compiler", "convoy.api.tool_format"],
    ],
)
def test_importing_these_loads_no_torch_or_transformers(modules: list[str]) -> None:
    code = (
        f"import sys\nfor m in {modules!r}: __import__(m)\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", f"{modules} imported {done.stdout.strip()}"
