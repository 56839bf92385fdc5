"""What `convoy batch --ray` is asked to do: the job plus where and how wide to run it."""

from __future__ import annotations

from dataclasses import dataclass

from convoy.batch.offline import OfflineJob
from convoy.batch.offline_state import JobError
from convoy.cluster.engines import parse_fake_engine


@dataclass(slots=True)
class ClusterJob:
    job: OfflineJob
    address: str  # "local", "local:N" (a Ray instance in this process, N CPUs) or a cluster's
    shard_lines: int  # request lines a shard
    replicas: int = 1  # engine actors
    replica_cpus: float | None = None  # each actor's CPUs (its torch threads); None: a share
    fake_engine: str | None = None  # STEP_MS:CAP: the fake engine (tests and benches only)

    @property
    def is_local(self) -> bool:
        return is_local(self.address)

    def validate(self) -> None:
        """JobError (exit 2) for options that cannot run, before anything starts."""
        check_place(self.address, self.replica_cpus)
        if self.fake_engine is not None:
            parse_fake_engine(self.fake_engine)


def is_local(address: str) -> bool:
    """`local` or `local:N`: a Ray instance started in this process, not a cluster's address."""
    return address == "local" or address.startswith("local:")


def local_cpus(address: str) -> int | None:
    """N of `local:N`; None for `local` (every CPU) and a cluster's address."""
    _, _, cpus = address.partition(":")
    return int(cpus) if is_local(address) and cpus else None


def check_place(address: str, replica_cpus: float | None) -> None:
    """JobError (exit 2) for a --ray / --replica-cpus pair that cannot run."""
    _, _, cpus = address.partition(":")
    if is_local(address) and cpus and (not cpus.isdigit() or int(cpus) <= 0):
        raise JobError(f"--ray local:N takes a positive number of CPUs, got {address}", 2)
    if replica_cpus is not None and replica_cpus <= 0:
        raise JobError(f"--replica-cpus must be positive, got {replica_cpus}", 2)
