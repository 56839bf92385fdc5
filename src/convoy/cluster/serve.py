"""`convoy serve --replicas N`: Convoy's own app as a Ray Serve deployment of N replicas, and
the Batch API's one store in one coordinator. Serve routes by the longest prefix, one per app:

    client --> Serve's HTTP proxy (--host/--port)
      /             app "convoy": ConvoyReplica x N, each build_app(settings, replica=id) (the
                    single-machine app, its lifespan loads one engine) --> x-convoy-replica
                    header, /metrics{replica=id}
      /v1/files     app "convoy-files": BatchCoordinator x 1 (build_batch_app: the data folder,
                    SQLite, the BatchRunner; pinned to this node, so --data-dir is this
                    machine's); each batch line --RemoteLines--> ConvoyReplica.run_batch_line
      /v1/batches   app "convoy-batches": BatchForwarder x 1 --handle, streamed--> coordinator
                    (batch/relay.py: the request as plain data, the answer as ASGI messages)

One store, never one per replica (which would run a batch twice). A line whose replica's engine
is gone, or whose replica died, runs again on another (remote_lines.py); the ledger commits it
once. A coordinator that dies is restarted by Serve, and its lifespan resumes unfinished batches.

Serve calls each replica's `check_health` every HEALTH_CHECK_PERIOD_S; it raises once the
engine has stopped (as /health answers 503), so Serve replaces that replica with a fresh one.
Ray is imported here alone; convoy.cluster.serve_replicas imports this module lazily.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ray
from ray import serve

from convoy.api.protocol_batch import ENDPOINTS
from convoy.api.server import build_app, build_batch_app
from convoy.batch.db import default_data_dir
from convoy.batch.executor import LineResult, LineRunner
from convoy.batch.offline_state import JobError
from convoy.batch.relay import RelayedRequest, relay_app, root_path_free, run_relayed
from convoy.batch.service import lines_in_flight, serve_line
from convoy.cluster.options import is_local
from convoy.cluster.ray_setup import (
    brief,
    build_kernels,
    connect,
    flat_settings,
    replica_cpus,
    threads_of,
)
from convoy.cluster.remote_lines import RemoteLines
from convoy.config import ServerConfig

logger = logging.getLogger(__name__)

APP_NAME = "convoy"
REPLICA = "ConvoyReplica"
FILES_APP, FILES_ROUTE, COORDINATOR = "convoy-files", "/v1/files", "BatchCoordinator"
BATCHES_APP, BATCHES_ROUTE = "convoy-batches", "/v1/batches"
# Requests in one coordinator (uploads, downloads, relayed calls) and its forwarder at a time.
BATCH_API_ONGOING = 1000
HEALTH_CHECK_PERIOD_S = 2.0  # how soon a dead engine is noticed; a check is one attribute read
# Engine shutdown (a dead engine's too) is prompt; no need for Serve's 20 s default.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 10.0
LOCAL_DRAIN_S = 1.0  # the proxy's draining period on shutdown under --ray local


class ConvoyReplica:
    """One Serve replica: the torch threads of its CPU share, and the app Serve asks for."""

    def __init__(self, settings: dict[str, Any], threads: int) -> None:
        import torch

        torch.set_num_threads(threads)  # its CPU share (OMP_NUM_THREADS is set too)
        self.settings = ServerConfig.from_kwargs(**settings)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.server: Any = None  # the app (the wrapper Serve adds owns `.app`)

    def __serve_build_asgi_app__(self) -> Any:
        """Called by Serve after __init__; Serve then runs the app's lifespan (the engine)."""
        self.server = build_app(self.settings, replica=self.replica)
        return self.server

    def check_health(self) -> None:
        """Raise when the engine has stopped: Serve then replaces this replica."""
        engine = getattr(self.server.state, "engine", None) if self.server is not None else None
        if engine is not None and not engine.is_running:
            raise RuntimeError(f"replica {self.replica}: the engine is not running")

    async def run_batch_line(
        self, endpoint: str, index: int, custom_id: str, body: str
    ) -> LineResult | None:
        """A batch line from the coordinator, in the engine's batch priority class; None when
        this engine is unavailable (the coordinator runs the line on another replica)."""
        return await serve_line(self.server.state, endpoint, index, custom_id, body)

    def served_model_name(self) -> str:
        name: str = self.server.state.client.served_model_name
        return name


class BatchCoordinator:
    """The Batch API's one store; its lines run on the ConvoyReplicas."""

    def __init__(self, settings: dict[str, Any], model: str, num_replicas: int) -> None:
        self.settings = ServerConfig.from_kwargs(**settings)
        self.model, self.num_replicas = model, num_replicas
        self.batch_app: Any = None

    def __serve_build_asgi_app__(self) -> Any:
        routes: dict[str, LineRunner] = {
            endpoint: RemoteLines(REPLICA, APP_NAME, endpoint) for endpoint in ENDPOINTS
        }
        window = lines_in_flight(self.settings, self.num_replicas)
        self.batch_app = build_batch_app(self.settings, routes, self.model, window)
        return root_path_free(self.batch_app)  # the ingress of /v1/files: full paths

    async def relay(self, request: RelayedRequest) -> AsyncIterator[dict[str, Any]]:
        """A /v1/batches request from the forwarder, answered by this app (streamed)."""
        async for message in run_relayed(self.batch_app, request):
            yield dict(message)


