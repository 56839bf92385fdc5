"""The kernel builder on tiny C++ sources (no torch headers: about a second a build).

What it must do: report a compile error as an error, never as "no kernels"; not wait on anything a
killed build left behind; run the ninja installed with this Python; let two processes that want
the same library at once both get it, built once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from convoy.kernels import builder
from convoy.kernels.builder import KernelBuildError, NoCompilerError, _build_library

needs_compiler = pytest.mark.skipif(not builder.has_compiler(), reason="no C++ compiler")

GOOD = 'extern "C" int convoy_test_answer() { return 42; }\n'
BAD = 'extern "C" int convoy_test_answer() { return convoy_undeclared_name; }\n'


def _source(tmp_path: Path, text: str, name: str = "tiny.cpp") -> Path:
    path = tmp_path / "src" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def _answer(lib: Path) -> int:
    return int(ctypes.CDLL(str(lib)).convoy_test_answer())


def _entries(root: Path) -> list[str]:
    """What a cache root holds besides its lock files."""
    return sorted(p.name for p in root.iterdir() if p.name != builder.LOCK_DIR)


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".build-"))


@needs_compiler
def test_builds_into_the_cache_root_once_then_reuses_it(tmp_path, monkeypatch) -> None:
    src, root = _source(tmp_path, GOOD), tmp_path / "cache"
    lib = _build_library("tiny", [src], root)
    assert lib.parent == root and lib.suffix == ".so" and _answer(lib) == 42
    assert _entries(root) == [lib.name]  # the build directory is gone
    other = _build_library("tiny", [src], root, cflags=["-O1"])  # flags are part of the name
    assert other != lib and other.is_file()

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt a library that is in the cache")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_build)
    assert _build_library("tiny", [src], root) == lib


@needs_compiler
def test_compile_error_raises_with_the_compiler_output(tmp_path) -> None:
    root = tmp_path / "cache"
    with pytest.raises(KernelBuildError, match="convoy_undeclared_name"):
        _build_library("broken", [_source(tmp_path, BAD)], root)
    assert _entries(root) == []  # no library, no build directory


@needs_compiler
def test_failed_kernel_build_is_an_error_not_a_silent_fallback(
    tmp_path, monkeypatch, caplog
) -> None:
    """The real entry points on a broken csrc/: build() raises, available() logs an ERROR."""
    _source(tmp_path, BAD, "broken_kernel.cpp")
    monkeypatch.setattr(builder, "CSRC", tmp_path / "src")
    monkeypatch.setattr(builder, "_loaded", None)
    monkeypatch.setenv("CONVOY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CONVOY_CPU_KERNELS", raising=False)
    with pytest.raises(KernelBuildError, match="convoy_undeclared_name"):
        builder.build()
    with caplog.at_level(logging.WARNING, logger=builder.__name__):
        assert builder.available.__wrapped__() is False
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "convoy_undeclared_name" in errors[0].getMessage()


@needs_compiler
def test_leftovers_of_a_killed_build_do_not_block_a_new_one(tmp_path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    (root / "lock").touch()  # torch's lock, were the cache root its build directory
    for name in (".build-tiny-killed", ".build-tiny-old", "tiny"):  # ours, old ours, torch-style
        (root / name).mkdir()
        (root / name / "lock").touch()
        (root / name / "tiny.o").write_bytes(b"\x7fELF half-written")
    old = time.time() - 3 * 24 * 3600
    os.utime(root / ".build-tiny-old", (old, old))
    result: list[Path] = []
    thread = threading.Thread(
        target=lambda: result.append(_build_library("tiny", [_source(tmp_path, GOOD)], root)),
        daemon=True,  # should it hang, the test fails instead of hanging too
    )
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the build waited on a killed build's leftovers"
    assert result and _answer(result[0]) == 42
    # a fresh leftover may be a build running in another process: kept; an old one is swept
    assert _leftovers(root) == [".build-tiny-killed"]


@needs_compiler
def test_build_runs_this_pythons_ninja_not_the_first_on_path(tmp_path, monkeypatch) -> None:
    import ninja  # a dependency: the build must not need a system ninja

    assert (Path(ninja.BIN_DIR) / "ninja").is_file() or (
        Path(sys.executable).parent / "ninja"
    ).is_file()
    fake = tmp_path / "bin"
    fake.mkdir()
    marker = tmp_path / "wrong-ninja-ran"
    (fake / "ninja").write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    (fake / "ninja").chmod(0o755)
    path = f"{fake}{os.pathsep}{os.environ['PATH']}"
    monkeypatch.setenv("PATH", path)
    lib = _build_library("tiny", [_source(tmp_path, GOOD)], tmp_path / "cache")
    assert _answer(lib) == 42
    assert not marker.exists()
    assert os.environ["PATH"] == path  # restored after the build


# NOTE: builder.py loaded by path: a leaf module, no need to import all of convoy in the children.
_CHILD = """
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("kernel_builder", sys.argv[4])
builder = importlib.util.module_from_spec(spec)
spec.loader.exec_module(builder)
src, root, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
import logging
logging.basicConfig(level=logging.INFO)  # stderr: "built tiny in ..." from the one that builds
(root / f"ready-{me}").touch()
while not (root / "go").exists():
    time.sleep(0.01)
