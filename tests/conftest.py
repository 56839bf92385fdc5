from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def cpu_kernels() -> None:
    """The C++ CPU kernels, built and loaded. Skips only without a C++ compiler or with
    CONVOY_CPU_KERNELS=0; with a compiler a failed build is an error (its output in the report)."""
    from convoy import kernels

    if os.environ.get("CONVOY_CPU_KERNELS", "1") == "0":
        pytest.skip("CPU kernels disabled by CONVOY_CPU_KERNELS=0")
    if not kernels.has_compiler():
        pytest.skip("no C++ compiler")
    kernels.build()
