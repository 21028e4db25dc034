"""Scheduler rules, one test per rule, on a fake clock (``now`` is just a number here).

Tiers and the predictor are fixed by the tests, not read from config/tiers.toml, so that tuning
the SLOs there cannot change what these tests check: 1000 prompt tokens = 1 s of prefill;
SLOs: critical 1 s, standard 5 s, batch 100 s.
"""

from __future__ import annotations

import pytest

from queue_service.scheduler import (
    Assign,
    Cancel,
    CancelTimer,
    Drain,
    Preempt,
    PreemptionAcked,
    PrefillFinished,
    PrefillProgress,
    PrefillTimePredictor,
    Reject,
    RequestArrived,
    RequestCancelled,
    RequestDone,
    RequestState,
    Resume,
    Scheduler,
    SchedulerConfig,
    SetTimer,
    TimerFired,
    WorkerDraining,
    WorkerJoined,
    WorkerLeft,
    make_policy,
)
from tests.tiers import UNIT_TIERS

TIERS = UNIT_TIERS


def make(policy: str, workers: int = 1, **config) -> Scheduler:
    config.setdefault("refit_predictor", False)
    config.setdefault("max_pack_size", 1)  # packing has its own tests (test_scheduler_packing)
    sched = Scheduler(
        make_policy(policy),
        TIERS,
        PrefillTimePredictor(a=1e-3, b=0.0, c=0.0),  # 1000 tokens = 1 s
        SchedulerConfig(**config),
    )
    for i in range(workers):
        assert step(sched, WorkerJoined(f"w{i}", kv_slots=8), 0.0) == []
    return sched


def arrive(sched, rid, tier, tokens, now, new_tokens=0):
    return decisions(sched.handle(RequestArrived(rid, tier, tokens, new_tokens), now))


def arrive_due_soon(sched, rid, tier, tokens, now, spare_s=0.05):
    """A request admitted earlier, so that if it starts now its deadline falls ``spare_s``
    after its predicted end: stopping it would cost it its deadline, so flowprefill lets
    newcomers wait on predictions rather than preempt it."""
    admitted = now + tokens / 1000 + spare_s - TIERS[tier].ttft_slo_s
    return step(sched, RequestArrived(rid, tier, tokens, arrival_s=admitted), now)


def step(sched: Scheduler, event, now: float) -> list:
    return decisions(sched.handle(event, now))


def decisions(commands: list) -> list:
    """The commands that act on requests: timers left out (tests of timers check those)."""
    return [c for c in commands if not isinstance(c, SetTimer | CancelTimer)]


def drain_order(sched: Scheduler, now: float) -> list[str]:
    """Join one worker to a scheduler with none, finish each assigned request, record order."""
    order = []
    commands = decisions(sched.handle(WorkerJoined("w0", kv_slots=8), now))
    while commands:
        assert not any(isinstance(c, Preempt) for c in commands), commands
        (assign,) = commands
        assert isinstance(assign, Assign)
        order.append(assign.request_id)
        now += 0.01
        commands = decisions(sched.handle(RequestDone(assign.request_id, "w0"), now))
    return order


# ---------------------------------------------------------------------------- ordering


def queue_mixed(sched: Scheduler) -> None:
    arrive(sched, "b1", "batch", 500, 0.0)
    arrive(sched, "c1", "critical", 100, 0.1)
    arrive(sched, "s1", "standard", 100, 0.2)
    arrive(sched, "c2", "critical", 100, 0.3)


def test_fifo_orders_by_arrival():
    sched = make("fifo", workers=0)
    queue_mixed(sched)
    assert drain_order(sched, 0.4) == ["b1", "c1", "s1", "c2"]


@pytest.mark.parametrize("policy", ["priority", "chunked", "recompute"])
def test_tier_policies_order_by_rank_then_arrival(policy):
    sched = make(policy, workers=0)
    queue_mixed(sched)
    assert drain_order(sched, 0.4) == ["c1", "c2", "s1", "b1"]


def test_flowprefill_a_late_request_goes_after_on_time_work_of_its_tier_only():
    sched = make("flowprefill", workers=0)
    arrive(sched, "s1", "standard", 100, 0.0)  # deadline 5.0
    arrive(sched, "late", "critical", 3000, 0.0)  # deadline 1.0 but needs 3 s: slack < 0
    arrive(sched, "b1", "batch", 100, 0.0)  # deadline 100
    arrive(sched, "c1", "critical", 100, 0.5)  # deadline 1.5
    # late misses anyway: it goes after c1, which can still make it, but keeps its tier: it
    # is re-deadlined one critical SLO from now (1.6), before work due at 5 s and 100 s.
    assert drain_order(sched, 0.6) == ["c1", "late", "s1", "b1"]


