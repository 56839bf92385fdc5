"""The module boundaries of ARCHITECTURE.md: api -> engine -> worker -> models."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "convoy"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _violations(folder: str, banned: tuple[str, ...]) -> list[str]:
    bad = []
    for path in (SRC / folder).rglob("*.py"):
        for name in _imports(path):
            if name.split(".")[0] in banned or name.startswith(banned):
                bad.append(f"{path.name}: {name}")
    return bad


def test_engine_does_not_import_web_layers() -> None:
    assert _violations("engine", ("fastapi", "pydantic", "convoy.api", "starlette")) == []


def test_models_do_not_import_engine() -> None:
    assert _violations("models", ("convoy.engine", "convoy.api")) == []


def test_worker_does_not_import_engine() -> None:
    assert _violations("worker", ("convoy.engine", "convoy.api")) == []


def test_scheduler_and_block_manager_are_torch_free() -> None:
    for name in ("scheduler.py", "block_manager.py"):
        path = SRC / "engine" / name
        if path.exists():
            assert not any(n.split(".")[0] == "torch" for n in _imports(path)), name
