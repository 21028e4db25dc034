"""The worker's health endpoint: the standard gRPC health service, for an orchestrator's probes.

A worker is a client of the queue service and serves no API; Kubernetes and compose still need
to ask it two questions, each a service name of ``grpc.health.v1.Health/Check``:

  ``""``        ready: attached to a queue service and not shutting down. A rolling update waits
                for a new worker to be ready before it stops the next old one.
  ``LIVENESS``  alive: the engine thread and the control thread run. A worker whose engine
                thread died holds its slot in the fleet and serves nothing; the orchestrator
                restarts it. A worker that cannot reach its queue service is alive (it dials
                again), only not ready.

The states are followed by a daemon thread every ``HEALTH_CHECK_S``, as the queue service's
own readiness is; a probe reads the last state set.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

LIVENESS = "tierflow.v1.Worker.liveness"
HEALTH_CHECK_S = 0.2
_STATUS = health_pb2.HealthCheckResponse


class HealthEndpoint:
    """Serves ``grpc.health.v1.Health`` on ``host:port`` (port 0: a free one) from its own
    small gRPC server, following ``ready`` and ``alive``."""

    def __init__(
        self, host: str, port: int, ready: Callable[[], bool], alive: Callable[[], bool]
    ) -> None:
        self._ready, self._alive = ready, alive
        self.servicer = health.HealthServicer()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="worker-health", daemon=True)

    def start(self) -> HealthEndpoint:
        self._set()
        self._server.start()
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._server.stop(grace=None)

    def _follow(self) -> None:
        while not self._stop.wait(HEALTH_CHECK_S):
            self._set()

    def _set(self) -> None:
        for service, probe in (("", self._ready), (LIVENESS, self._alive)):
            self.servicer.set(service, _STATUS.SERVING if probe() else _STATUS.NOT_SERVING)
