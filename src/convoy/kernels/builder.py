"""Build and load the C++ CPU kernels in csrc/ with torch's C++ extension builder (ninja + c++).

Built on first use into `$CONVOY_CACHE_DIR/kernels` (default ~/.cache/convoy/kernels) as one shared
library, its sources compiled as one translation unit (torch's headers parsed once), named by a
hash of its sources, flags, compiler, torch and Python versions and CPU tag; a later start only
loads that file. Every build compiles in its own temporary directory and renames
the finished library into place (atomic), and a build killed midway leaves nothing a later one
waits on (torch's own shared build directory keeps a lock file that a killed build leaves behind,
and every later build waits on it forever). Two processes that want the same library at once
build it once: the second waits on an flock that dies with its holder, then loads the first's.

The `ninja` that runs is the one installed with this Python (the `ninja` package), not whatever
PATH offers first. Without a C++ compiler the kernels are unavailable (one warning, torch path);
with one, a failed build is an error: `build()` raises `KernelBuildError` with the compiler output
and `available()` logs it at ERROR level.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
DISABLE_ENV = "CONVOY_CPU_KERNELS"  # "0": never build, the torch path everywhere
_LIB_SUFFIX = ".pyd" if os.name == "nt" else ".so"  # what torch's builder links
_TMP_PREFIX = ".build-"  # private build directories inside the cache root
LOCK_DIR = ".locks"  # inside the cache root: one lock file a library (_build_lock)
_STALE_S = 24 * 3600  # build directories older than this are leftovers of killed builds

# One build at a time in this process: the build runs with PATH/CXX set in os.environ.
_lock = threading.RLock()
_loaded: Path | None = None


class KernelBuildError(RuntimeError):
    """A C++ compiler is there but the kernels did not build or load; the message has its output."""


class NoCompilerError(RuntimeError):
    """No C++ compiler: neither `$CXX` nor `c++`/`g++` on PATH."""


def cache_dir() -> Path:
    """`$CONVOY_CACHE_DIR/kernels`, default ~/.cache/convoy/kernels."""
    root = os.environ.get("CONVOY_CACHE_DIR") or str(Path.home() / ".cache" / "convoy")
    return Path(root).expanduser() / "kernels"


def _compiler() -> str | None:
    """The C++ compiler command torch's builder would run: `$CXX`, else `c++`, else `g++`."""
    cxx = os.environ.get("CXX")
    if cxx:
        argv = shlex.split(cxx)
        return cxx if argv and shutil.which(argv[0]) else None
    for name in ("c++", "g++"):
        if shutil.which(name):
            return name
    return None


def has_compiler() -> bool:
    """True when a C++ compiler is there: `$CXX` if set, else `c++` or `g++` on PATH."""
    return _compiler() is not None


def _ninja_dirs() -> list[str]:
    """Folders holding the `ninja` installed with this Python, best first (may be empty)."""
    dirs = []
    with contextlib.suppress(ImportError):
        import ninja  # the PyPI package: its binary lives in BIN_DIR (the venv's bin/)

        if getattr(ninja, "BIN_DIR", ""):
            dirs.append(str(ninja.BIN_DIR))
    # NOTE: not resolved: a venv's bin/python is a symlink to the system interpreter.
    dirs.append(str(Path(sys.executable).parent))
    exe = "ninja.exe" if os.name == "nt" else "ninja"
    return [d for d in dict.fromkeys(dirs) if os.access(os.path.join(d, exe), os.X_OK)]


@contextlib.contextmanager
def _build_env(cxx: str) -> Iterator[None]:
    """os.environ for torch's builder (it reads PATH and CXX from there): this Python's ninja first
    on PATH, CXX set to the compiler found. Restored afterwards."""
    saved = {key: os.environ.get(key) for key in ("PATH", "CXX")}
    path = [*_ninja_dirs(), *os.environ.get("PATH", "").split(os.pathsep)]
    os.environ["PATH"] = os.pathsep.join(dict.fromkeys(p for p in path if p))
    os.environ["CXX"] = cxx
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _digest(
    name: str, sources: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str], cxx: str
) -> str:
    h = hashlib.sha256()
    parts = [
        name,
        cxx,
        torch.__version__,
        f"{sys.implementation.name}-{platform.python_version()}",
        platform.machine(),
        *cflags,
        "--ldflags",
        *ldflags,
        "one-unit",  # how the sources are compiled (_compile): inlining may cross files
    ]
    for part in parts:
        h.update(part.encode() + b"\0")
    headers = sorted({h for src in sources for h in src.parent.glob("*.h")})  # included by them
    for src in [*sources, *headers]:
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def _sweep_stale(cache_root: Path) -> None:
    """Remove build directories a killed build left behind (old ones only: a fresh one may be a
    build running in another process). Nothing waits on them either way."""
    cutoff = time.time() - _STALE_S
    for entry in cache_root.glob(f"{_TMP_PREFIX}*"):
        with contextlib.suppress(OSError):
            if entry.is_dir() and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)


