"""The names of every Prometheus series tierflow's services define, for the tests that check
what dashboards and autoscalers query against them."""

from __future__ import annotations

from gateway.metrics import GatewayMetrics
from queue_service.metrics import QueueServiceMetrics
from worker.metrics import WorkerMetrics


def defined_metric_names() -> set[str]:
    names = set()
    registries = [
        QueueServiceMetrics("primary", {"critical": 0.3}).registry,
        WorkerMetrics("primary", "w").registry,
        GatewayMetrics("primary").registry,
    ]
    for registry in registries:
        for family in registry.collect():
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
            names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names
