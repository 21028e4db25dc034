"""The queue service's core while no worker is attached: the client hears it at once, and the
request ends with UNAVAILABLE, not run, when none attaches in time (a unit test of the core;
the service's health and a real worker stopped and restarted: tests/integration/test_faults.py).
"""

from __future__ import annotations

import asyncio

import grpc

from queue_service.core.service_core import ClientError, ServiceCore, Transport
from queue_service.scheduler import PrefillTimePredictor, Scheduler, SchedulerConfig
from tests.tiers import UNIT_TIERS
from tests.unit.test_core_recompute import RecordedWorker, deliver, drain, first_token, report


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_core(clock: Clock) -> tuple[ServiceCore, list]:
    finished: list = []
    core = ServiceCore(
        Scheduler("flowprefill", UNIT_TIERS, PrefillTimePredictor(), SchedulerConfig()),
        Transport(finished=finished.append, publish_reply=lambda *_: None),
        instance_id="qs",
        decode=str,
        no_worker_timeout_s=30.0,
        clock=clock,
    )
    return core, finished


def test_a_request_with_no_worker_is_told_so_then_fails_unavailable_without_running():
    async def scenario():
        clock = Clock()
        core, finished = make_core(clock)
        client = deliver(core, "r")
        (event,) = drain(client)
        assert event.WhichOneof("event") == "waiting"
        assert "no worker" in event.waiting.reason and event.waiting.unavailable_in_ms == 30_000
        clock.now += 29
        core.expire_unattended()
        assert drain(client) == [] and "r" in core.live
        clock.now += 2
        core.expire_unattended()
        (error,) = drain(client)
        assert isinstance(error, ClientError) and error.code is grpc.StatusCode.UNAVAILABLE
        assert "no worker attached for 31 s" in error.message
        assert "r" not in core.live and finished == ["offset-of-r"]
        worker = RecordedWorker(core)
        core.worker_joined("w1", worker, kv_slots=4)
        assert worker.commands == []  # it was not run later either

    asyncio.run(scenario())


def test_a_worker_that_attaches_in_time_runs_it_and_the_last_one_leaving_warns_again():
    async def scenario():
        clock = Clock()
        core, _ = make_core(clock)
        client = deliver(core, "r")
        assert [e.WhichOneof("event") for e in drain(client)] == ["waiting"]
        clock.now += 20
        w1 = RecordedWorker(core)
        core.worker_joined("w1", w1, kv_slots=4)
        assert w1.commands == [("assign", "r")]
        report(core, "w1", **first_token("r", 7))
        core.worker_left("w1")  # the only worker dies: back in the queue, and told again
        assert [e.WhichOneof("event") for e in drain(client)] == ["first_token", "waiting"]
        clock.now += 29  # counted from the warning, not from the arrival
        core.expire_unattended()
        assert "r" in core.live
        core.worker_joined("w2", RecordedWorker(core), kv_slots=4)
        clock.now += 100
        core.expire_unattended()
        assert "r" in core.live  # a worker is attached: nothing expires

    asyncio.run(scenario())
