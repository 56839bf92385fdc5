"""What `convoy batch --ray` is asked to do: the job plus where and how wide to run it."""

from __future__ import annotations

from dataclasses import dataclass

from convoy.api.batch.offline import OfflineJob
from convoy.api.batch.offline_state import JobError
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
        return self.address == "local" or self.address.startswith("local:")

    @property
    def local_cpus(self) -> int | None:
        """N of `local:N`; None for `local` (every CPU) and a cluster's address."""
        _, _, cpus = self.address.partition(":")
        return int(cpus) if self.is_local and cpus else None

    def validate(self) -> None:
        """JobError (exit 2) for options that cannot run, before anything starts."""
        _, _, cpus = self.address.partition(":")
        if self.is_local and cpus and (not cpus.isdigit() or int(cpus) <= 0):
            raise JobError(f"--ray local:N takes a positive number of CPUs, got {self.address}", 2)
        if self.replica_cpus is not None and self.replica_cpus <= 0:
            raise JobError(f"--replica-cpus must be positive, got {self.replica_cpus}", 2)
        if self.fake_engine is not None:
            parse_fake_engine(self.fake_engine)
