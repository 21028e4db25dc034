"""What every service's Prometheus metrics share: the HTTP endpoint, the deployment label, and
histogram buckets that resolve each tier's SLO.

Each service defines its own metrics in its own package (``queue_service.metrics``,
``worker.metrics``, ``gateway.metrics``) on a registry of its own, and serves it with
``serve_metrics`` on the port its configuration names (``--metrics-port``; none: no endpoint).
Every metric carries ``deployment`` (``primary``, ``canary``, ...), so the two sides of a
rollout can be told apart in one Prometheus; no metric ever carries a request id (one series
per request would grow without bound).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

DEPLOYMENT_LABEL = "deployment"
DEFAULT_DEPLOYMENT = "primary"

# Latencies from 1 ms to 10 min, about 2.5 buckets per decade; the tiers' SLOs are added.
_BASE_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
    120.0, 300.0, 600.0,
)  # fmt: skip


def latency_buckets(slos_s: Iterable[float] = ()) -> tuple[float, ...]:
    """Histogram bounds (seconds) that include every SLO exactly, so "within SLO" is one
    bucket's count (``le=<slo>``) rather than an interpolation between two."""
    bounds = {round(b, 6) for b in _BASE_LATENCY_BUCKETS}
    bounds.update(round(float(s), 6) for s in slos_s)
    return tuple(sorted(bounds))


METRICS_LOOPBACK = "127.0.0.1"  # /metrics listens here unless a deployment opens it


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port`` and ``--metrics-host``, the same for every service."""
    parser.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics (0: a free port)"
    )
    parser.add_argument(
        "--metrics-host", default=METRICS_LOOPBACK,
        help="the address metrics listen on (default loopback; 0.0.0.0 inside a private network)",
    )  # fmt: skip


class MetricsEndpoint:
    """A registry served over HTTP (``/metrics``) from a daemon thread."""

    def __init__(
        self, registry: CollectorRegistry, port: int, host: str = METRICS_LOOPBACK
    ) -> None:
        self.registry = registry
        self._server: WSGIServer
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(
    registry: CollectorRegistry, port: int | None, host: str = METRICS_LOOPBACK
) -> MetricsEndpoint | None:
    """Serve ``registry`` on ``port`` (0: any free port); None: no endpoint."""
    if port is None:
        return None
    return MetricsEndpoint(registry, port, host)