def _build_library(
    name: str,
    sources: Sequence[str | Path],
    cache_root: Path,
    cflags: Sequence[str] = (),
    ldflags: Sequence[str] = (),
) -> Path:
    """Build `sources` into `cache_root/<name>-<hash>.so` unless it is there; returns that path.

    Compiles in a private temporary directory under `cache_root` and renames the library into
    place. Raises NoCompilerError without a compiler, KernelBuildError (with the compiler output)
    when the build fails. torch's builder also loads the library it built into this process.
    """
    cxx = _compiler()
    if cxx is None:
        raise NoCompilerError("no C++ compiler: set CXX or put c++/g++ on PATH")
    srcs = [Path(s).resolve() for s in sources]
    final = cache_root / f"{name}-{_digest(name, srcs, cflags, ldflags, cxx)}{_LIB_SUFFIX}"
    if final.is_file():
        return final
    cache_root.mkdir(parents=True, exist_ok=True)
    with _build_lock(final):
        if final.is_file():  # another process built it while this one waited
            return final
        return _build_into(name, srcs, cflags, ldflags, cxx, cache_root, final)


@contextlib.contextmanager
def _build_lock(final: Path) -> Iterator[None]:
    """One build of `final` at a time across processes (two test workers or servers starting at
    once each compiled the same library, minutes of both cores): an flock on a file beside it,
    which the kernel releases when its holder exits or is killed, so nothing waits on a dead
    build. Without fcntl (Windows) builds may still race; the rename keeps them both correct."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    locks = final.parent / LOCK_DIR
    locks.mkdir(exist_ok=True)
    with open(locks / f"{final.name}.lock", "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _build_into(
    name: str,
    srcs: list[Path],
    cflags: Sequence[str],
    ldflags: Sequence[str],
    cxx: str,
    cache_root: Path,
    final: Path,
) -> Path:
    _sweep_stale(cache_root)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{name}-", dir=cache_root))
    # NOTE: a fresh module name per build: torch remembers the names it built in this process and
    # skips the build of a name it has seen with the same sources (its .so would be missing here).
    module = f"{name}_{secrets.token_hex(6)}"
    start = time.monotonic()
    try:
        _compile(name, module, srcs, cflags, ldflags, cxx, tmp)
        os.replace(tmp / f"{module}{_LIB_SUFFIX}", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built %s in %.1f s: %s", name, time.monotonic() - start, final)
    return final


def _compile(
    name: str,
    module: str,
    srcs: list[Path],
    cflags: Sequence[str],
    ldflags: Sequence[str],
    cxx: str,
    build_dir: Path,
) -> None:
    """torch's extension builder in `build_dir`, with this Python's ninja first on PATH.

    The sources compile as one translation unit (a file in `build_dir` that includes each): every
    file includes torch's headers, and parsing them was half of each file's compile (the kernels:
    51 s of CPU as seven units, 22 s as one, on the 2-core development host), which a build on
    a machine's first start or a clean checkout's test run pays three times (native, avx2,
    generic). Sources must therefore not clash in their file-local names."""
    unit = build_dir / f"{module}_unit.cpp"
    unit.write_text("".join(f'#include "{src}"\n' for src in srcs))
    with _lock, _build_env(cxx):
        ninja = shutil.which("ninja")
        logger.info("building %s with %s and %s in %s", name, cxx, ninja, build_dir)
        from torch.utils.cpp_extension import load

        try:
            load(
                name=module,
                sources=[str(unit)],
                extra_cflags=list(cflags),
                extra_ldflags=list(ldflags),
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/OSError/...
            raise KernelBuildError(
                f"building {name} failed (compiler {cxx}, ninja {ninja}): {exc}"
            ) from exc


ISA_ENV = "CONVOY_CPU_ISA"  # force an instruction set (a lower one, to test its code paths)
_ISA_FLAGS = {
    "avx512vnni": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx2", "-mfma", "-mf16c"],
    "avxvnni": ["-mavxvnni", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}  # fmt: skip


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _arch_flags() -> tuple[str, list[str]]:
    forced = os.environ.get(ISA_ENV)
    if forced:
        if forced not in _ISA_FLAGS:
            raise KernelBuildError(f"{ISA_ENV}={forced!r}: expected one of {sorted(_ISA_FLAGS)}")
        return forced, _ISA_FLAGS[forced]
    cap = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    if cap.startswith("AVX512"):
        if {"avx512_vnni", "avx512vl", "avx512bw"} <= _cpu_flags():
            return "avx512vnni", _ISA_FLAGS["avx512vnni"]
        return "avx512", _ISA_FLAGS["avx512"]
    if cap == "AVX2":
        # AVX-VNNI: the ymm vpdpbusd of Intel's cores without AVX-512 (Alder Lake on), where the
        # compiler has it too (GCC 11, clang 12; an older one builds the AVX2 kernels as before)
        if "avx_vnni" in _cpu_flags() and _compiles_avx_vnni(_compiler()):
            return "avxvnni", _ISA_FLAGS["avxvnni"]
        return "avx2", _ISA_FLAGS["avx2"]
    return "generic", []


_AVX_VNNI_PROBE = """#include <immintrin.h>
__m256i f(__m256i a, __m256i b, __m256i c) { return _mm256_dpbusd_avx_epi32(a, b, c); }
"""


@functools.lru_cache(maxsize=8)
def _compiles_avx_vnni(cxx: str | None) -> bool:
    """Whether the compiler `cxx` builds AVX-VNNI's intrinsic (once a compiler a process)."""
    if cxx is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(_AVX_VNNI_PROBE)
        obj = str(Path(tmp) / "probe.o")
        cmd = [*shlex.split(cxx), *_ISA_FLAGS["avxvnni"], "-c", str(src), "-o", obj]
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=120, check=False)
        except (OSError, subprocess.SubprocessError):
            return False
    if done.returncode:
        logger.info("%s cannot build AVX-VNNI code: the kernels are built for AVX2", cxx)
    return done.returncode == 0


