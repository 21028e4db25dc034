"""Weighted fair order between the keys of one tier (``scheduler.fairness``), alone and inside
the scheduler on a fake clock; and what the scheduler publishes per key for admission."""

from __future__ import annotations

import dataclasses
import math

import pytest

from queue_service.scheduler import (
    Assign,
    Preempt,
    RequestArrived,
    RequestDone,
    Scheduler,
    make_policy,
)
from queue_service.scheduler.capacity import judge
from queue_service.scheduler.fairness import HeldPeaks, KeyBook, SentRates, fair_order
from queue_service.scheduler.request import Request
from tests.tiers import UNIT_TIERS
from tests.unit.test_scheduler import drain_order, make, step

TIERS = UNIT_TIERS


def tagged(*requests: tuple[str, str, str]) -> list[Request]:
    """Requests (id, tier, key) of 0.1 s each, in this order, tagged by a KeyBook as they
    arrive (all at once, nothing served yet)."""
    book, made = KeyBook(100), []
    for rid, tier, key in requests:
        weight = 2.0 if key == "heavy" else 1.0
        req = Request(rid, TIERS[tier], 0.0, 100, key_id=key, key_weight=weight)
        req.fair_tag = book.arrive(req, 0.1, [r for r in made if r.tier is req.tier])
        made.append(req)
    return made


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_one_key_keeps_the_policys_order_exactly():
    ranked = tagged(*((f"c{i}", "critical", "acme") for i in range(5)))[::-1]
    assert fair_order(ranked) == ranked


def test_a_key_that_arrives_behind_a_flood_starts_at_the_head_of_the_tier():
    ranked = tagged(
        *((f"f{i}", "critical", "flood") for i in range(4)), ("calm", "critical", "calm")
    )
    # Its start tag ties with the flood's first; the earlier place wins the tie.
    assert ids(fair_order(ranked)) == ["f0", "calm", "f1", "f2", "f3"]


def test_a_key_twice_the_weight_gets_twice_the_work():
    ranked = tagged(*((f"h{i}", "critical", "heavy") for i in range(4)),
                    *((f"l{i}", "critical", "light") for i in range(2)))  # fmt: skip
    # Start tags: heavy 0, .05, .1, .15; light 0, .1.
    assert ids(fair_order(ranked)) == ["h0", "l0", "h1", "h2", "l1", "h3"]


def test_a_tier_keeps_its_places_among_the_other_tiers():
    made = tagged(
        ("f0", "critical", "flood"),
        ("f1", "critical", "flood"),
        ("f2", "critical", "flood"),
        ("s0", "standard", "x"),
        ("s1", "standard", "y"),
        ("calm", "critical", "calm"),
    )
    f0, f1, f2, s0, s1, calm = made
    ranked = [f0, s0, f1, f2, s1, calm]
    order = fair_order(ranked)
    assert [r.tier.name for r in order] == [r.tier.name for r in ranked]
    assert ids(order) == ["f0", "s0", "calm", "f1", "s1", "f2"]


def test_a_keys_own_requests_keep_the_policys_order_among_themselves():
    a1, b1, a2 = tagged(("a1", "critical", "a"), ("b1", "critical", "b"), ("a2", "critical", "a"))
    order = ids(fair_order([a2, b1, a1]))  # the policy put a2 first (late work re-deadlined)
    assert order.index("a2") < order.index("a1")


def test_a_late_request_keeps_its_place_and_gives_its_key_no_earlier_tag():
    f0, f1, f2, calm = tagged(*((f"f{i}", "critical", "flood") for i in range(3)),
                              ("calm", "critical", "calm"))  # fmt: skip
    # f0 is late: the policy put it behind its tier's on-time work. Dealt in, its tag (0, the
    # lowest) went to f1, which then tied the calm key's request and won on its place.
    assert ids(fair_order([f1, f2, calm, f0])) == ["f1", "calm", "f2", "f0"]
    assert ids(fair_order([f1, f2, calm, f0], late={"f0"})) == ["calm", "f1", "f2", "f0"]


