"""What the scheduler assumes a preemption takes: the workers' budget until it has measured."""

from __future__ import annotations

import pytest

from queue_service.scheduler import Scheduler, WorkerJoined
from queue_service.scheduler.prediction_error import SwitchTime
from tests.tiers import UNIT_TIERS


def test_the_announced_budget_stands_until_latencies_are_measured():
    switch = SwitchTime()
    assert switch.p95() == 0.0
    switch.expect(0.025)
    switch.expect(0.010)  # the largest budget of the workers
    assert switch.p95() == 0.025
    for latency in (0.004, 0.006, 0.005):
        switch.observe(latency)
    assert switch.p95() == pytest.approx(0.0059)


def test_a_joining_worker_tells_the_scheduler_its_budget():
    scheduler = Scheduler("flowprefill", UNIT_TIERS)
    assert scheduler.switch_s() == 0.0
    scheduler.handle(WorkerJoined("w1", kv_slots=4, interruption_s=0.025), now=0.0)
    assert scheduler.switch_s() == 0.025