def test_flowprefill_a_late_standard_request_never_goes_before_an_on_time_critical_one():
    sched = make("flowprefill", workers=0)
    arrive(sched, "s_late", "standard", 100, 0.0)  # deadline 5.0; late at 6.0
    arrive(sched, "c", "critical", 100, 5.5)  # deadline 6.5
    # By EDF the late standard request (deadline 5.0) would go first; re-deadlined at
    # 6.0 + 5 s it goes after the critical one, which can still make it.
    assert drain_order(sched, 6.0) == ["c", "s_late"]


def test_flowprefill_a_request_slightly_late_still_goes_before_work_with_time_to_spare():
    sched = make("flowprefill", workers=0)
    arrive(sched, "c", "critical", 100, 0.0)  # deadline 1.0, needs 0.1 s
    arrive(sched, "b", "batch", 3000, 0.5)  # deadline 100.5
    # At 0.95 s the critical request will be 0.05 s late: not hopeless, it still goes first.
    assert drain_order(sched, 0.95) == ["c", "b"]


# ---------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("policy", ["fifo", "priority"])
def test_non_preemptive_policies_never_preempt(policy):
    sched = make(policy)
    assert arrive(sched, "b", "batch", 10_000, 0.0) == [Assign("b", "w0")]
    assert arrive(sched, "c", "critical", 10, 0.5) == []
    assert sched.policy.preempts is False and sched.policy.engine_check == "none"
    assert step(sched, RequestDone("b", "w0"), 10.0) == [Assign("c", "w0")]


@pytest.mark.parametrize(("policy", "drop"), [("chunked", False), ("recompute", True)])
def test_tier_preemptive_policies_preempt_on_any_higher_tier(policy, drop):
    sched = make(policy)
    arrive(sched, "b", "batch", 10_000, 0.0)
    # Even a standard request that would easily make its 5 s SLO preempts a batch one.
    assert arrive(sched, "s", "standard", 10, 9.0) == [Preempt("b", "w0", drop_state=drop)]
    assert sched.state_of("b") is RequestState.PREEMPTING
    acked = sched.handle(PreemptionAcked("b", "w0", tokens_done=8000, state_dropped=drop), 9.01)
    assert acked == [Assign("s", "w0")]
    after = sched.handle(RequestDone("s", "w0"), 9.1)
    if drop:
        # State dropped: it starts again from token 0, anywhere.
        assert after == [Assign("b", "w0")]
    else:
        assert after == [Resume("b", "w0")]
        assert sched.request("b").tokens_done == 8000
        assert sched.request("b").preemptions == 1


@pytest.mark.parametrize("policy", ["chunked", "recompute"])
def test_tier_preemptive_policies_do_not_preempt_same_or_lower_tier(policy):
    sched = make(policy)
    arrive(sched, "s", "standard", 10_000, 0.0)
    assert arrive(sched, "s2", "standard", 10, 0.1) == []
    assert arrive(sched, "b", "batch", 10, 0.2) == []


def test_flowprefill_preempts_lower_tier_prefill_even_when_the_newcomer_could_wait():
    sched = make("flowprefill")
    arrive(sched, "b", "batch", 1000, 0.0)  # 1 s of prefill, deadline 100 s
    # The critical request would make its SLO by waiting (0.6 s < 1 s), but only if the
    # prediction holds; stopping b costs b a layer and no work.
    assert arrive(sched, "c", "critical", 100, 0.5) == [Preempt("b", "w0", drop_state=False)]


def test_flowprefill_does_not_preempt_when_the_newcomer_makes_its_slo_anyway():
    sched = make("flowprefill")
    arrive_due_soon(sched, "b", "standard", 1000, 0.0)  # deadline 1.05 s: no time to give
    # At 0.5 s b has ~0.5 s left; the critical needs 0.1 s: 0.6 s < its 1 s SLO.
    assert arrive(sched, "c", "critical", 100, 0.5) == []
    assert step(sched, RequestDone("b", "w0"), 1.0) == [Assign("c", "w0")]


def test_flowprefill_preempts_when_the_newcomer_would_miss_its_slo():
    sched = make("flowprefill")
    arrive(sched, "b", "batch", 10_000, 0.0)
    assert arrive(sched, "c", "critical", 100, 1.0) == [Preempt("b", "w0", drop_state=False)]
    assert step(sched, PreemptionAcked("b", "w0", 1000, False), 1.005) == [Assign("c", "w0")]
    assert sched.suspended() == {"w0": ("b",)}
    assert step(sched, RequestDone("c", "w0"), 1.2) == [Resume("b", "w0")]


