"""Convoy on a Ray cluster (optional extra `convoy[ray]`):

`convoy batch --ray`: a batch file run by N engine actors.

    driver (cli): IN.jsonl --plan_shards--> shards not yet done --Ray Data map_batches, a pool of
      N ShardWorker actors (one engine each, several shards in flight)--> ShardAnswers
      --PartFolder.write (check, temp, fsync, rename)--> OUT.jsonl.convoy-shards/<shard>.jsonl
      --PartFolder.merge (check all)--> OUT.jsonl (+ ERR.jsonl)

`convoy serve --replicas N`: the server's own app on N Ray Serve replicas (serve.py).

Ray is imported by driver.py and serve.py alone, once `run_cluster_batch` or `serve_replicas`
runs: without Ray the rest of Convoy does not change, and `--ray` / `--replicas` are refused with
the install command. Only `convoy.cli` imports this package; it imports the Batch API's offline
parts (convoy.batch), the server app (api/server, for the replicas), config and (to build them
once) the kernels.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from convoy.batch.offline import BatchSummary
from convoy.batch.offline_state import JobError
from convoy.cluster.options import ClusterJob, check_place, is_local
from convoy.config import ServerConfig

__all__ = ["ClusterJob", "run_cluster_batch", "serve_replicas"]

INSTALL = "pip install 'convoy[ray]'"


def run_cluster_batch(cjob: ClusterJob) -> BatchSummary:
    """Run the shards of `cjob.job.input` that no earlier run finished, then merge every shard
    into the output files. JobError: 2 refused (Ray missing, bad options, foreign files), 1
    failed (rerun to resume)."""
    cjob.validate()
    _single_host_if_local(cjob.address)
    with _needs_ray("--ray"):
        from convoy.cluster.driver import run
    return run(cjob)


def serve_replicas(
    settings: ServerConfig, address: str, replicas: int, replica_cpus: float | None
) -> None:
    """`convoy serve --replicas N`: the app on N Ray Serve replicas until SIGINT or SIGTERM.
    JobError: 2 refused (Ray missing, bad options), 1 failed."""
    check_place(address, replica_cpus)
    _single_host_if_local(address)
    with _needs_ray("--replicas"):
        from convoy.cluster.serve import run
    run(settings, address, replicas, replica_cpus)


def _single_host_if_local(address: str) -> None:
    if is_local(address):
        # NOTE: read when ray is imported: a Ray instance of this process alone is reached on
        # the loopback address, never on the host's network addresses.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@contextlib.contextmanager
def _needs_ray(flag: str) -> Iterator[None]:
    """Ray missing (the import inside fails on it): JobError 2 with the install command."""
    try:
        yield
    except ModuleNotFoundError as e:
        if e.name != "ray" and not (e.name or "").startswith("ray."):
            raise
        raise JobError(f"{flag} needs Ray, which is not installed: {INSTALL}", 2) from None
