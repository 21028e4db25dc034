"""The gateway's Prometheus metrics (served with ``--metrics-port``):
``tierflow_gateway_decisions_total{deployment,tier,decision,reason}``: each ext_authz Check,
allowed (reason ``key``) or denied (reason ``no key`` / ``unknown key``, tier ``""``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from tierflow.metrics import DEPLOYMENT_LABEL


class GatewayMetrics:
    def __init__(self, deployment: str) -> None:
        self.deployment = deployment
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "tierflow_gateway_decisions",
            "ext_authz decisions by tier and reason",
            [DEPLOYMENT_LABEL, "tier", "decision", "reason"],
            registry=self.registry,
        )

    def decided(self, tier: str, allowed: bool, reason: str) -> None:
        decision = "allowed" if allowed else "denied"
        self.decisions.labels(self.deployment, tier, decision, reason).inc()
