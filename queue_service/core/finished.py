"""The request-log record of a request that ended: what `tierflow audit` and `tierflow compare`
read, and what the service's metrics count.

Lengths, timings and labels only: never the prompt, the output or the API key (``key_id`` is the
key's label, set by the gateway).
"""

from __future__ import annotations

import math
import time

from queue_service.core.live import LiveRequest, Outcome
from tierflow.v1 import queue_pb2

# The `status` values of a finished record (and of tierflow_requests_total's label).
STATUSES = ("done", "cancelled", "rejected", "shed", "failed")


def status_of(live: LiveRequest) -> str:
    if live.outcome is Outcome.REJECTED and live.shed:
        return "shed"
    return live.outcome.value


def finished_record(
    live: LiveRequest,
    now: float,
    *,
    deployment: str,
    policy: str,
    slo_s: float,
    tbt_slo_s: float | None = None,
) -> queue_pb2.FinishedRequest:
    """``now`` on the service's clock (the same as ``live``'s times)."""
    ttft_s = live.first_token_at - live.arrived_at if live.first_token_at is not None else 0.0
    n_out = len(live.output_ids)
    tbt_s = (now - live.first_token_at) / (n_out - 1) if live.first_token_at and n_out > 1 else 0.0
    wall_now = time.time()
    return queue_pb2.FinishedRequest(
        request_id=live.request_id,
        tier=live.record.tier,
        requested_tier=live.record.requested_tier,
        key_id=live.record.key_id,
        prompt_tokens=len(live.record.prompt_ids),
        output_tokens=n_out if live.outcome is Outcome.DONE else 0,
        arrival_unix_ms=live.record.arrival_unix_ms,
        finished_unix_ms=int(wall_now * 1000),
        ttft_ms=ttft_s * 1000,
        tbt_ms=tbt_s * 1000,
        preemptions=live.preemptions,
        status=status_of(live),
        deployment=deployment,
        policy=policy,
        slo_ms=slo_s * 1000,
        worker_id=live.worker_id or "",
        tbt_p99_ms=gap_p99_s(live.token_gaps_s) * 1000,
        tbt_slo_ms=(tbt_slo_s or 0.0) * 1000,
    )


def refused_record(
    record: queue_pb2.QueuedRequest,
    *,
    deployment: str,
    policy: str,
    slo_s: float,
    tbt_slo_s: float | None = None,
) -> queue_pb2.FinishedRequest:
    """The record of a request refused for load at admission, before it was queued (its tier's
    overflow rule ``reject``, or shedding): status ``shed``, nothing served. ``record.tier`` is
    the tier that refused it."""
    return queue_pb2.FinishedRequest(
        request_id=record.request_id,
        tier=record.tier,
        requested_tier=record.requested_tier,
        key_id=record.key_id,
        prompt_tokens=len(record.prompt_ids),
        arrival_unix_ms=record.arrival_unix_ms,
        finished_unix_ms=int(time.time() * 1000),
        status="shed",
        deployment=deployment,
        policy=policy,
        slo_ms=slo_s * 1000,
        tbt_slo_ms=(tbt_slo_s or 0.0) * 1000,
    )


def gap_p99_s(gaps_s: list[float]) -> float:
    """The 99th percentile (nearest rank) of a request's token gaps; 0 without any. Under 100
    gaps this is the longest: one stall a user saw is one too many for a streaming target."""
    if not gaps_s:
        return 0.0
    ordered = sorted(gaps_s)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def tbt_missed(status: str, gap_p99_s: float, tbt_slo_s: float | None) -> bool:
    """The TBT rule: a done request whose token gaps' p99 went over its tier's TBT target (a tier
    without a target never misses it; a request with under 2 tokens has no gap)."""
    return status == "done" and bool(tbt_slo_s) and gap_p99_s > tbt_slo_s


def violated_tbt(record: queue_pb2.FinishedRequest) -> bool:
    return tbt_missed(record.status, record.tbt_p99_ms / 1000, record.tbt_slo_ms / 1000)


def violated_slo(record: queue_pb2.FinishedRequest) -> bool:
    """A request the tier's SLO was not met for: done with a TTFT over the SLO, or never served
    (shed or failed). Cancelled (the client left) and invalid (rejected) requests are not."""
    if record.status == "done":
        return record.ttft_ms > record.slo_ms
    return record.status in ("shed", "failed")
