"""The driver of `convoy batch --ray`: plan the shards, run the missing ones on Ray, merge.

    plan_shards --> PartFolder (skip the shards with a part file) --> ray.init (local or address)
      --> kernels built here once --> Ray Data: from_items(one block per shard)
      .map_batches(ShardWorker, pool of --replicas actors) --iter_rows--> PartFolder.write
      --> PartFolder.merge

Retries are Ray's: an actor that dies (a crash, a fatal engine error, its node gone) is
restarted without limit and each of its shards sent again, up to SHARD_RETRIES times; a Python
error in a shard fails the job, and Ray Data may drop no failed block (max_errored_blocks 0).
Results come back to this process, which writes every part file: a multi-node job's output is
in one place. A job that fails keeps its part files: the same command resumes it.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings

import ray
import ray.data
from ray.util.annotations import RayDeprecationWarning

from convoy.batch.offline import BatchSummary, check_paths
from convoy.batch.offline_state import JobError
from convoy.cluster.options import ClusterJob
from convoy.cluster.parts import PartFolder
from convoy.cluster.ray_setup import (
    brief,
    build_kernels,
    connect,
    flat_settings,
    replica_cpus,
    threads_of,
)
from convoy.cluster.shards import Shard, ShardAnswer, plan_shards
from convoy.cluster.worker import FaultHooks, ShardWorker

logger = logging.getLogger(__name__)

# Times Ray sends a shard again after its actor died running it. NOTE: the tries that fail
# while Ray still sends to a dead actor's old address count too (a node's loss took 4 of them
# in the tests); a shard that kills its engine every time fails the job after this many.
SHARD_RETRIES = 20
SHARDS_IN_FLIGHT = 2  # per actor: the next shard's lines queue while one finishes


def run(cjob: ClusterJob) -> BatchSummary:
    job = cjob.job
    folder = PartFolder(job.output, job.error)
    check_paths(job, "shard folder", folder.path)
    try:
        shards = plan_shards(job.input, job.settings.max_request_bytes, cjob.shard_lines)
        folder.open()
    except OSError as e:
        raise JobError(f"{e.filename}: {e.strerror}" if e.filename else str(e), 1) from None
    todo = [s for s in shards if not folder.is_done(s)]
    total = sum(len(s.items) for s in shards)
    summary = BatchSummary(total, total - sum(len(s.items) for s in todo))
    if todo:
        _run_shards(cjob, todo, folder, summary)
    try:
        folder.merge(shards)
    except OSError as e:
        raise JobError(f"could not write the output: {e}", 1) from None
    return summary


def _run_shards(cjob: ClusterJob, todo: list[Shard], folder: PartFolder, s: BatchSummary) -> None:
    """Run `todo` on the cluster; each answer becomes its part file as it arrives."""
    connect(cjob.address, cjob.job.settings.log_level)
    try:
        cpus = replica_cpus(cjob.replicas, cjob.replica_cpus)
        if cjob.fake_engine is None:
            build_kernels(cjob.job.settings)
        start = time.perf_counter()
        by_id = {shard.id: shard for shard in todo}
        written: set[str] = set()
        for row in _answers(cjob, todo, cpus).iter_rows():
            answer = ShardAnswer.from_row(row)
            if answer.shard in written:  # at-least-once: its part file is already there
                continue
            folder.write(by_id[answer.shard], answer.text)
            written.add(answer.shard)
            s.completed += answer.completed
            s.failed += answer.failed
            s.output_tokens += answer.output_tokens
            s.seconds = time.perf_counter() - start
    except JobError:
        raise
    except OSError as e:
        raise JobError(f"could not write a part file: {e}; run again to resume", 1) from None
    except Exception as e:  # noqa: BLE001 - Ray's errors: the job failed, the parts are kept
        raise JobError(f"the Ray job failed: {brief(e)}; run again to resume", 1) from None
    finally:
        ray.shutdown()


def _answers(cjob: ClusterJob, todo: list[Shard], cpus: float) -> ray.data.Dataset:
    """The dataset of the shards' answers, one row per shard, in the order they finish."""
    context = ray.data.DataContext.get_current()
    context.max_errored_blocks = 0  # NOTE: never drop a failed shard
    context.actor_task_retry_on_errors = False  # a Python error fails the job; a crash retries
    context.raise_original_map_exception = True  # the map class's own error, not a wrapper
    context.enable_progress_bars = cjob.job.progress and sys.stderr.isatty()
    rows = [{"shard": shard.id, "payload": shard.payload()} for shard in todo]
    shards = ray.data.from_items(rows, override_num_blocks=len(rows))  # a block per shard
    threads = threads_of(cpus)
    settings = flat_settings(cjob.job.settings)
    hooks = FaultHooks.from_env().as_kwargs()
    with warnings.catch_warnings():  # Ray 2.60 names max_restarts / max_task_retries so
        warnings.simplefilter("ignore", RayDeprecationWarning)
        return shards.map_batches(
            ShardWorker, batch_size=1, batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(
                size=cjob.replicas, max_tasks_in_flight_per_actor=SHARDS_IN_FLIGHT,
                max_concurrent_calls_per_actor=SHARDS_IN_FLIGHT,
            ),
            fn_constructor_kwargs={
                "settings": settings, "fake_engine": cjob.fake_engine, "threads": threads,
                "hooks": hooks,
            },
            num_cpus=cpus, runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}},
            max_restarts=-1, max_task_retries=SHARD_RETRIES,
        )  # fmt: skip