print(builder._build_library("tiny", [src], root / "kernels"))
"""


@needs_compiler
def test_two_processes_building_at_once_both_succeed_with_one_build(tmp_path) -> None:
    src, root = _source(tmp_path, GOOD), tmp_path / "cache"
    root.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(src), str(root), str(i), builder.__file__],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while not all((root / f"ready-{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
                p.communicate() for p in procs if p.poll() is not None
            ]
            time.sleep(0.05)
        (root / "go").touch()  # both start building now
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(paths) == 1
    lib = Path(paths.pop())
    assert _answer(lib) == 42
    assert _entries(root / "kernels") == [lib.name]
    builds = [err.count("built tiny in") for _, err in outs]
    assert sorted(builds) == [0, 1], outs  # the second waited for the first's library


def test_without_a_compiler_one_warning_and_no_build(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.delenv("CONVOY_CPU_KERNELS", raising=False)
    assert not builder.has_compiler()
    with pytest.raises(NoCompilerError):
        _build_library("tiny", [_source(tmp_path, GOOD)], tmp_path / "cache")
    with caplog.at_level(logging.INFO, logger=builder.__name__):
        assert builder.available.__wrapped__() is False
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++ / g++ there
    assert not builder.has_compiler()


def test_disabled_by_env_without_building(monkeypatch) -> None:
    def no_build() -> None:
        raise AssertionError("built although CONVOY_CPU_KERNELS=0")

    monkeypatch.setattr(builder, "build", no_build)
    monkeypatch.setenv("CONVOY_CPU_KERNELS", "0")
    assert builder.available.__wrapped__() is False


@needs_compiler
def test_a_changed_header_rebuilds(tmp_path) -> None:
    header = _source(tmp_path, "#define CONVOY_TEST_ANSWER 42\n", "answer.h")
    src = _source(
        tmp_path,
        '#include "answer.h"\nextern "C" int convoy_test_answer() { return CONVOY_TEST_ANSWER; }\n',
    )
    root = tmp_path / "cache"
    lib = _build_library("tiny", [src], root)
    assert _answer(lib) == 42
    header.write_text("#define CONVOY_TEST_ANSWER 43\n")
    rebuilt = _build_library("tiny", [src], root)
    assert rebuilt != lib and _answer(rebuilt) == 43


_HOLDER = """
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("kernel_builder", sys.argv[2])
builder = importlib.util.module_from_spec(spec)
spec.loader.exec_module(builder)
with builder._build_lock(Path(sys.argv[1])):
    print("holding", flush=True)
    time.sleep(600)
"""


@needs_compiler
def test_a_build_killed_while_holding_the_lock_blocks_no_one(tmp_path) -> None:
    src, root = _source(tmp_path, GOOD), tmp_path / "cache"
    final = _build_library("tiny", [src], root)  # the library's name, then it is gone
    final.unlink()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(final), builder.__file__],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        result: list[Path] = []
        thread = threading.Thread(
            target=lambda: result.append(_build_library("tiny", [src], root)), daemon=True
        )
        thread.start()
        thread.join(timeout=1)
        assert thread.is_alive() and not result  # waits while a live build holds the lock
        holder.kill()  # kill -9: the kernel drops its lock
        thread.join(timeout=120)
        assert not thread.is_alive() and result == [final] and _answer(final) == 42
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize(
    ("cap", "flags", "isa"),
    [
        ("AVX512", {"avx512_vnni", "avx512vl", "avx512bw", "avx_vnni"}, "avx512vnni"),
        ("AVX512", {"avx512vl", "avx512bw"}, "avx512"),
        ("AVX2", {"avx2", "avx_vnni"}, "avxvnni"),
        ("AVX2", {"avx2"}, "avx2"),
        ("DEFAULT", set(), "generic"),
    ],
)
def test_the_build_follows_the_cpu(monkeypatch, cap: str, flags: set, isa: str) -> None:
    """The kernels are built for the best instruction set the CPU has: AVX-VNNI's dot products
    where a CPU without AVX-512 has them."""
    monkeypatch.delenv(builder.ISA_ENV, raising=False)
    monkeypatch.setattr(builder.torch.backends.cpu, "get_cpu_capability", lambda: cap)
    monkeypatch.setattr(builder, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(builder, "_compiles_avx_vnni", lambda cxx: True)
    assert builder.isa() == isa


def test_a_compiler_without_avx_vnni_builds_the_avx2_kernels(tmp_path, monkeypatch) -> None:
    """An AVX-VNNI CPU with a compiler that lacks -mavxvnni (GCC before 11) gets the AVX2 build,
    not a failed one; a compiler that has it, the AVX-VNNI build."""
    if not builder.has_compiler():
        pytest.skip("no C++ compiler")
    real = builder._compiler()
    old = tmp_path / "old-c++"
    old.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = -mavxvnni ] && { echo "unknown option" >&2; exit 1; }; done\n'
        f'exec {real} "$@"\n'
    )
    old.chmod(0o755)
    monkeypatch.delenv(builder.ISA_ENV, raising=False)
    monkeypatch.setattr(builder.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(builder, "_cpu_flags", lambda: {"avx2", "avx_vnni"})
    monkeypatch.setenv("CXX", str(old))
    assert builder.isa() == "avx2"
    monkeypatch.setenv("CXX", str(real))
    assert builder.isa() == "avxvnni"
