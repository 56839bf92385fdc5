"""Native CPU kernels (csrc/), compiled on first use with torch's C++ extension builder.

Built once per machine into torch's extension cache (`TORCH_EXTENSIONS_DIR`, default
~/.cache/torch_extensions); a later start only loads the library. Anything that stops the build (no
compiler, no ninja, `CONVOY_CPU_KERNELS=0`) leaves the pure-torch path in place, with one warning.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"


def _arch_flags() -> tuple[str, list[str]]:
    cap = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    if cap.startswith("AVX512"):
        return "avx512", ["-mavx512f", "-mavx2", "-mfma"]
    if cap == "AVX2":
        return "avx2", ["-mavx2", "-mfma"]
    return "generic", []


@functools.cache
def cpu_kernels_available() -> bool:
    """Build/load the kernels once; True when `torch.ops.convoy.*` can be called on the CPU."""
    if os.environ.get("CONVOY_CPU_KERNELS", "1") == "0":
        logger.info("CPU kernels disabled by CONVOY_CPU_KERNELS=0")
        return False
    try:
        from torch.utils.cpp_extension import load

        tag, flags = _arch_flags()
        load(
            name=f"convoy_cpu_kernels_{tag}",
            sources=sorted(str(p) for p in _CSRC.glob("*.cpp")),
            extra_cflags=["-O3", "-fopenmp", *flags],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("CPU kernels unavailable, using the torch path: %s", exc)
        return False
    return hasattr(torch.ops.convoy, "decode_attention")
