"""One local multi-node Ray cluster for the session: Ray's start-up is paid once.

`ray.cluster_utils.Cluster` runs a head (no CPUs: nothing of the job runs there) and two worker
nodes as separate raylets on this machine, each declaring 2 logical CPUs (declared, not real:
the fake engine sleeps, so 4 actors fit a 2-core host). Every address is on the loopback
interface (Ray's single-host mode, set before ray is imported). Jobs connect to it with
`--ray ADDRESS`, as a user's would; a test may remove and add worker nodes.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

# Read when ray is imported (here, and by every job this session starts): loopback addresses only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

def require_ray(module: str = "ray") -> ModuleType:
    """`module` imported; the test skips only when Ray is not installed at all. An error inside
    an installed Ray (a broken dependency, a bad wheel) fails the test instead of hiding it, as
    `pytest.importorskip` would (it skips on any ImportError)."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("the ray extra is not installed", allow_module_level=True)
    return importlib.import_module(module)


NODE_CPUS = 2
NUM_NODES = 2


@pytest.fixture(scope="session")
def cluster() -> Iterator[Any]:
    cluster_utils = require_ray("ray.cluster_utils")
    ray_cluster = cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    try:
        for _ in range(NUM_NODES):
            ray_cluster.add_node(num_cpus=NODE_CPUS)
        ray_cluster.wait_for_nodes()
        yield ray_cluster
    finally:
        ray_cluster.shutdown()
