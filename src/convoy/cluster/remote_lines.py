"""The batch coordinator's line runner under `convoy serve --replicas`: each line on an engine
replica, through a Serve handle (Serve's router picks the replica).

    BatchExecutor --RemoteLines(line)--> ConvoyReplica.run_batch_line (run_line, batch priority)
      None (that engine is dead or stopping) | a replica gone (Ray, Serve errors)
        --> the same line again after a capped backoff, on whichever replica Serve picks
      after LINE_TRIES tries (as `convoy batch --ray` retries a shard) --> that line's 503 error

A line's result is committed once, by the coordinator's ledger, however often it was tried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray import serve
from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import RayServeException

from convoy.batch.executor import LineResult, failed_result, unavailable_result
from convoy.batch.lines import InputLine
from convoy.cluster.ray_setup import brief

logger = logging.getLogger(__name__)

RETRY_FIRST_S = 0.25
RETRY_MAX_S = 4.0  # a replaced replica loads its engine in seconds; poll no slower than this
LOG_EVERY_S = 10.0  # one warning per this many seconds however many lines wait
LINE_TRIES = 20  # then the line fails with its error (driver.SHARD_RETRIES for `--ray` shards)


class RemoteLines:
    """A LineRunner for one endpoint over the `deployment` of Serve application `app_name`."""

    def __init__(self, deployment: str, app_name: str, endpoint: str) -> None:
        self.deployment, self.app_name, self.endpoint = deployment, app_name, endpoint
        self._handle: Any = None
        self._logged_at = 0.0

    def handle(self) -> Any:
        if self._handle is None:  # fetched lazily: inside the coordinator's replica, once up
            self._handle = serve.get_deployment_handle(self.deployment, app_name=self.app_name)
        return self._handle

    async def __call__(self, line: InputLine) -> LineResult:
        delay = RETRY_FIRST_S
        for num_tries in range(1, LINE_TRIES + 1):
            why = "its engine is unavailable"
            try:
                result: LineResult | None = await self.handle().run_batch_line.remote(
                    self.endpoint, line.index, line.custom_id, line.body
                )
            except RayTaskError as e:  # a bug in the replica's code: that line's 500
                return failed_result(line, e)
            except (RayError, RayServeException) as e:  # the replica died or is unreachable
                result, why = None, f"{type(e).__name__}: {brief(e)}"
            if result is not None:
                return result
            if num_tries == LINE_TRIES:
                break
            self._warn(line, why)
            await asyncio.sleep(delay)  # backoff between tries
            delay = min(delay * 2, RETRY_MAX_S)
        message = f"the line did not run on any replica in {LINE_TRIES} tries: {why}"
        logger.error("batch line %s failed: %s", line.custom_id, message)
        return unavailable_result(line, message)

    def _warn(self, line: InputLine, why: str) -> None:
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            logger.warning(
                "batch line %s did not run on a replica (%s): retrying it", line.custom_id, why
            )
