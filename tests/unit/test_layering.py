"""The module boundaries of docs/architecture.md, read from the source tree itself.

Layers, lowest first (a module may import its own layer and the ones below it, never above):

    structured (imports no other layer)
    common (config, model_config, sampling_params, outputs: structured only)
    kernels (imports no other layer)
    models -> worker -> engine -> api -> batch -> app -> entry points (llm, cli, __init__)
    api: wire types, serving objects, HTTP helpers; batch: the Batch API's job engine (it runs
    lines through api's serving objects); app: api/server.py and api/routes/ (the HTTP app,
    over api and batch)
    cluster (`convoy batch --ray`, `convoy serve --replicas`): between app and the entry points;
    only cli imports it, and it imports only batch (with api/protocol_batch's constants, and
    api/server: the replicas' app), common and kernels

Every file under src/convoy is classified (a new package or top-level module must be added
here), every import counts (top level, inside functions, under TYPE_CHECKING), and the module
graph has no cycles at all.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "convoy"

COMMON = {"config", "model_config", "sampling_params", "outputs"}
ENTRY = {"__init__", "llm", "cli"}
PACKAGES = ["structured", "kernels", "models", "worker", "engine", "api", "batch", "cluster"]
APP = ("convoy.api.server", "convoy.api.routes")  # modules (and packages) of the app layer
RANK = {
    "structured": 0, "common": 1, "kernels": 2, "models": 3, "worker": 4, "engine": 5, "api": 6,
    "batch": 7, "app": 8, "cluster": 9, "entry": 10,
}  # fmt: skip
# Layers that may import only themselves and these (instead of the rank rule).
ONLY = {
    "structured": set(), "common": {"structured"}, "kernels": set(),
    "cluster": {"api", "batch", "app", "common", "kernels"},
}  # fmt: skip
WEB = ("fastapi", "starlette", "pydantic", "uvicorn")


def module_files() -> dict[str, Path]:
    """Every module of the package, by dotted name, found by walking the tree."""
    mods: dict[str, Path] = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 2:
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def layer_of(module: str) -> str:
    if any(module == m or module.startswith(m + ".") for m in APP):
        return "app"
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "__init__"
    if len(parts) == 2 and name in COMMON:
        return "common"
    if len(parts) == 2 and name in ENTRY:
        return "entry"
    if name in PACKAGES:
        return name
    raise AssertionError(f"{module}: not classified in the layering rules")


def imports_of(path: Path) -> set[str]:
    """Absolute names of everything `path` imports (relative imports resolved)."""
    package = list(path.relative_to(SRC).parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the convoy modules it imports (`from a import b` counts a.b when b is a module)."""
    return {
        m: {n for n in imports_of(path) if n in mods and n != m} - {"convoy"}
        for m, path in mods.items()
    }


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in edges.items():
        src_layer = layer_of(src)
        for dst in targets:
            dst_layer = layer_of(dst)
            if dst_layer == src_layer:
                continue
            allowed = ONLY.get(src_layer)
            upward = RANK[dst_layer] > RANK[src_layer]
            if upward or (allowed is not None and dst_layer not in allowed):
                bad.append(f"{src} ({src_layer}) imports {dst} ({dst_layer})")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                found.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return found


def test_every_package_has_modules_and_every_module_is_classified() -> None:
    mods = module_files()
    for pkg in PACKAGES:
        assert any(m.startswith(f"convoy.{pkg}.") for m in mods), f"convoy.{pkg} has no modules"
    for app in APP:
        assert any(m == app or m.startswith(app + ".") for m in mods), f"{app}: no such module"
    for m in mods:
        layer_of(m)  # raises for anything the rules do not know


def test_imports_point_down_the_layers() -> None:
    assert layer_violations(graph(module_files())) == []


def test_no_import_cycles() -> None:
    assert cycles(graph(module_files())) == []


def test_the_checker_catches_upward_imports_and_cycles() -> None:
    edges = {
        "convoy.models.llama": {"convoy.worker.batch"},
        "convoy.kernels.build": {"convoy.config"},
        "convoy.structured.spec": {"convoy.sampling_params"},
        "convoy.sampling_params": {"convoy.structured.spec"},  # allowed
        "convoy.engine.a": {"convoy.engine.b"},
        "convoy.engine.b": {"convoy.engine.a"},
    }
    assert len(layer_violations(edges)) == 3
    assert ["convoy.engine.a", "convoy.engine.b", "convoy.engine.a"] in cycles(edges)
    with pytest.raises(AssertionError):
        layer_of("convoy.utils.misc")


def test_engine_is_web_free_and_scheduling_is_torch_free() -> None:
    mods = module_files()
    for m, path in mods.items():
        if m.startswith("convoy.engine"):
            web = [n for n in imports_of(path) if n.split(".")[0] in WEB]
            assert web == [], m
    for m, path in mods.items():
        if m.startswith("convoy.structured"):  # the engine's scheduler holds its matchers
            assert not any(n.split(".")[0] in (*WEB, "torch") for n in imports_of(path)), m
    for name in ("scheduler", "block_manager"):
        path = mods[f"convoy.engine.{name}"]  # KeyError if renamed: update the rule
        assert not any(n.split(".")[0] == "torch" for n in imports_of(path)), name


def test_cluster_is_imported_by_the_cli_alone_and_imports_the_batch_code_alone() -> None:
    """...and the replicas of `convoy serve --replicas` (cluster.serve) the server app alone."""
    edges = graph(module_files())
    for src, targets in edges.items():
        if not src.startswith("convoy.cluster"):
            assert not [t for t in targets if t.startswith("convoy.cluster")] or src in (
                "convoy.cli"
            ), src
            continue
        for dst in targets:
            if layer_of(dst) == "app":
                app = src == "convoy.cluster.serve" and dst == "convoy.api.server"
                assert app, f"{src} imports {dst}"
            elif layer_of(dst) == "api":  # the batch wire types' constants only
                assert dst == "convoy.api.protocol_batch", f"{src} imports {dst}"


def test_the_batch_job_engine_lives_outside_api() -> None:
    """api/ keeps wire types, serving and thin routes; what runs batches is convoy.batch, and
    no module of api's lower layer (middleware included) imports the routes or the job engine."""
    edges = graph(module_files())
    for src, targets in edges.items():
        if layer_of(src) == "api":
            bad = [t for t in targets if layer_of(t) in ("batch", "app")]
            assert bad == [], f"{src} imports {bad}"
    assert not any(m.startswith("convoy.api.batch") for m in module_files())