def test_progress_reports_sharpen_the_estimate():
    sched = make("flowprefill")
    arrive(sched, "b", "batch", 2000, 0.0)
    # The worker is slower than predicted: at 1.9 s it reports only 100 tokens done, so
    # ~1.9 s are left, not 0.1 s...
    assert step(sched, PrefillProgress("b", "w0", 100), 1.9) == []
    assert sched.request("b").tokens_done == 100
    # ...and a critical arriving now would miss by waiting: preempt.
    assert arrive(sched, "c", "critical", 100, 1.9) == [Preempt("b", "w0", drop_state=False)]


def test_a_progress_report_revisits_a_decision_to_wait():
    sched = make("flowprefill")
    arrive_due_soon(sched, "b", "batch", 1000, 0.0)  # predicted done at 1.0 s, due at 1.05 s
    # The standard request (SLO 5 s) makes it by waiting: no preemption.
    assert arrive(sched, "s", "standard", 500, 0.1) == []
    # At 3.9 s the batch request reports 200 of 1000 tokens: ~0.8 s more, then 0.5 s for the
    # standard one, past its 5.1 s deadline: the decision is revisited.
    assert step(sched, PrefillProgress("b", "w0", 200), 3.9) == [
        Preempt("b", "w0", drop_state=False)
    ]


@pytest.mark.parametrize(("margin", "preempts"), [(0.0, False), (0.2, True)])
def test_flowprefill_waits_only_with_the_prediction_margin_inside_the_slo(margin, preempts):
    sched = make("flowprefill", default_prediction_margin=margin)
    arrive_due_soon(sched, "b", "standard", 800, 0.0)  # due at 0.85 s
    # Waiting, the critical request would be done at 0.9 s: inside its 1 s SLO, but not
    # with predictions 20% too optimistic (1.08 s).
    expected = [Preempt("b", "w0", drop_state=False)] if preempts else []
    assert arrive(sched, "c", "critical", 100, 0.0) == expected


def test_the_prediction_margin_follows_the_predictors_observed_error():
    sched = make("fifo", default_prediction_margin=0.2)
    assert sched.prediction_errors.margin() == 0.2  # until 20 prefills were measured
    for i in range(40):  # every prefill takes 1.5x its prediction (1000 tokens: 1 s)
        arrive(sched, f"r{i}", "standard", 1000, float(i))
        sched.handle(PrefillFinished(f"r{i}", "w0", 1000, 1.5), i + 0.5)
        sched.handle(RequestDone(f"r{i}", "w0"), i + 0.6)
    assert sched.prediction_errors.margin() == pytest.approx(0.5)
    summary = sched.prediction_errors.summary()
    assert summary["n"] == 40 and summary["abs_p95"] == pytest.approx(0.5)


def test_flowprefill_preempts_lower_tier_work_for_a_late_request():
    """A late critical request never waits behind a batch prefill that could be preempted."""
    sched = make("flowprefill")
    arrive(sched, "b", "batch", 10_000, 0.0)
    # Needs 2 s against a 1 s SLO: it misses anyway, but every second it waits adds to that.
    assert arrive(sched, "c", "critical", 2000, 1.0) == [Preempt("b", "w0", drop_state=False)]


def test_flowprefill_a_late_request_does_not_preempt_on_time_work_of_its_tier():
    sched = make("flowprefill")
    arrive(sched, "c1", "critical", 500, 0.0)  # deadline 1.0, needs 0.5 s: on time
    assert arrive(sched, "c2", "critical", 2000, 0.1) == []  # late: waits for c1


def test_a_redelivered_request_keeps_the_deadline_of_its_admission():
    sched = make("flowprefill")
    arrive(sched, "b", "batch", 10_000, 0.0)
    # Admitted at 0.0, delivered to the scheduler at 5.0 (held in Kafka, or replayed after a
    # restart): its deadline passed at 1.0, it is late, and it preempts the batch request.
    event = RequestArrived("c", "critical", 100, arrival_s=0.0)
    assert step(sched, event, 5.0) == [Preempt("b", "w0", drop_state=False)]
    assert sched.request("c").arrival_s == 0.0


def test_flowprefill_does_not_preempt_a_request_with_an_earlier_deadline():
    sched = make("flowprefill")
    arrive(sched, "c1", "critical", 800, 0.0)  # deadline 1.0, 0.8 s of work
    assert arrive(sched, "c2", "critical", 500, 0.1) == []  # would miss, but c1 is more urgent