def test_the_scheduler_serves_a_calm_key_before_the_backlog_of_a_flood():
    sched = make("flowprefill", workers=0)
    for i in range(6):
        sched.handle(RequestArrived(f"f{i}", "critical", 30, key_id="flood"), 0.0)
    sched.handle(RequestArrived("calm", "critical", 30, key_id="calm"), 0.01)
    # Deadline order alone would serve it last, behind 0.18 s of the flood.
    assert drain_order(sched, 0.02).index("calm") <= 1


def test_an_idle_keys_burst_within_its_credit_goes_before_the_floods_waiting_requests():
    """Without a credit, fair order deals a calm burst one for one with a backlogged flood;
    with one (its share of the tier's work), the burst runs first. A flood busy for longer
    than its own credit (its whole tier's, 0.83 s, while it was alone) has none left: its tags
    run past the virtual time, the start tag of the request in service."""
    sched = make("flowprefill")
    step(sched, RequestArrived("f0", "critical", 30, key_id="flood"), 0.0)
    for i in range(1, 45):
        assert step(sched, RequestArrived(f"f{i}", "critical", 30, key_id="flood"), 0.0) == []
    now = 0.0
    for i in range(36):  # 1.08 s of the flood served: past its credit
        now += 0.03
        assert step(sched, RequestDone(f"f{i}", "w0"), now) == [Assign(f"f{i + 1}", "w0")]
    for i in range(3):
        assert step(sched, RequestArrived(f"c{i}", "critical", 30, key_id="calm"), now) == []
    order, running = [], "f36"
    for _ in range(4):
        now += 0.03
        (assign,) = step(sched, RequestDone(running, "w0"), now)
        running = assign.request_id
        order.append(running)
    assert order == ["c0", "c1", "c2", "f37"]


def test_a_calm_request_longer_than_the_floods_is_not_starved():
    sched = make("flowprefill", workers=0)
    for i in range(8):
        sched.handle(RequestArrived(f"f{i}", "critical", 20, key_id="flood"), 0.0)
    sched.handle(RequestArrived("calm", "critical", 100, key_id="calm"), 0.01)
    for i in range(8, 12):  # the flood goes on
        sched.handle(RequestArrived(f"f{i}", "critical", 20, key_id="flood"), 0.015)
    assert drain_order(sched, 0.02).index("calm") <= 1


def test_without_keys_the_order_is_deadline_first():
    sched = make("flowprefill", workers=0)
    for i in range(4):
        sched.handle(RequestArrived(f"c{i}", "critical", 30), i * 0.001)
    assert drain_order(sched, 0.01) == ["c0", "c1", "c2", "c3"]


def test_the_scheduler_publishes_each_active_keys_committed_work():
    sched = make("flowprefill", workers=0, key_active_s=5.0)
    sched.handle(RequestArrived("f0", "critical", 100, key_id="flood", key_weight=2.0), 0.0)
    sched.handle(RequestArrived("f1", "critical", 200, key_id="flood", key_weight=2.0), 0.0)
    sched.handle(RequestArrived("c0", "critical", 100, key_id="calm"), 0.0)
    drain_order(sched, 0.0)  # all three done: nothing committed, both keys still active
    load = sched.tier_load("critical", 5.0)
    assert {(k.key_id, k.weight, k.committed_s) for k in load.keys} == {
        ("calm", 1.0, 0.0),
        ("flood", 2.0, 0.0),
    }
    sched.handle(RequestArrived("f2", "critical", 300, key_id="flood", key_weight=2.0), 6.0)
    load = sched.tier_load("critical", 6.0)  # calm was last seen 6 s ago: no longer active
    assert [(k.key_id, k.committed_s) for k in load.keys] == [("flood", pytest.approx(0.3))]
    assert load.committed_s == pytest.approx(0.3)


def test_a_request_with_a_weight_that_is_not_positive_is_rejected():
    sched = Scheduler(make_policy("flowprefill"), TIERS)
    commands = sched.handle(RequestArrived("r", "critical", 10, key_weight=0.0), 0.0)
    assert sched.state_of("r").value == "rejected", commands


