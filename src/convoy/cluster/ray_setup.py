"""What `convoy batch --ray` and `convoy serve --replicas` share: reach Ray, size each replica's
CPU share, build the kernels once, pass settings as plain data, say what failed in one line."""

from __future__ import annotations

import logging
import math
from typing import Any

import ray

from convoy.batch.offline_state import JobError
from convoy.cluster.options import is_local, local_cpus
from convoy.config import ServerConfig


def connect(address: str, log_level: str) -> None:
    """ray.init on `address` (a cluster's) or a Ray instance of this process (`local[:N]`)."""
    level = logging.DEBUG if log_level == "debug" else logging.WARNING
    try:
        if is_local(address):
            # NOTE: address "local" starts a new instance even where another one runs on this
            # host (/tmp/ray/ray_current_cluster): without it, ray.init would join that one.
            ray.init(
                address="local", num_cpus=local_cpus(address), include_dashboard=False,
                logging_level=level,
            )  # fmt: skip
        else:
            ray.init(address=address, logging_level=level)
    except Exception as e:  # noqa: BLE001 - no cluster there, or Ray cannot start
        raise JobError(f"could not start or reach Ray ({address}): {brief(e)}", 1) from None


def replica_cpus(replicas: int, wanted: float | None) -> float:
    """Each replica's CPUs: `wanted`, else the cluster's CPUs over the replicas (whole CPUs
    from 1 up, at most one node's). JobError (2) when the cluster cannot hold them all."""
    nodes = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]]
    total = sum(nodes)
    cpus = wanted
    if cpus is None:
        cpus = min(max(nodes, default=0.0), total / replicas)
        cpus = math.floor(cpus) if cpus >= 1 else cpus
    if cpus <= 0 or cpus * replicas > total or cpus > max(nodes, default=0.0):
        raise JobError(
            f"{replicas} replicas x {cpus:g} CPUs do not fit the cluster's CPUs"
            f" ({' + '.join(f'{n:g}' for n in nodes) or 'none'})", 2
        )  # fmt: skip
    return cpus


def threads_of(cpus: float) -> int:
    """Torch/OpenMP threads for a CPU share: its whole CPUs, at least one."""
    return max(1, math.floor(cpus))


def build_kernels(settings: ServerConfig) -> None:
    """Build the CPU kernels here, once, before the replicas start: on this machine they then
    load the cached build instead of N compilers at once (other nodes build their own)."""
    if settings.engine.cpu_kernels and not settings.engine.device.startswith("cuda"):
        from convoy import kernels

        kernels.available()


def flat_settings(config: Any) -> dict[str, Any]:
    """A nested config dataclass as the flat keywords `from_kwargs` takes: plain data."""
    flat: dict[str, Any] = {}
    for name in config.__dataclass_fields__:
        value = getattr(config, name)
        flat.update(
            flat_settings(value) if hasattr(value, "__dataclass_fields__") else {name: value}
        )
    return flat


def brief(e: BaseException) -> str:
    """What failed: the first line of a task's own error (a RayTaskError's cause; Ray adds retry
    advice after it, and the remote traceback around it), else the last line of the text."""
    if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        lines = str(e.cause).strip().splitlines()[:1]
    else:
        lines = str(e).strip().splitlines()[-1:]
    return (lines[0].strip() if lines else type(e).__name__)[:500]