def test_a_worker_being_preempted_is_not_preempted_again():
    sched = make("chunked")
    arrive(sched, "b", "batch", 10_000, 0.0)
    assert arrive(sched, "s", "standard", 100, 1.0) == [Preempt("b", "w0", drop_state=False)]
    assert arrive(sched, "c", "critical", 100, 1.001) == []
    # The freed worker goes to the best waiting request, the critical one.
    assert step(sched, PreemptionAcked("b", "w0", 1000, False), 1.01) == [Assign("c", "w0")]
    assert step(sched, RequestDone("c", "w0"), 1.2) == [Assign("s", "w0")]
    assert step(sched, RequestDone("s", "w0"), 1.3) == [Resume("b", "w0")]


def test_preemption_bound_makes_a_request_run_to_completion():
    sched = make("chunked", max_preemptions=1)
    arrive(sched, "b", "batch", 10_000, 0.0)
    assert arrive(sched, "s1", "standard", 100, 1.0) == [Preempt("b", "w0", drop_state=False)]
    sched.handle(PreemptionAcked("b", "w0", 1000, False), 1.01)
    assert step(sched, RequestDone("s1", "w0"), 1.2) == [Resume("b", "w0")]
    assert arrive(sched, "s2", "standard", 100, 1.3) == []  # b was preempted once already
    assert step(sched, RequestDone("b", "w0"), 10.0) == [Assign("s2", "w0")]


@pytest.mark.parametrize(("policy", "bound"), [("flowprefill", 40), ("recompute", 8)])
def test_a_long_prompt_yields_to_a_sustained_critical_load_up_to_its_policys_bound(policy, bound):
    """Under a tier guard, a preemption for a higher tier costs the victim one interruption
    point and is not counted: the guard, not a count, protects the victim's own deadline, so a
    long prompt yields to every critical arrival of a sustained load (all 40 here; at a bound of
    32 a batch prompt once ran 1.7 s with critical requests waiting behind it). A policy whose
    preemption throws the work away is bounded as before (8)."""
    sched = make(policy, max_preemptions=None if policy == "recompute" else 32)
    arrive(sched, "b", "batch", 100_000, 0.0)  # 100 s of prefill
    now, preempted = 1.0, 0
    for i in range(40):
        commands = arrive(sched, f"c{i}", "critical", 50, now)
        if not commands:
            break
        assert commands == [Preempt("b", "w0", drop_state=policy == "recompute")]
        preempted += 1
        done = 0 if policy == "recompute" else 1000
        step(sched, PreemptionAcked("b", "w0", done, policy == "recompute"), now + 0.01)
        step(sched, RequestDone(f"c{i}", "w0"), now + 0.06)
        now += 0.5
    assert preempted == bound


def test_preempt_racing_with_the_end_of_the_request():
    sched = make("chunked")
    arrive(sched, "b", "batch", 1000, 0.0)
    assert arrive(sched, "s", "standard", 100, 0.99) == [Preempt("b", "w0", drop_state=False)]
    # The worker finished before it saw the flag: Done, and never an ack.
    assert step(sched, RequestDone("b", "w0"), 1.0) == [Assign("s", "w0")]
    assert sched.state_of("b") is RequestState.DONE
    assert step(sched, PreemptionAcked("b", "w0", 1000, False), 1.01) == []  # stale


def test_suspended_states_per_worker_are_capped():
    sched = make("chunked", max_suspended_per_worker=1)
    arrive(sched, "b", "batch", 10_000, 0.0)
    arrive(sched, "s", "standard", 10_000, 1.0)
    assert step(sched, PreemptionAcked("b", "w0", 1000, False), 1.01) == [Assign("s", "w0")]
    # w0 already holds one state: s is preempted with its state dropped (recomputed later).
    assert arrive(sched, "c", "critical", 100, 2.0) == [Preempt("s", "w0", drop_state=True)]


def test_aging_puts_a_starving_request_first_and_makes_it_unpreemptible():
    sched = make("chunked", starvation_s=10.0)
    arrive(sched, "c0", "critical", 12_000, 0.0)
    arrive(sched, "b", "batch", 1000, 0.5)
    arrive(sched, "c1", "critical", 100, 11.0)
    # b has waited 11.5 s > 10 s: it goes before the critical request that waits too...
    assert step(sched, RequestDone("c0", "w0"), 12.0) == [Assign("b", "w0")]
    # ...and a new critical request does not preempt it.
    assert arrive(sched, "c2", "critical", 100, 12.1) == []
    assert step(sched, RequestDone("b", "w0"), 13.0) == [Assign("c1", "w0")]


# ---------------------------------------------------------------------------- several workers


