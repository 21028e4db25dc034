"""The queue service's Prometheus metrics (served with ``--metrics-port``).

Counted when a request ends (from its request-log record, so the metrics and the log agree):

* ``tierflow_requests_total{tier,status}``: status done, cancelled, rejected, shed, failed;
* ``tierflow_ttft_seconds{tier}`` (done requests; the buckets include every tier's SLO, so
  ``le="<slo>"`` is the count within SLO);
* ``tierflow_tbt_seconds{tier}``: every gap between two output tokens of a done request, as the
  service streamed them (one observation per token; the buckets include every TBT target);
* ``tierflow_slo_violations_total{tier}``: done over the TTFT SLO, or shed or failed;
* ``tierflow_tbt_violations_total{tier}``: done with its token gaps' p99 over the tier's
  ``tbt_slo_s`` (``queue_service.core.finished.violated_tbt``);
* ``tierflow_tokens_total{tier,served_tier,kind}``: prompt and output tokens of done requests,
  by the tier asked for and the tier that served them (they differ for a request downgraded at
  capacity; ``tierflow_requests_total``'s ``tier`` is the served one);
* ``tierflow_key_tokens_total{key,served_tier,kind}``: the same per API key label. The
  gateway sets a label only from ``config/keys.toml``, so there are at most as many as keys;
  past ``max_key_series`` labels (a caller that bypassed the edge) the rest count as
  ``other``, so no client can grow the series without bound.

Counted as it happens: ``tierflow_preemptions_total{tier,kind}`` (kind ``kept``: the state stays
for a resume; ``dropped``: recomputed later) and ``tierflow_preemption_latency_seconds`` (signal
to stop, as the worker measured it). Sampled: ``tierflow_queue_depth{tier,where}`` (where
``scheduler``: waiting or suspended in the scheduler; ``kafka``: the consumer's lag plus its
buffer), ``tierflow_suspended_bytes`` (what all workers report holding), ``tierflow_workers``.
Every metric carries ``deployment``.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from queue_service.core.finished import violated_slo, violated_tbt
from tierflow.metrics import DEPLOYMENT_LABEL, latency_buckets
from tierflow.v1 import queue_pb2

_D = DEPLOYMENT_LABEL
OTHER_KEYS = "other"
_PREEMPTION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class QueueServiceMetrics:
    def __init__(
        self,
        deployment: str,
        slos_s: dict[str, float],
        tbt_slos_s: dict[str, float | None] | None = None,
        *,
        max_key_series: int = 1000,
    ) -> None:
        tbt_targets = [s for s in (tbt_slos_s or {}).values() if s]
        self.deployment = deployment
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tierflow_requests", "Requests ended, by tier and status",
            [_D, "tier", "status"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "tierflow_ttft_seconds", "Time to first token of done requests",
            [_D, "tier"], buckets=latency_buckets(slos_s.values()), registry=r,
        )  # fmt: skip
        self.tbt = Histogram(
            "tierflow_tbt_seconds", "Time between two output tokens of a done request",
            [_D, "tier"], buckets=latency_buckets(tbt_targets), registry=r,
        )  # fmt: skip
        self.violations = Counter(
            "tierflow_slo_violations", "Requests that missed their tier's TTFT SLO",
            [_D, "tier"], registry=r,
        )  # fmt: skip
        self.tbt_violations = Counter(
            "tierflow_tbt_violations", "Done requests whose token gaps' p99 missed the TBT target",
            [_D, "tier"], registry=r,
        )  # fmt: skip
        self.preemptions = Counter(
            "tierflow_preemptions", "Preemptions acknowledged by workers",
            [_D, "tier", "kind"], registry=r,
        )  # fmt: skip
        self.preemption_latency = Histogram(
            "tierflow_preemption_latency_seconds", "From the stop signal to the engine stopped",
            [_D], buckets=_PREEMPTION_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "tierflow_queue_depth", "Requests waiting, in the scheduler or still in Kafka",
            [_D, "tier", "where"], registry=r,
        )  # fmt: skip
        self.suspended_bytes = Gauge(
            "tierflow_suspended_bytes", "Bytes of suspended prefill state the workers hold",
            [_D], registry=r,
        )  # fmt: skip
        self.workers = Gauge("tierflow_workers", "Attached workers", [_D], registry=r)
        self.tokens = Counter(
            "tierflow_tokens", "Tokens of done requests, by tier asked for and tier served",
            [_D, "tier", "served_tier", "kind"], registry=r,
        )  # fmt: skip
        self.key_tokens = Counter(
            "tierflow_key_tokens", "Tokens of done requests per API key label and tier served",
            [_D, "key", "served_tier", "kind"], registry=r,
        )  # fmt: skip
        self.unjudged = Counter(
            "tierflow_admission_unjudged",
            "Requests of a tier with an overflow rule admitted without a judgement, by reason",
            [_D, "tier", "reason"], registry=r,
        )  # fmt: skip
        self.max_key_series = max_key_series
        self._keys: set[str] = set()
        for tier in slos_s:  # every series exists from the start: rate() needs a zero
            self.violations.labels(deployment, tier)
            self.tbt_violations.labels(deployment, tier)
            self.ttft.labels(deployment, tier)
            self.tbt.labels(deployment, tier)
            for where in ("scheduler", "kafka"):
                self.queue_depth.labels(deployment, tier, where)

    def admitted_unjudged(self, tier: str, reason: str) -> None:
        """Admission could not apply ``tier``'s rule (``capacity_board.unjudged_reason``)."""
        self.unjudged.labels(self.deployment, tier, reason).inc()

    def request_ended(
        self, record: queue_pb2.FinishedRequest, token_gaps_s: Sequence[float] = ()
    ) -> None:
        """``token_gaps_s``: the gaps the record's ``tbt_p99_ms`` was taken from."""
        d, tier = self.deployment, record.tier
        self.requests.labels(d, tier, record.status).inc()
        if record.status == "done":
            self._count_tokens(record)
            self.ttft.labels(d, tier).observe(record.ttft_ms / 1000)
            tbt = self.tbt.labels(d, tier)
            for gap in token_gaps_s:
                tbt.observe(gap)
        if violated_slo(record):
            self.violations.labels(d, tier).inc()
        if violated_tbt(record):
            self.tbt_violations.labels(d, tier).inc()

    def _count_tokens(self, record: queue_pb2.FinishedRequest) -> None:
        d, served = self.deployment, record.tier
        if len(self._keys) < self.max_key_series:
            self._keys.add(record.key_id)
        key = record.key_id if record.key_id in self._keys else OTHER_KEYS
        for kind, n in (("prompt", record.prompt_tokens), ("output", record.output_tokens)):
            self.tokens.labels(d, record.requested_tier or served, served, kind).inc(n)
            self.key_tokens.labels(d, key, served, kind).inc(n)

    def preempted(self, tier: str, latency_s: float, state_dropped: bool) -> None:
        kind = "dropped" if state_dropped else "kept"
        self.preemptions.labels(self.deployment, tier, kind).inc()
        self.preemption_latency.labels(self.deployment).observe(latency_s)

    def sample(
        self,
        scheduler_depth: dict[str, int],
        kafka_depth: dict[str, int],
        suspended_bytes: int,
        workers: int,
    ) -> None:
        """Called on the service's loop every few hundred milliseconds."""
        d = self.deployment
        for where, depths in (("scheduler", scheduler_depth), ("kafka", kafka_depth)):
            for tier, n in depths.items():
                self.queue_depth.labels(d, tier, where).set(n)
        self.suspended_bytes.labels(d).set(suspended_bytes)
        self.workers.labels(d).set(workers)