class BatchForwarder:
    """/v1/batches: each request to the coordinator (Serve gives each app one route prefix)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = ServerConfig.from_kwargs(**settings)

    def __serve_build_asgi_app__(self) -> Any:
        s = self.settings
        app = relay_app(self._forward, s.max_request_bytes, s.request_body_timeout)
        return root_path_free(app)

    async def _forward(self, request: RelayedRequest) -> AsyncIterator[dict[str, Any]]:
        handle = serve.get_deployment_handle(COORDINATOR, app_name=FILES_APP)
        answer: Any = handle.options(stream=True).relay.remote(request)
        is_done = False
        try:
            async for message in answer:
                yield message
            is_done = True
        finally:
            if not is_done:  # the client went away: stop the coordinator's side too
                answer.cancel()


def run(settings: ServerConfig, address: str, replicas: int, cpus: float | None) -> None:
    """Start the deployment on `address` and serve until SIGINT or SIGTERM."""
    if is_local(address):
        # Serve's proxy drains for 30 s on shutdown, for a load balancer to notice; a Ray
        # instance of this process has none in front (read by the proxy: set before it starts).
        os.environ.setdefault("RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S", str(LOCAL_DRAIN_S))
    connect(address, settings.log_level)
    try:
        _deploy(settings, replicas, replica_cpus(replicas, cpus))
        logger.info("serving %d replicas on http://%s:%d", replicas, settings.host, settings.port)
        _wait_for_signal()
        logger.info("shutting down the replicas")
        serve.shutdown()
    except JobError:
        raise
    except Exception as e:  # noqa: BLE001 - Serve could not start or deploy
        raise JobError(f"Ray Serve failed: {brief(e)}", 1) from None
    finally:
        ray.shutdown()


def _deploy(settings: ServerConfig, replicas: int, cpus: float) -> None:
    build_kernels(settings)
    threads = threads_of(cpus)
    deployment = serve.deployment(
        name=REPLICA,
        num_replicas=replicas,
        # Each replica's own queue cap answers 429; Serve's router must not queue before it.
        # Batch lines from the coordinator count here too (outside the engine's queue cap):
        # room for the whole window on top, so they never hold interactive requests back.
        max_ongoing_requests=settings.max_queue_seqs + lines_in_flight(settings, replicas),
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_TIMEOUT_S,
        ray_actor_options={
            "num_cpus": cpus,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}},
        },
    )(serve.ingress()(ConvoyReplica))
    serve.start(http_options={"host": settings.host, "port": settings.port})
    app = deployment.bind(flat_settings(settings), threads)
    handle = serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    _deploy_batch_api(settings, replicas, handle.served_model_name.remote().result())


def _deploy_batch_api(settings: ServerConfig, replicas: int, model: str) -> None:
    """The coordinator on this node (its data folder is the one named here), then its
    forwarder; the lines must name the replicas' served `model`."""
    # Resolved here: a relative path, or $CONVOY_DATA_DIR, means this process's.
    data_dir = (Path(settings.data_dir) if settings.data_dir else default_data_dir()).resolve()
    flat = flat_settings(dataclasses.replace(settings, data_dir=str(data_dir)))
    small = {"num_cpus": 0}
    coordinator = serve.deployment(
        name=COORDINATOR,
        num_replicas=1,
        max_ongoing_requests=BATCH_API_ONGOING,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,  # a dead coordinator restarts sooner
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_TIMEOUT_S,
        ray_actor_options={**small, "resources": {_this_node(): 0.001}},
    )(serve.ingress()(BatchCoordinator))
    forwarder = serve.deployment(
        name="BatchForwarder",
        num_replicas=1,
        max_ongoing_requests=BATCH_API_ONGOING,
        ray_actor_options=small,
    )(serve.ingress()(BatchForwarder))
    # both at once: `serve.run` waits ~3 s for each app (a DeveloperAPI; Ray is pinned)
    serve.run_many([
        serve.RunTarget(coordinator.bind(flat, model, replicas), FILES_APP, FILES_ROUTE),
        serve.RunTarget(forwarder.bind(flat), BATCHES_APP, BATCHES_ROUTE),
    ])  # fmt: skip


def _this_node() -> str:
    """The custom resource Ray gives the node this process runs on: `node:<its address>`."""
    node_id = ray.get_runtime_context().get_node_id()
    address = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
    return f"node:{address}"


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