def test_victim_is_the_lowest_tier_among_running_requests():
    sched = make("chunked", workers=2)
    assert arrive(sched, "s", "standard", 10_000, 0.0) == [Assign("s", "w0")]
    assert arrive(sched, "b", "batch", 10_000, 0.0) == [Assign("b", "w1")]
    assert arrive(sched, "c", "critical", 100, 1.0) == [Preempt("b", "w1", drop_state=False)]
    # One preemption per waiting request: a second critical needs (and gets) its own.
    assert arrive(sched, "c2", "critical", 100, 1.0) == [Preempt("s", "w0", drop_state=False)]


def test_recompute_victim_is_the_one_with_least_work_to_lose():
    sched = make("recompute", workers=2)
    arrive(sched, "b1", "batch", 10_000, 0.0)
    arrive(sched, "b2", "batch", 10_000, 0.0)
    sched.handle(PrefillProgress("b1", "w0", 4000), 4.0)
    sched.handle(PrefillProgress("b2", "w1", 500), 4.0)
    assert arrive(sched, "c", "critical", 100, 4.0) == [Preempt("b2", "w1", drop_state=True)]


def test_flowprefill_victim_is_the_one_that_does_not_lose_its_own_deadline():
    sched = make("flowprefill", workers=2)
    arrive(sched, "s", "standard", 4000, 0.0)  # deadline 5, needs 4 s: 1 s of slack
    arrive(sched, "b", "batch", 50_000, 0.0)  # deadline 100: plenty of slack
    assert arrive(sched, "c", "critical", 500, 0.5) == [Preempt("b", "w1", drop_state=False)]


def test_flowprefill_waits_for_a_worker_that_frees_in_time():
    sched = make("flowprefill", workers=2)
    arrive_due_soon(sched, "b1", "batch", 50_000, 0.0)
    arrive_due_soon(sched, "b2", "standard", 1000, 0.0)  # w1 frees at 1.0
    assert arrive(sched, "c", "critical", 300, 0.8) == []  # starts at 1.0, done 1.3 < 1.8
    assert step(sched, RequestDone("b2", "w1"), 1.0) == [Assign("c", "w1")]


def test_suspended_request_resumes_only_on_its_worker():
    sched = make("chunked", workers=2)
    arrive(sched, "b", "batch", 10_000, 0.0)
    arrive(sched, "s0", "standard", 10_000, 0.0)  # on w1
    arrive(sched, "s", "standard", 100, 1.0)
    sched.handle(PreemptionAcked("b", "w0", 1000, False), 1.01)  # s runs on w0
    assert sched.suspended() == {"w0": ("b",), "w1": ()}
    # w1 frees first, but b's state is on w0: it is not resumed (nor restarted) on w1.
    assert step(sched, RequestDone("s0", "w1"), 2.0) == []
    assert step(sched, RequestDone("s", "w0"), 2.1) == [Resume("b", "w0")]


# ---------------------------------------------------------------------------- overload


def test_batch_is_shed_when_too_many_sheddable_requests_wait():
    sched = make("priority", max_queued_sheddable=2)
    arrive(sched, "c0", "critical", 10_000, 0.0)
    assert arrive(sched, "b1", "batch", 100, 0.1) == []
    assert arrive(sched, "b2", "batch", 100, 0.2) == []
    (reject,) = arrive(sched, "b3", "batch", 100, 0.3)
    assert isinstance(reject, Reject) and reject.request_id == "b3" and reject.overload
    assert "overloaded" in reject.reason and "limit 2" in reject.reason
    assert sched.state_of("b3") is RequestState.REJECTED
    # Critical and standard are never shed.
    for i in range(10):
        assert arrive(sched, f"c{i + 1}", "critical", 100, 0.4) == []
        assert arrive(sched, f"s{i}", "standard", 100, 0.4) == []
    assert sched.queue_depth() == {"critical": 10, "standard": 10, "batch": 2}


def test_batch_is_shed_when_the_predicted_wait_is_too_long():
    sched = make("priority", max_predicted_wait_s=5.0)
    arrive(sched, "c0", "critical", 4000, 0.0)
    assert arrive(sched, "b1", "batch", 100, 0.0) == []
    arrive(sched, "s1", "standard", 3000, 0.0)  # backlog now ~7 s on one worker
    (reject,) = arrive(sched, "b2", "batch", 100, 0.0)
    assert isinstance(reject, Reject) and "predicted wait" in reject.reason and reject.overload
    assert arrive(sched, "c1", "critical", 5000, 0.0) == []


def test_unknown_tier_and_invalid_requests_are_rejected_with_a_reason():
    sched = make("fifo")
    (reject,) = arrive(sched, "x", "gold", 10, 0.0)
    assert reject == Reject("x", reject.reason, overload=False)
    assert "gold" in reject.reason and "critical" in reject.reason
    (reject,) = arrive(sched, "y", "critical", 0, 0.0)
    assert "prompt_tokens=0" in reject.reason


