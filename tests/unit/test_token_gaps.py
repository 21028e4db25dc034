"""Time between tokens in the operator's view: the queue service keeps the gap before each token it
streams (none for a token the client already has), the request-log record carries their p99 and
the tier's target, and the metrics count every gap and each request that missed its target."""

from __future__ import annotations

import asyncio

import pytest

from queue_service.core.finished import finished_record, gap_p99_s, violated_tbt
from queue_service.core.service_core import ServiceCore, Transport
from queue_service.metrics import QueueServiceMetrics
from queue_service.scheduler import PrefillTimePredictor, Scheduler, make_policy
from tests.tiers import UNIT_TIERS
from tests.unit.test_service_core import Handle, first, message, step, token
from tierflow.v1 import queue_pb2, worker_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_p99_of_gaps_is_the_longest_under_a_hundred_and_nearest_rank_above():
    assert gap_p99_s([]) == 0.0
    assert gap_p99_s([0.1, 0.9, 0.2]) == 0.9
    gaps = [0.01] * 198 + [0.5, 0.7]  # 200 gaps: rank 198 is the p99
    assert gap_p99_s(gaps) == 0.01
    assert gap_p99_s([*gaps, 0.6, 0.8]) == 0.6  # 202 gaps: rank 200 of 0.01 x198, 0.5, 0.6, ...


async def gaps_of_a_streamed_request() -> tuple[list[float], queue_pb2.FinishedRequest]:
    clock = Clock()
    scheduler = Scheduler(make_policy("fifo"), UNIT_TIERS, PrefillTimePredictor())
    transport = Transport(finished=lambda d: None, publish_reply=lambda to, r: None)
    core = ServiceCore(scheduler, transport, instance_id="qs", decode=str, clock=clock)
    core.worker_joined("w1", Handle(), kv_slots=4)
    record = queue_pb2.QueuedRequest(
        request_id="a", tier="batch", prompt_ids=[5, 6], max_new_tokens=8, arrival_unix_ms=1
    )
    core.open_client("a")
    core.on_delivered(record, None)
    core.on_worker_message("w1", first("a", 10))
    clock.now += 0.05
    core.on_worker_message("w1", step(("a", 11, 1)))
    clock.now += 0.3
    core.on_worker_message("w1", token("a", 12, 2))
    clock.now += 0.1
    core.on_worker_message("w1", first("a", 10))  # a recompute from token 0: nothing new
    core.on_worker_message("w1", token("a", 11, 1))
    clock.now += 0.02
    core.on_worker_message("w1", step(("a", 13, 3)))
    live = core.lookup("a")
    gaps = list(live.token_gaps_s)
    done = worker_pb2.WorkerDone(request_id="a", output_ids=[10, 11, 12, 13])
    core.on_worker_message("w1", message(done=done))
    record = finished_record(
        live, clock.now, deployment="primary", policy="fifo", slo_s=120.0, tbt_slo_s=0.25
    )
    return gaps, record


def test_each_streamed_token_adds_its_gap_and_the_record_carries_p99_and_target():
    gaps, record = asyncio.run(gaps_of_a_streamed_request())
    assert gaps == pytest.approx([0.05, 0.3, 0.12])
    assert record.tbt_p99_ms == pytest.approx(300)
    assert record.tbt_slo_ms == pytest.approx(250)
    assert violated_tbt(record)
    assert not violated_tbt(queue_pb2.FinishedRequest(status="done", tbt_p99_ms=300))  # no target
    assert not violated_tbt(
        queue_pb2.FinishedRequest(status="cancelled", tbt_p99_ms=300, tbt_slo_ms=250)
    )


def test_metrics_count_every_gap_and_each_request_over_its_target():
    metrics = QueueServiceMetrics("primary", {"batch": 120.0}, {"batch": 0.25})
    missed = queue_pb2.FinishedRequest(
        tier="batch", status="done", ttft_ms=100, slo_ms=120_000, tbt_p99_ms=300, tbt_slo_ms=250
    )
    kept = queue_pb2.FinishedRequest(
        tier="batch", status="done", ttft_ms=100, slo_ms=120_000, tbt_p99_ms=100, tbt_slo_ms=250
    )
    metrics.request_ended(missed, [0.05, 0.3, 0.12])
    metrics.request_ended(kept, [0.1])

    def sample(name: str, **labels) -> float:
        value = metrics.registry.get_sample_value(name, {"deployment": "primary", **labels})
        return value or 0.0

    assert sample("tierflow_tbt_seconds_count", tier="batch") == 4
    assert sample("tierflow_tbt_seconds_bucket", tier="batch", le="0.25") == 3  # the target's
    assert sample("tierflow_tbt_violations_total", tier="batch") == 1
    assert sample("tierflow_slo_violations_total", tier="batch") == 0
