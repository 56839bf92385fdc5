"""`convoy batch --ray`: a batch file run by N engine actors on a Ray cluster (optional extra).

    driver (cli): IN.jsonl --plan_shards--> shards not yet done --Ray Data map_batches, a pool of
      N ShardWorker actors (one engine each, several shards in flight)--> ShardAnswers
      --PartFolder.write (check, temp, fsync, rename)--> OUT.jsonl.convoy-shards/<shard>.jsonl
      --PartFolder.merge (check all)--> OUT.jsonl (+ ERR.jsonl)

Ray is imported by driver.py alone, once `run_cluster_batch` runs: without Ray the rest of
Convoy does not change, and `--ray` is refused with the install command. Only `convoy.cli`
imports this package; it imports the Batch API's offline parts (api/batch), config and (to build
them once) the kernels.
"""

from __future__ import annotations

import os

from convoy.api.batch.offline import BatchSummary
from convoy.api.batch.offline_state import JobError
from convoy.cluster.options import ClusterJob

__all__ = ["ClusterJob", "run_cluster_batch"]

INSTALL = "pip install 'convoy[ray]'"


def run_cluster_batch(cjob: ClusterJob) -> BatchSummary:
    """Run the shards of `cjob.job.input` that no earlier run finished, then merge every shard
    into the output files. JobError: 2 refused (Ray missing, bad options, foreign files), 1
    failed (rerun to resume)."""
    cjob.validate()
    if cjob.is_local:
        # NOTE: read when ray is imported: a Ray instance of this process alone is reached on
        # the loopback address, never on the host's network addresses.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        from convoy.cluster.driver import run
    except ModuleNotFoundError as e:
        if e.name != "ray" and not (e.name or "").startswith("ray."):
            raise
        raise JobError(f"--ray needs Ray, which is not installed: {INSTALL}", 2) from None
    return run(cjob)