# ---------------------------------------------------------------------------- cancel


def test_cancel_queued_request_just_removes_it():
    sched = make("fifo")
    arrive(sched, "a", "standard", 1000, 0.0)
    arrive(sched, "q", "standard", 1000, 0.1)
    assert step(sched, RequestCancelled("q"), 0.2) == []
    assert sched.state_of("q") is RequestState.CANCELLED
    assert sched.queue_depth()["standard"] == 0
    assert step(sched, RequestDone("a", "w0"), 1.0) == []


def test_cancel_running_request_tells_its_worker_and_frees_it():
    sched = make("fifo")
    arrive(sched, "a", "standard", 1000, 0.0)
    arrive(sched, "q", "standard", 1000, 0.1)
    assert step(sched, RequestCancelled("a"), 0.2) == [Cancel("a", "w0"), Assign("q", "w0")]
    assert step(sched, RequestDone("a", "w0"), 0.3) == []  # late event from the worker


def test_cancel_suspended_request_tells_the_worker_holding_its_state():
    sched = make("chunked", workers=2)
    arrive(sched, "b", "batch", 10_000, 0.0)
    arrive(sched, "s0", "standard", 10_000, 0.0)
    arrive(sched, "s", "standard", 100, 1.0)
    sched.handle(PreemptionAcked("b", "w0", 1000, False), 1.01)
    assert step(sched, RequestCancelled("b"), 1.1) == [Cancel("b", "w0")]
    assert sched.suspended() == {"w0": (), "w1": ()}
    assert step(sched, RequestCancelled("b"), 1.2) == []  # twice: no-op


def test_cancel_while_preempting_frees_the_worker_for_the_waiting_request():
    sched = make("chunked")
    arrive(sched, "b", "batch", 10_000, 0.0)
    arrive(sched, "s", "standard", 100, 1.0)
    assert step(sched, RequestCancelled("b"), 1.001) == [Cancel("b", "w0"), Assign("s", "w0")]
    assert step(sched, PreemptionAcked("b", "w0", 1000, False), 1.01) == []


# ---------------------------------------------------------------------------- workers, idempotency


def test_worker_left_requeues_its_running_and_suspended_requests_from_scratch():
    sched = make("chunked", workers=2)
    arrive(sched, "b", "batch", 10_000, 0.0)  # w0
    arrive(sched, "s0", "standard", 10_000, 0.0)  # w1
    arrive(sched, "s", "standard", 5000, 1.0)
    sched.handle(PreemptionAcked("b", "w0", 1000, False), 1.01)  # s on w0, b suspended on w0
    assert step(sched, WorkerLeft("w0"), 2.0) == []  # w1 busy: both wait
    for rid in ("s", "b"):
        assert sched.state_of(rid) is RequestState.QUEUED
        assert sched.request(rid).tokens_done == 0
    assert step(sched, RequestDone("s0", "w1"), 3.0) == [Assign("s", "w1")]
    assert step(sched, RequestDone("s", "w1"), 4.0) == [Assign("b", "w1")]  # not Resume
    assert step(sched, RequestDone("s", "w0"), 4.1) == []  # the gone worker's late event


def test_a_draining_worker_is_told_once_and_is_never_preempted_for_a_new_request():
    sched = make("chunked", workers=2)
    arrive(sched, "b", "batch", 10_000, 0.0)  # w0
    arrive(sched, "x", "critical", 2000, 0.0)  # w1
    assert step(sched, WorkerDraining("w0"), 0.5) == [Drain("w0")]
    assert step(sched, WorkerDraining("w0"), 0.6) == []
    assert step(sched, WorkerDraining("gone"), 0.6) == []
    # The batch prefill on w0 is the only victim, but the critical request could not start
    # there: it waits for w1 rather than cost b its state.
    assert arrive(sched, "c", "critical", 100, 1.0) == []
    assert step(sched, RequestDone("x", "w1"), 2.0) == [Assign("c", "w1")]
    assert sched.tier_load("critical", 2.1).workers == 1  # capacity counts serving workers


def test_a_draining_worker_resumes_what_it_holds_and_queued_work_waits_for_another():
    sched = make("chunked", workers=2)
    arrive(sched, "b", "batch", 10_000, 0.0)  # w0
    arrive(sched, "x", "standard", 10_000, 0.0)  # w1
    assert arrive(sched, "s", "standard", 1000, 1.0) == [Preempt("b", "w0", False)]
    assert step(sched, PreemptionAcked("b", "w0", 1000, False), 1.01) == [Assign("s", "w0")]
    assert step(sched, WorkerDraining("w0"), 1.5) == [Drain("w0")]
    assert arrive(sched, "q", "batch", 100, 1.6) == []
    # w0 frees: its own suspended request resumes there; the queued one is not placed on it.
    assert step(sched, RequestDone("s", "w0"), 2.0) == [Resume("b", "w0")]
    assert step(sched, RequestDone("b", "w0"), 12.0) == []
    assert step(sched, RequestDone("x", "w1"), 12.5) == [Assign("q", "w1")]
    assert sched.suspended()["w0"] == () and sched.running()["w0"] is None


