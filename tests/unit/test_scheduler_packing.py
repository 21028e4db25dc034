"""Packed prefill and decode-step timing in the scheduler, on a fake clock.

1000 prompt tokens = 1 s of prefill (packed or not, until packs are measured); SLOs: critical
1 s, standard 5 s, batch 100 s; the prediction margin is 0.2 until measured.
"""

from __future__ import annotations

import pytest

from queue_service.scheduler import (
    Assign,
    AssignPacked,
    DecodeStepDone,
    PauseDecode,
    Preempt,
    PreemptionAcked,
    PrefillFinished,
    PrefillTimePredictor,
    RequestArrived,
    RequestCancelled,
    RequestDone,
    RequestState,
    Resume,
    Scheduler,
    SchedulerConfig,
    WorkerJoined,
    make_policy,
)
from tests.unit.test_scheduler import TIERS, arrive, step
from tierflow.tiers import TierPolicy, TierTable


def batched(policy="flowprefill", kv_slots=8, tiers=TIERS, **config) -> Scheduler:
    config.setdefault("refit_predictor", False)
    sched = Scheduler(
        make_policy(policy),
        tiers,
        PrefillTimePredictor(a=1e-3, b=0.0, c=0.0),
        SchedulerConfig(**config),
    )
    assert step(sched, WorkerJoined("w0", kv_slots=kv_slots), 0.0) == []
    return sched


def first_token(sched, rid, now, tokens=100, prefill_s=0.1, pack_tokens=0):
    return step(sched, PrefillFinished(rid, "w0", tokens, prefill_s, pack_tokens), now)


def busy_with(sched, rid="long", tier="critical", tokens=400) -> None:
    """The worker prefills ``rid`` from t=0, so that the next arrivals wait for it (a critical
    request: no later arrival may preempt it)."""
    assert arrive(sched, rid, tier, tokens, 0.0, new_tokens=50) == [Assign(rid, "w0")]


def test_waiting_short_prompts_are_packed_into_one_prefill():
    sched = batched()
    busy_with(sched)
    for i, rid in enumerate(("a", "b", "c")):
        assert arrive(sched, rid, "standard", 100, 0.1 + 0.01 * i) == []
    # 300 tokens, 0.3 s x 1.2: every member makes its 5 s SLO in the pack.
    assert first_token(sched, "long", 0.4) == [AssignPacked(("a", "b", "c"), "w0")]
    assert all(sched.state_of(r) is RequestState.RUNNING for r in "abc")
    assert sched.running()["w0"] == "a" and sched.counters["packs"] == 1
    # Each member reports its own first token; the worker's prefill is free after the pack.
    assert arrive(sched, "d", "standard", 100, 0.5) == []
    assert first_token(sched, "a", 0.7, pack_tokens=300, prefill_s=0.3) == [Assign("d", "w0")]
    for rid in ("b", "c"):
        assert first_token(sched, rid, 0.7, pack_tokens=300, prefill_s=0.3) == []
    assert all(sched.state_of(r) is RequestState.DECODING for r in "abc")


def test_a_pack_ends_before_a_member_whose_deadline_it_would_break():
    sched = batched()
    busy_with(sched)
    assert arrive(sched, "c", "critical", 100, 0.1) == []  # due at 1.1
    assert arrive(sched, "c1", "critical", 200, 0.1) == []
    assert arrive(sched, "c2", "critical", 200, 0.2) == []
    assert arrive(sched, "c3", "critical", 100, 0.3) == []
    # At 0.5, c + c1 + c2: 500 tokens, 0.5 s x 1.2 -> done at 1.1, c's deadline: packed.
    # With c3, 1.22: c would miss a deadline it makes alone (0.62): the pack ends before c3.
    assert first_token(sched, "long", 0.5) == [AssignPacked(("c", "c1", "c2"), "w0")]


