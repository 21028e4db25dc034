"""The tier guard of flowprefill, on a fake clock: lower-tier work never makes a higher-tier
request that can still make its deadline miss it, even when EDF ranks that work first; it
goes first only when it would miss its own deadline otherwise and the higher tier can wait.

Same fixed tiers and predictor as test_scheduler.py: 1000 prompt tokens = 1 s of prefill;
SLOs critical 1 s, standard 5 s, batch 100 s; a 20% prediction margin until errors are seen.
"""

from __future__ import annotations

from queue_service.scheduler import (
    Assign,
    Preempt,
    PreemptionAcked,
    RequestArrived,
    RequestDone,
    Resume,
    TimerFired,
    WorkerJoined,
)
from tests.unit.test_scheduler import arrive, drain_order, make, step


def test_a_critical_request_that_would_miss_behind_standard_work_goes_first():
    sched = make("flowprefill", workers=0)
    arrive(sched, "s", "standard", 600, 0.0)  # deadline 5.0; at 4.3 s still on time
    arrive(sched, "c", "critical", 600, 4.1)  # deadline 5.1: EDF ranks s first
    # Behind s, c would start at 4.9 s and end at 5.5 s: late. First, it ends at 4.9 s.
    assert drain_order(sched, 4.3) == ["c", "s"]


def test_a_critical_request_goes_first_when_the_lower_tier_work_can_spare_the_time():
    sched = make("flowprefill", workers=0)
    arrive(sched, "s", "standard", 200, 0.0)  # deadline 5.0; at 4.3 s it has 0.5 s to spare
    arrive(sched, "c", "critical", 200, 4.1)  # deadline 5.1; behind s it would still make it
    # Predictions can be wrong: the critical request does not wait on one when s can wait.
    assert drain_order(sched, 4.3) == ["c", "s"]


def test_lower_tier_work_keeps_its_edf_place_when_it_would_miss_and_the_critical_can_wait():
    sched = make("flowprefill", workers=0)
    arrive(sched, "s", "standard", 600, 0.0)  # deadline 5.0; at 4.3 s 0.1 s to spare
    arrive(sched, "c", "critical", 100, 4.2)  # deadline 5.2; behind s it ends ~5.14 s
    assert drain_order(sched, 4.3) == ["s", "c"]


def test_the_guard_preempts_lower_tier_work_with_an_earlier_deadline():
    sched = make("flowprefill", workers=0)
    arrive(sched, "s", "standard", 1000, 0.0)  # deadline 5.0
    assert step(sched, WorkerJoined("w0", kv_slots=8), 3.5) == [
        Assign("s", "w0")
    ]  # ends 4.5: on time
    # c (deadline 5.1, 0.8 s of work) behind s would end at ~5.3 s with s's 0.4 s left.
    assert arrive(sched, "c", "critical", 800, 4.1) == [Preempt("s", "w0", drop_state=False)]
    # Once s is stopped, c ranks first (no preempt/resume loop), and s resumes after it.
    assert step(sched, PreemptionAcked("s", "w0", 600, False), 4.105) == [Assign("c", "w0")]
    assert step(sched, RequestDone("c", "w0"), 4.9) == [Resume("s", "w0")]


def test_lower_tiers_never_stop_a_higher_tiers_prefill():
    sched = make("flowprefill", workers=0)
    arrive(sched, "c", "critical", 800, 4.1)  # deadline 5.1
    assert step(sched, WorkerJoined("w0", kv_slots=8), 4.1) == [
        Assign("c", "w0")
    ]  # ends 4.9: on time
    # A standard request admitted at 0.0 (deadline 5.0) is delivered at 4.2: EDF ranks it
    # first and it would miss behind c, but stopping c would make c miss instead.
    assert step(sched, RequestArrived("s", "standard", 500, arrival_s=0.0), 4.2) == []


def test_a_wake_up_makes_the_guard_preempt_when_the_prediction_was_wrong():
    sched = make("flowprefill", workers=0)
    step(sched, RequestArrived("s", "standard", 1000, arrival_s=-0.4), 0.0)  # deadline 4.6
    step(sched, WorkerJoined("w0", kv_slots=8), 3.5)  # predicted to end at 4.5 s: 0.1 s to spare
    assert arrive(sched, "c", "critical", 200, 4.1) == []  # behind s it ends ~4.8 s: waits
    wake_up = sched.timers()["c"]
    # s has not finished when the wake-up fires: c preempts it.
    assert step(sched, TimerFired("c"), wake_up) == [Preempt("s", "w0", drop_state=False)]


def test_a_late_critical_request_is_not_guarded_ahead_of_on_time_standard_work():
    sched = make("flowprefill", workers=0)
    arrive(sched, "s", "standard", 300, 0.0)  # deadline 5.0, on time at 4.5 s
    arrive(sched, "c", "critical", 2000, 4.0)  # deadline 5.0 but needs 2 s: late anyway
    # c is re-deadlined one critical SLO from now (5.5 s): s, which can still make it, first.
    assert drain_order(sched, 4.5) == ["s", "c"]
