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


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (`make test` runs two workers): a module's tests stay on one worker
    (its module fixtures start once), and tests/cluster stays on one worker whole (the
    session's one Ray cluster)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/cluster/"):
                return "tests/cluster"
            return nodeid.split("::", 1)[0]

    return ByModule(config, log)