def test_a_prefill_that_cannot_be_packed_is_passed_over_only_while_it_makes_its_deadline():
    sched = batched(policy="priority", max_pack_tokens=512)
    busy_with(sched)
    assert arrive(sched, "a", "standard", 100, 0.1) == []
    assert arrive(sched, "big", "standard", 600, 0.2) == []  # too long to pack
    assert arrive(sched, "b", "standard", 100, 0.3) == []
    # a + b done at 0.64, then big's 0.72 s: 1.36, inside its deadline (5.2): it is passed.
    assert first_token(sched, "long", 0.4) == [AssignPacked(("a", "b"), "w0")]
    # 3850 tokens: 4.62 s. After a alone (0.52) big makes 5.2; after a + b (0.64) it would
    # not: the pack ends before b, and big goes next.
    tight = batched(policy="priority", max_pack_tokens=512)
    busy_with(tight)
    assert arrive(tight, "a", "standard", 100, 0.1) == []
    assert arrive(tight, "big", "standard", 3850, 0.2) == []
    assert arrive(tight, "b", "standard", 100, 0.3) == []
    assert first_token(tight, "long", 0.4) == [Assign("a", "w0")]
    assert first_token(tight, "a", 0.52) == [Assign("big", "w0")]
    # Limits: at most max_pack_size requests and max_pack_tokens tokens together.
    small = batched(max_pack_size=2)
    busy_with(small)
    for i, rid in enumerate("xyz"):
        assert arrive(small, rid, "standard", 50, 0.1 + 0.01 * i) == []
    assert first_token(small, "long", 0.4) == [AssignPacked(("x", "y"), "w0")]


def test_a_pack_holds_one_tier_and_a_suspended_prefill_resumes_after_it():
    """The standard prompts pack; the batch prompt ranked between them does not join (a pack
    is preempted as one, so a mixed pack would let a critical arrival stop standard members
    with it), and the suspended batch prefill resumes once the pack is done."""
    sched = batched()
    assert arrive(sched, "bg", "batch", 2000, 0.0) == [Assign("bg", "w0")]
    assert arrive(sched, "c", "critical", 500, 0.1) == [Preempt("bg", "w0", False)]
    assert step(sched, PreemptionAcked("bg", "w0", 300, False), 0.15) == [Assign("c", "w0")]
    assert arrive(sched, "s", "standard", 100, 0.2) == []
    assert arrive(sched, "x", "batch", 100, 0.3) == []
    assert arrive(sched, "s2", "standard", 100, 0.31) == []
    assert first_token(sched, "c", 0.7, tokens=500) == [AssignPacked(("s", "s2"), "w0")]
    assert sched.suspended()["w0"] == ("bg",)
    assert sched.state_of("x") is RequestState.QUEUED
    # Once the pack is done the suspended prefill resumes where it stopped.
    assert first_token(sched, "s", 1.0, pack_tokens=200, prefill_s=0.2) == [Resume("bg", "w0")]


def test_a_pack_holds_one_key_and_the_other_keys_requests_pack_after_it():
    """The flood's requests ranked after the calm key's first one do not ride in its pack
    (they would delay its first token); the calm key's next request, ranked after them, does,
    and the flood's form a pack of their own next."""
    sched = batched()
    busy_with(sched)

    def keyed(rid, key, now):
        event = RequestArrived(rid, "standard", 100, 0, key_id=key)
        return step(sched, event, now)

    assert keyed("c1", "calm", 0.1) == []
    for i, rid in enumerate(("f1", "f2", "f3")):
        assert keyed(rid, "flood", 0.11 + 0.01 * i) == []
    assert keyed("c2", "calm", 0.2) == []
    assert first_token(sched, "long", 0.4) == [AssignPacked(("c1", "c2"), "w0")]
    flood = [AssignPacked(("f1", "f2", "f3"), "w0")]
    assert first_token(sched, "c1", 0.6, pack_tokens=200, prefill_s=0.2) == flood


def test_a_running_pack_counts_as_one_prefill_in_the_committed_work():
    """Admission's load (``tier_load``) counts a running pack's predicted time, one fixed cost
    for the pack, less the time it has run, and a waiting key's burst the same way."""
    sched = Scheduler(
        make_policy("flowprefill"),
        TIERS,
        PrefillTimePredictor(a=1e-3, b=0.0, c=0.05),  # 100 tokens alone: 0.15 s
        SchedulerConfig(refit_predictor=False),
    )
    assert step(sched, WorkerJoined("w0", kv_slots=8), 0.0) == []
    busy_with(sched)
    for i, rid in enumerate(("a", "b", "c")):
        assert arrive(sched, rid, "standard", 100, 0.1 + 0.01 * i) == []
    # Waiting: 300 tokens and one fixed cost (0.35 s), not three (0.45 s).
    assert sched.tier_load("standard", 0.3).committed_s == pytest.approx(0.35)
    assert first_token(sched, "long", 0.5) == [AssignPacked(("a", "b", "c"), "w0")]
    # Running since 0.5: 0.1 s of the pack's 0.35 s done.
    assert sched.tier_load("standard", 0.6).committed_s == pytest.approx(0.25)