def test_a_key_never_preempts_another_key_of_its_tier():
    # The calm key's request misses its deadline (0.2 s) behind the flood's running prefill
    # (0.25 s). Deadline first, that prefill would be stopped for it; fair order would then
    # rank the victim first again once the worker frees (a preempt/resume loop). Between keys
    # of a tier, order decides. (The full planner: with the default window, f1 is behind calm
    # in every order of its tier and preempts at its wake-up, test_scheduler_window.)
    sched = make("flowprefill", workers=1, plan_window=None)
    sched.handle(RequestArrived("f0", "critical", 250, key_id="flood", arrival_s=0.0), 0.0)
    commands = sched.handle(
        RequestArrived("calm", "critical", 100, key_id="calm", arrival_s=-0.8), 0.01
    )
    assert not [c for c in commands if isinstance(c, Preempt)]
    # The same request of the flood's own key does preempt it.
    commands = sched.handle(
        RequestArrived("f1", "critical", 100, key_id="flood", arrival_s=-0.8), 0.02
    )
    assert [c.request_id for c in commands if isinstance(c, Preempt)] == ["f0"]


def test_what_a_key_asks_decays_over_the_window_and_is_held_against_its_share():
    rates = SentRates(window_s=2.0)
    for i in range(60):  # 0.05 s of work every 0.1 s: 0.5 s a second, for 6 s
        rates.add("critical", "flood", 0.05, i * 0.1)
    # Each request's seconds weigh exp(-age / 2 s), over the 2 s window (6 s seen: 95 % of it).
    sent = sum(0.05 * math.exp(-(5.9 - i * 0.1) / 2.0) for i in range(60))
    window = 2.0 * (1 - math.exp(-5.9 / 2.0))
    assert rates.rate("critical", "flood", 5.9) == pytest.approx(sent / window)
    assert rates.rate("critical", "flood", 7.9) == pytest.approx(
        sent * math.exp(-1.0) / (2.0 * (1 - math.exp(-7.9 / 2.0)))
    )
    assert rates.rate("critical", "other", 5.9) == 0.0
    # About 0.5 s a second: over a quarter of one worker, within 0.6 of it.
    assert rates.over_share("critical", "flood", 0.25, 1, 5.9)
    assert not rates.over_share("critical", "flood", 0.6, 1, 5.9)
    assert not rates.over_share("standard", "flood", 0.25, 1, 5.9)  # nothing asked there
    assert not rates.over_share("critical", "flood", 0.25, 0, 5.9)  # no worker known


def test_a_key_just_begun_is_averaged_over_the_time_it_was_seen():
    rates = SentRates(window_s=10.0)
    for i in range(10):  # a flood: 0.05 s of work every 10 ms, 5 s a second, for 0.1 s
        rates.add("critical", "flood", 0.05, i * 0.01)
    assert rates.over_share("critical", "flood", 0.5, 1, 0.1)  # 0.5 s over its first 1 s
    rates.add("critical", "calm", 0.05, 0.0)  # one request: 0.05 s over its first 1 s
    assert rates.rate("critical", "calm", 0.0) == pytest.approx(0.05 / (10 * (1 - math.exp(-0.1))))
    assert not rates.over_share("critical", "calm", 0.5, 1, 0.0)


def test_only_a_key_admission_finds_within_its_share_gets_a_burst_credit():
    # The calm key's burst (0.6 s) runs with its credit; 10 of it served, two idle keys come.
    sched = make("flowprefill")
    for i in range(20):
        step(sched, RequestArrived(f"b{i}", "critical", 30, key_id="calm"), 0.0)
    now, running = 0.0, "b0"
    for _ in range(10):
        now += 0.03
        (assign,) = step(sched, RequestDone(running, "w0"), now)
        running = assign.request_id
    over = RequestArrived("over", "critical", 30, key_id="x", key_over_share=True)
    within = RequestArrived("within", "critical", 30, key_id="y")
    step(sched, over, now)
    step(sched, within, now)
    order = [running]
    for _ in range(11):
        now += 0.03
        (assign,) = step(sched, RequestDone(order[-1], "w0"), now)
        order.append(assign.request_id)
    # Within its share, a key's first request starts a whole credit before the virtual time:
    # first. Over it, at the virtual time, after the calm key's credited burst.
    assert order == ["b10", "within", *(f"b{i}" for i in range(11, 20)), "over"], order
    # The owner publishes each key's standing as its latest request carried it.
    load = sched.tier_load("critical", now)
    assert {k.key_id: k.over_share for k in load.keys} == {"calm": False, "x": True, "y": False}