def test_worker_joined_takes_queued_work_and_duplicates_are_ignored():
    sched = make("fifo", workers=0)
    arrive(sched, "a", "standard", 100, 0.0)
    assert step(sched, WorkerJoined("w0", kv_slots=8), 1.0) == [Assign("a", "w0")]
    assert step(sched, WorkerJoined("w0", kv_slots=8), 1.1) == []
    assert sched.running() == {"w0": "a"}


def test_duplicate_arrival_is_ignored():
    sched = make("fifo")
    assert arrive(sched, "a", "standard", 100, 0.0) == [Assign("a", "w0")]
    assert arrive(sched, "a", "critical", 5, 0.1) == []
    assert sched.request("a").tier.name == "standard"
    sched.handle(RequestDone("a", "w0"), 1.0)
    assert arrive(sched, "a", "standard", 100, 2.0) == []  # redelivered after completion
    assert sched.counters["duplicate_arrivals"] == 2


def test_prefill_finished_refits_the_predictor():
    sched = Scheduler(
        "fifo", TIERS, PrefillTimePredictor(a=1e-3, b=0.0, c=0.0, min_samples=1), SchedulerConfig()
    )
    sched.handle(WorkerJoined("w0", kv_slots=8), 0.0)
    arrive(sched, "a", "standard", 1000, 0.0)
    sched.handle(PrefillFinished("a", "w0", 1000, 4.0), 4.0)  # 4x slower than predicted
    assert sched.predictor.predict(1000) == pytest.approx(4.0)


def test_introspection_returns_copies():
    sched = make("fifo")
    arrive(sched, "a", "standard", 100, 0.0)
    copy = sched.request("a")
    copy.tokens_done = 99
    assert sched.request("a").tokens_done == 0
    assert sched.request("nope") is None and sched.state_of("nope") is None


def test_unknown_event_type_is_an_error():
    with pytest.raises(TypeError, match="not a scheduler event"):
        make("fifo").handle(object(), 0.0)


# ---------------------------------------------------------------------------- wake-ups


def test_a_request_that_waits_on_a_prediction_gets_a_wake_up_at_its_latest_start():
    sched = make("flowprefill")
    arrive_due_soon(sched, "b", "standard", 1000, 0.0)  # predicted to end at 1.0 s
    commands = sched.handle(RequestArrived("c", "critical", 100), 0.5)
    # Deadline 1.5 s, 0.1 s of prefill predicted, with the 20% margin: start by 1.38 s.
    assert commands == [SetTimer("c", pytest.approx(1.38))]
    assert sched.timers() == {"c": pytest.approx(1.38)}


def test_the_wake_up_preempts_when_the_prediction_was_2x_too_optimistic():
    sched = make("flowprefill")
    arrive_due_soon(sched, "b", "standard", 1000, 0.0)  # predicted 1 s; really takes 2 s
    sched.handle(RequestArrived("c", "critical", 100), 0.5)
    # No event arrives before the wake-up: the batch request is still running at 1.38 s.
    assert sched.handle(TimerFired("c"), 1.38) == [Preempt("b", "w0", drop_state=False)]
    assert step(sched, PreemptionAcked("b", "w0", 0, False), 1.385) == [Assign("c", "w0")]
    assert "c" not in sched.timers()  # b, suspended, has one now: it waits on a prediction


def test_the_wake_up_is_cancelled_when_the_request_starts():
    sched = make("flowprefill")
    arrive_due_soon(sched, "b", "standard", 1000, 0.0)  # ends 1.0 s, due 1.05 s
    sched.handle(RequestArrived("c", "critical", 100), 0.5)
    assert sched.handle(RequestDone("b", "w0"), 1.0) == [Assign("c", "w0"), CancelTimer("c")]
    assert sched.handle(TimerFired("c"), 1.38) == []  # fired anyway (in flight): ignored


def test_the_wake_up_is_cancelled_with_its_request():
    sched = make("flowprefill")
    arrive_due_soon(sched, "b", "standard", 1000, 0.0)  # ends 1.0 s, due 1.05 s
    sched.handle(RequestArrived("c", "critical", 100), 0.5)
    assert sched.handle(RequestCancelled("c"), 0.6) == [CancelTimer("c")]