def test_a_pack_gives_way_to_a_higher_tier_only():
    """A late pack is not preempted for a request of its own tier, even one that ranks first
    and misses its deadline behind it: stopping every member for one newcomer of their tier,
    and packing it with them again, would loop at each arrival (a higher tier preempts a pack:
    ``test_a_pack_is_preempted_and_resumed_as_one_unit``)."""
    sched = batched()
    busy_with(sched, tokens=1000)
    for i, rid in enumerate(("a", "b")):
        assert arrive(sched, rid, "critical", 250, 0.1 + 0.01 * i) == []
    # Started at 1.0, the pack is late (a is due at 1.1): it ranks as due one SLO from now.
    assert first_token(sched, "long", 1.0) == [AssignPacked(("a", "b"), "w0")]
    assert arrive(sched, "c", "critical", 700, 1.05) == []  # due at 2.05
    # At 1.06 c ranks first (2.05 < 2.06) and misses its deadline behind the pack: it waits.
    assert arrive(sched, "x", "batch", 100, 1.06) == []
    assert sched.state_of("a") is RequestState.RUNNING


def test_a_higher_tier_waits_for_the_whole_pack_not_its_first_member():
    """The planner reads a running pack's work left as the whole pack's (``packing.work_left``),
    not its first member's alone: a tight lower-tier pack of 0.46 s left keeps its turn before a
    critical request that still makes its deadline behind all of it. Read as its first member's
    part, the pack looked as if it could yield and lose nothing, and was preempted, its four
    members then past their deadlines."""
    tiers = TierTable(
        [
            TierPolicy("critical", 0, 2.0),
            TierPolicy("standard", 1, 4.7),
            TierPolicy("batch", 2, 100.0, sheddable=True),
        ]
    )
    sched = batched(tiers=tiers)
    busy_with(sched, tokens=4000)  # 4 s
    for rid in "abcd":  # due at 4.7: 512 tokens packed from 4.0, 1.2 x 0.512 s, fit
        assert step(sched, RequestArrived(rid, "standard", 128, arrival_s=0.0), 0.01) == []
    assert first_token(sched, "long", 4.0) == [AssignPacked(tuple("abcd"), "w0")]
    # Due at 6.05, it makes it behind the pack's 0.462 s left. Held off for its 0.2 s x 1.2,
    # the pack (0.188 s to spare) would miss 4.7; its first member's 0.078 s would not.
    assert arrive(sched, "premium", "critical", 200, 4.05) == []
    assert all(sched.state_of(r) is RequestState.RUNNING for r in "abcd")


def test_no_pack_without_free_kv_slots_nor_on_a_single_slot_worker():
    sched = batched(kv_slots=3)
    busy_with(sched)
    for i, rid in enumerate("abc"):
        assert arrive(sched, rid, "standard", 50, 0.1 + 0.01 * i) == []
    # "long" decodes in one slot: two are left for a and b.
    assert first_token(sched, "long", 0.4) == [AssignPacked(("a", "b"), "w0")]
    single = batched(kv_slots=1)  # one request at a time: the same engine, batch size 1
    busy_with(single)
    assert arrive(single, "a", "standard", 50, 0.1) == []
    assert arrive(single, "b", "standard", 50, 0.1) == []
    assert first_token(single, "long", 0.4) == []  # it decodes in the only slot


def test_a_pack_is_preempted_and_resumed_as_one_unit():
    sched = batched()
    busy_with(sched, tier="batch")
    for i, rid in enumerate(("a", "b")):
        assert arrive(sched, rid, "batch", 200, 0.1 + 0.01 * i) == []
    assert first_token(sched, "long", 0.4) == [AssignPacked(("a", "b"), "w0")]
    # 900 critical tokens cannot wait for the 0.4 s pack: one Preempt per member.
    commands = arrive(sched, "c", "critical", 900, 0.45)
    assert commands == [Preempt("a", "w0", False), Preempt("b", "w0", False)]
    # The first ack means the pack stopped: c starts. The batch decode goes on: no decode is
    # slotted in at these tiers' settings, so pausing it would not make c any earlier.
    assert step(sched, PreemptionAcked("a", "w0", 0, False), 0.46) == [Assign("c", "w0")]
    assert step(sched, PreemptionAcked("b", "w0", 0, False), 0.46) == []
    assert sched.suspended()["w0"] == ("a", "b")
    assert sched.state_of("long") is RequestState.DECODING
    # One Resume (of the best-ranked member) resumes both.
    assert first_token(sched, "c", 1.3, tokens=900) == [Resume("a", "w0")]
    assert all(sched.state_of(r) is RequestState.RUNNING for r in "ab")
    assert first_token(sched, "b", 1.6, pack_tokens=400, prefill_s=0.4) == []
    assert first_token(sched, "a", 1.6, pack_tokens=400, prefill_s=0.4) == []
    assert sched.running()["w0"] is None


