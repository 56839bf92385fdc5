"""`convoy serve --replicas N`: Convoy's own app as a Ray Serve deployment of N replicas.

    client --> Serve's HTTP proxy (--host/--port) --router--> ConvoyReplica x N
                 each: build_app(settings, replica=id) (the single-machine app, its lifespan
                 loads one engine) --> x-convoy-replica header, /metrics{replica=id}

Serve calls each replica's `check_health` every HEALTH_CHECK_PERIOD_S; it raises once the
engine has stopped (as /health answers 503), so Serve replaces that replica with a fresh one.
Replicas keep no Batch API store: those routes answer 501 (convoy.api.server). Ray is imported
here alone; convoy.cluster.serve_replicas imports this module lazily.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import ray
from ray import serve

from convoy.api.batch.offline_state import JobError
from convoy.api.server import build_app
from convoy.cluster.options import is_local
from convoy.cluster.ray_setup import (
    brief,
    build_kernels,
    connect,
    flat_settings,
    replica_cpus,
    threads_of,
)
from convoy.config import ServerConfig

logger = logging.getLogger(__name__)

APP_NAME = "convoy"
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
        name="ConvoyReplica",
        num_replicas=replicas,
        # Each replica's own queue cap answers 429; Serve's router must not queue before it.
        max_ongoing_requests=settings.max_queue_seqs,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_TIMEOUT_S,
        ray_actor_options={
            "num_cpus": cpus,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}},
        },
    )(serve.ingress()(ConvoyReplica))
    serve.start(http_options={"host": settings.host, "port": settings.port})
    app = deployment.bind(flat_settings(settings), threads)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