def test_admission_counts_of_another_keys_work_only_what_fair_order_runs_first():
    # The flood's first eight 0.1 s requests come at once, within its share: its tags start a
    # whole credit (the 1 s tier) before the virtual time V. Four are served; then a calm
    # request arrives, its tag a credit before V too, and a second one is judged.
    sched = make("flowprefill")
    for i in range(8):
        step(sched, RequestArrived(f"f{i}", "critical", 100, key_id="flood"), 0.0)
    for i in range(4):
        (assign,) = step(sched, RequestDone(f"f{i}", "w0"), 0.1 * (i + 1))
    assert assign.request_id == "f4"
    step(sched, RequestArrived("c0", "critical", 100, key_id="calm"), 0.4)
    load = dataclasses.replace(sched.tier_load("critical", 0.4), calibrated=True)  # as if fitted
    # Admission now finds the flood over its share (eight requests at once). Laid out where
    # its tags lie, of its 0.4 s left fair order runs only f4 (running) before the newcomer,
    # whose tag (a credit before V, after c0) comes before f5's: it waits for f4 and c0, 0.2 s.
    over = {"flood": True, "calm": False}
    verdict = judge(TIERS["critical"], [load], 100, key_id="calm", standings=over)
    assert verdict.wait_s == pytest.approx(0.2)
    # A key within its share is laid out with its whole credit at least: a newcomer placed
    # before part of its work would delay that part, whose deadlines admission does not check
    # again. So is the flood while admission finds it within its share: 0.1 s more ahead.
    within = judge(TIERS["critical"], [load], 100, key_id="calm")
    assert within.wait_s == pytest.approx(0.3)
    # And that is the order the scheduler runs: f4, c0, the newcomer, then the flood.
    step(sched, RequestArrived("c1", "critical", 100, key_id="calm"), 0.4)
    order = [step(sched, RequestDone(rid, "w0"), t)[0].request_id
             for rid, t in (("f4", 0.5), ("c0", 0.6), ("c1", 0.7))]  # fmt: skip
    assert order == ["c0", "c1", "f5"]


def test_a_key_keeps_its_standing_through_a_burst_of_its_credit_but_not_past_it():
    rates = SentRates(window_s=10.0, min_age_s=0.1)
    # A calm key's start: four 0.1 s requests in 0.2 s, against a share of 0.5 s a second.
    for i in range(4):
        rates.add("critical", "calm", 0.1, i * 0.05)
    assert rates.over_share("critical", "calm", 0.5, 1, 0.2)  # by its rate alone
    assert not rates.over_share("critical", "calm", 0.5, 1, 0.2, burst_s=0.3)
    # A flood at 5 s a second is past its share and the same burst within 0.1 s.
    for i in range(10):
        rates.add("critical", "flood", 0.05, i * 0.01)
    assert rates.over_share("critical", "flood", 0.5, 1, 0.1, burst_s=0.3)


def test_what_a_key_held_at_once_is_its_peak_decaying_over_time():
    peaks = HeldPeaks(decay_s=30.0)
    assert peaks.peak("critical", "calm", 0.0) == 0.0
    peaks.hold("critical", "calm", 0.3, 0.0)
    peaks.hold("critical", "calm", 0.1, 1.0)  # less than the peak: the peak stays
    assert peaks.peak("critical", "calm", 1.0) == pytest.approx(0.3 * math.exp(-1 / 30))
    assert peaks.peak("critical", "calm", 31.0) == pytest.approx(0.3 * math.exp(-31 / 30))
    assert peaks.peak("standard", "calm", 1.0) == 0.0