def isa() -> str:
    """The instruction set the kernels are (or would be) built for."""
    return _arch_flags()[0]


def _build_kernels() -> Path:
    tag, arch = _arch_flags()
    return _build_library(
        f"convoy_cpu_kernels_{tag}",
        sorted(CSRC.glob("*.cpp")),
        cache_dir(),
        cflags=["-O3", "-fopenmp", *arch],
        ldflags=["-fopenmp"],
    )


def build() -> None:
    """Build the kernels if this machine has no cached build, and load them into this process;
    `torch.ops.convoy.*` (and this package's wrappers) can be called after it.

    Raises NoCompilerError without a C++ compiler, KernelBuildError when the build or the load
    fails. Ignores CONVOY_CPU_KERNELS (that is for `available()`).
    """
    global _loaded
    with _lock:
        if _loaded is not None:
            return
        try:
            path = _build_kernels()
            try:
                torch.ops.load_library(str(path))
            except OSError as exc:  # a damaged cached file: build it again, once
                logger.warning("reloading %s failed (%s); rebuilding it", path, exc)
                path.unlink(missing_ok=True)
                path = _build_kernels()
                torch.ops.load_library(str(path))
        except (KernelBuildError, NoCompilerError):
            raise
        except Exception as exc:  # noqa: BLE001 - whatever stops the load is a build failure
            raise KernelBuildError(f"building or loading the CPU kernels failed: {exc!r}") from exc
        if not hasattr(torch.ops.convoy, "decode_attention"):
            raise KernelBuildError(f"{path} loaded but registers no torch.ops.convoy ops")
        _loaded = path
        logger.info("CPU kernels loaded from %s", path)


@functools.cache
def available() -> bool:
    """True when the kernels are built and loaded (built here on the first call); memoised.

    False, with the torch path to use instead, when CONVOY_CPU_KERNELS=0 (info log), when there
    is no C++ compiler (one warning), or when the build fails (an ERROR log with the compiler's
    output: with a compiler present that is a bug to fix, not a configuration).
    """
    if os.environ.get(DISABLE_ENV, "1") == "0":
        logger.info("CPU kernels disabled by %s=0: using the torch path", DISABLE_ENV)
        return False
    if not has_compiler():
        logger.warning("CPU kernels unavailable (no C++ compiler: CXX, c++ or g++): torch path")
        return False
    try:
        build()
    except (KernelBuildError, NoCompilerError, OSError) as exc:
        logger.error("CPU kernels failed to build, using the torch path: %s", exc)
        return False
    return True