def test_a_member_whose_stop_is_acknowledged_after_the_resume_runs_with_its_pack():
    """The worker resumes the whole pack it stopped. A member whose acknowledgement comes
    after the Resume runs with it: counted as suspended, it would be resumed again later, and
    the worker would add a decode row it already has (its engine thread died on that)."""
    sched = batched()
    busy_with(sched, tier="batch")
    for i, rid in enumerate(("a", "b")):
        assert arrive(sched, rid, "batch", 200, 0.1 + 0.01 * i) == []
    assert first_token(sched, "long", 0.4) == [AssignPacked(("a", "b"), "w0")]
    assert arrive(sched, "c", "critical", 900, 0.45) == [
        Preempt("a", "w0", False),
        Preempt("b", "w0", False),
    ]
    assert step(sched, PreemptionAcked("a", "w0", 0, False), 0.46) == [Assign("c", "w0")]
    # c's first token comes before b's acknowledgement: one Resume resumes both.
    assert first_token(sched, "c", 1.3, tokens=900) == [Resume("a", "w0")]
    assert step(sched, PreemptionAcked("b", "w0", 0, False), 1.31) == []  # stale: it runs
    assert all(sched.state_of(r) is RequestState.RUNNING for r in "ab")
    assert sched.suspended()["w0"] == ()
    for rid in ("a", "b"):
        assert first_token(sched, rid, 1.6, pack_tokens=400, prefill_s=0.4) == []
    assert all(sched.state_of(r) is RequestState.DECODING for r in "ab")


def test_a_cancelled_first_member_hands_the_prefill_to_the_rest_of_its_pack():
    sched = batched()
    busy_with(sched)
    for i, rid in enumerate(("a", "b")):
        assert arrive(sched, rid, "standard", 100, 0.1 + 0.01 * i) == []
    assert first_token(sched, "long", 0.4) == [AssignPacked(("a", "b"), "w0")]
    assert step(sched, RequestCancelled("a"), 0.45)[0].request_id == "a"
    assert sched.running()["w0"] == "b"  # the pack goes on for b: the prefill is not free
    assert arrive(sched, "d", "standard", 100, 0.5) == []
    assert first_token(sched, "b", 0.6, pack_tokens=200, prefill_s=0.2) == [Assign("d", "w0")]


def test_measured_packs_teach_the_pack_cost():
    """Packs measured 3x slower than one prompt of their length: packing then stops where
    the learnt cost would break a deadline."""
    sched = batched(refit_predictor=True)

    def pair_after_a_blocker(i: int, now: float) -> list:
        blocker, ids = f"blk{i}", (f"p{i}a", f"p{i}b")
        assert arrive(sched, blocker, "critical", 100, now) == [Assign(blocker, "w0")]
        for rid in ids:
            assert arrive(sched, rid, "critical", 150, now + 0.01) == []
        commands = first_token(sched, blocker, now + 0.1)
        for rid in (blocker, *ids):
            step(sched, PrefillFinished(rid, "w0", 150, 0.9, 300), now + 1.0)
            step(sched, RequestDone(rid, "w0"), now + 1.0)
        return commands

    for i in range(8):
        assert pair_after_a_blocker(i, 2.0 * i) == [AssignPacked((f"p{i}a", f"p{i}b"), "w0")]
    # 300 tokens are now predicted to take ~0.9 s (x 1.2): the pair would miss its 1 s SLO.
    assert pair_after_a_blocker(8, 20.0) == [Assign("p8a", "w0")]


def test_decode_step_times_count_against_a_prefill_on_the_same_worker():
    tiers = TierTable(
        [
            TierPolicy("critical", 0, 1.0, tbt_slo_s=0.2),
            TierPolicy("standard", 1, 5.0, tbt_slo_s=0.2),
            TierPolicy("batch", 2, 100.0, sheddable=True, tbt_slo_s=0.2),
        ]
    )
    sched = batched(kv_slots=4, tiers=tiers, max_pack_size=1)
    assert arrive(sched, "x", "batch", 100, 0.0, new_tokens=300) == [Assign("x", "w0")]
    assert first_token(sched, "x", 0.1) == []
    # 600 tokens: 0.6 s x 1.2 = 0.72 s, on time (due at 1.2): decode is left alone...
    assert arrive(sched, "c", "critical", 600, 0.2) == [Assign("c", "w0")]
    # ...until the worker reports 0.1 s steps: one per 0.2 s TBT doubles the prefill's time.
    assert step(sched, DecodeStepDone("w0", 1, 0.1), 0.21) == []
    assert arrive(sched, "s", "standard", 10, 0.22) == [PauseDecode("x", "w0", False)]