def test_policies_that_never_wait_on_predictions_set_no_wake_ups():
    for policy in ("fifo", "priority", "chunked", "recompute"):
        sched = make(policy)
        arrive(sched, "b", "batch", 1000, 0.0)
        assert not any(
            isinstance(c, SetTimer) for c in sched.handle(RequestArrived("s", "standard", 100), 0.5)
        )


def test_per_layer_progress_corrects_the_estimate_within_a_chunk():
    sched = make("flowprefill")
    arrive(sched, "b", "batch", 2000, 0.0)  # one 2000-token chunk, predicted 2 s
    # At 1.8 s only 3 of 12 layers of the chunk are done: 1.5 s are left, not 0.2 s.
    progress = PrefillProgress("b", "w0", 0, layers_done=3, num_layers=12, chunk_end=2000)
    assert step(sched, progress, 1.8) == []
    assert sched.request("b").chunk_fraction == 0.25
    # A critical request would miss its 1 s SLO behind 1.5 s: preempt now.
    assert arrive(sched, "c", "critical", 100, 1.8) == [Preempt("b", "w0", drop_state=False)]


def test_per_layer_progress_turns_a_decision_to_wait_into_a_preemption():
    sched = make("flowprefill")
    arrive_due_soon(sched, "b", "standard", 1000, 0.0)  # ends 1.0 s, due 1.05 s
    assert arrive(sched, "c", "critical", 100, 0.5) == []  # waits: b predicted to end at 1.0
    # At 0.9 s b reports half of its layers: 0.5 s left. b misses its deadline anyway (and c
    # would end at 1.52 > 1.5 behind it): stopping it costs nothing more.
    progress = PrefillProgress("b", "w0", 0, layers_done=6, num_layers=12, chunk_end=1000)
    assert step(sched, progress, 0.9) == [Preempt("b", "w0", drop_state=False)]


def test_flowprefill_a_late_request_does_not_preempt_a_late_request_of_its_tier():
    sched = make("flowprefill", max_preemptions=8)
    arrive(sched, "c1", "critical", 3000, 0.0)  # deadline 1.0, needs 3 s: late
    # c2 arrived earlier in the scheduler's view (deadline 0.9) but is late too: switching
    # between two late critical requests saves neither, so c1 keeps the worker.
    event = RequestArrived("c2", "critical", 100, arrival_s=-0.1)
    assert step(sched, event, 1.5) == []


def test_progress_reports_decide_at_most_every_interval():
    sched = make("flowprefill", progress_decision_interval_s=0.02)
    arrive_due_soon(sched, "b", "standard", 1000, 0.0)  # ends 1.0 s, due 1.05 s
    assert arrive(sched, "c", "critical", 100, 0.5) == []  # waits: b predicted to end at 1.0
    # b reports 1 of 12 layers: ~0.92 s left, so b is late and c would miss by waiting. 5 ms
    # after the last decision the estimate is updated but nothing is decided...
    progress = PrefillProgress("b", "w0", 0, layers_done=1, num_layers=12, chunk_end=1000)
    assert step(sched, progress, 0.505) == []
    assert sched.request("b").chunk_fraction == pytest.approx(1 / 12)
    # ...and the next report past the interval decides with it.
    assert step(sched, progress, 0.53) == [Preempt("b", "w0", drop_state=False)]


def test_a_freed_prefill_or_slot_decides_only_when_something_waits_or_time_has_passed():
    # Two short requests on two workers, nothing waiting: a first token and a finished
    # decode a moment after the last decision decide nothing (the next progress report would
    # be as soon); once something waits, or the interval has passed, they do.
    sched = make("flowprefill", workers=2, progress_decision_interval_s=0.02)
    arrive(sched, "a", "critical", 10, 0.0, new_tokens=4)
    arrive(sched, "b", "critical", 10, 0.0, new_tokens=4)
    decided = sched.counters["decisions"]
    sched.handle(PrefillFinished("a", "w0", 10, 0.01), 0.01)
    sched.handle(RequestDone("a", "w0"), 0.015)
    assert sched.counters["decisions"] == decided
    sched.handle(PrefillFinished("b", "w1", 10, 0.01), 0.05)  # the interval has passed
    assert sched.counters["decisions"] == decided + 1
    for rid in ("c", "d", "e"):  # two take the free prefills, the third waits
        arrive(sched, rid, "batch", 5000, 0.05)
    decided = sched.counters["decisions"]
    assert step(sched, RequestDone("b", "w1"), 0.051) == []
    assert sched.counters["decisions"] == decided + 1  # something waits: it decides
