"""The scheduler with batched workers, on a fake clock: decode does not hold the prefill,
KV slots bound what a worker holds, and decode yields to higher tiers under pressure."""

from __future__ import annotations

from dataclasses import replace

from queue_service.scheduler import (
    Assign,
    DecodeStepDone,
    PauseDecode,
    Preempt,
    PreemptionAcked,
    PrefillFinished,
    PrefillTimePredictor,
    RequestDone,
    RequestState,
    Resume,
    Scheduler,
    SchedulerConfig,
    WorkerJoined,
    make_policy,
)
from tests.unit.test_scheduler import TIERS, arrive, step
from tierflow.tiers import TierTable


def batched(policy: str = "flowprefill", kv_slots: int = 3) -> Scheduler:
    sched = Scheduler(
        make_policy(policy),
        TIERS,
        PrefillTimePredictor(a=1e-3, b=0.0, c=0.0),  # 1000 tokens = 1 s
        SchedulerConfig(refit_predictor=False),
    )
    assert step(sched, WorkerJoined("w0", kv_slots=kv_slots), 0.0) == []
    return sched


def first_token(sched, rid, now, tokens=100):
    return step(sched, PrefillFinished(rid, "w0", tokens, 0.1), now)


def test_the_next_prefill_starts_while_the_first_request_decodes():
    sched = batched(kv_slots=3)
    assert arrive(sched, "a", "batch", 500, 0.0, new_tokens=200) == [Assign("a", "w0")]
    assert arrive(sched, "b", "batch", 200, 0.1, new_tokens=200) == []  # prefill busy
    # Unbatched, a would hold the worker for 200 tokens of decode; batched, b starts now.
    assert first_token(sched, "a", 0.5) == [Assign("b", "w0")]
    assert sched.state_of("a") is RequestState.DECODING
    assert arrive(sched, "c", "batch", 100, 0.6) == []
    assert first_token(sched, "b", 0.7) == [Assign("c", "w0")]
    assert arrive(sched, "d", "batch", 100, 0.8) == []
    # a and b decode, c prefills: 3 slots held. c's first token frees the prefill, not a slot.
    assert first_token(sched, "c", 0.9) == []
    assert step(sched, RequestDone("a", "w0"), 1.0) == [Assign("d", "w0")]


def test_full_kv_slots_drop_the_newest_lowest_tier_decode_for_a_higher_tier():
    sched = batched(kv_slots=2)
    for i, rid in enumerate(("x", "y")):
        assert arrive(sched, rid, "batch", 100, i * 0.1, new_tokens=300) == [Assign(rid, "w0")]
        assert first_token(sched, rid, i * 0.1 + 0.05) == []
    commands = arrive(sched, "c", "critical", 100, 0.3)
    assert commands == [PauseDecode("y", "w0", drop_state=True)]  # the newest batch decode
    ack = PreemptionAcked("y", "w0", 100, state_dropped=True)
    assert step(sched, ack, 0.35) == [Assign("c", "w0")]
    assert sched.state_of("y") is RequestState.QUEUED  # recomputes later
    assert sched.counters["decode_drops"] == 1


# Every tier decodes with a TBT target, so decode steps are slotted into a running prefill.
SLOTTED_TIERS = TierTable([replace(t, tbt_slo_s=0.5) for t in TIERS])


def slotting(
    kv_slots: int = 4, step_s: float = 0.25, tiers: TierTable = SLOTTED_TIERS
) -> Scheduler:
    """A flowprefill scheduler whose worker has learnt a decode step of ``step_s``: with the
    0.5 s TBT targets a prefill runs 1 / (1 - step_s / 0.5) times slower while rows decode."""
    sched = Scheduler(
        make_policy("flowprefill"),
        tiers,
        PrefillTimePredictor(a=1e-3, b=0.0, c=0.0),  # 1000 tokens = 1 s
        SchedulerConfig(refit_predictor=False),
    )
    assert step(sched, WorkerJoined("w0", kv_slots=kv_slots), 0.0) == []
    assert step(sched, DecodeStepDone("w0", rows=2, seconds=step_s), 0.0) == []
    return sched


def lower_tiers_decoding(sched) -> None:
    assert arrive(sched, "x", "batch", 100, 0.0, new_tokens=300) == [Assign("x", "w0")]
    assert first_token(sched, "x", 0.1) == []
    assert arrive(sched, "s", "standard", 100, 0.15, new_tokens=300) == [Assign("s", "w0")]
    assert first_token(sched, "s", 0.2) == []


def test_a_prefill_that_slotted_decode_would_make_late_pauses_lower_tiers_until_its_first_token():
    sched = slotting()
    lower_tiers_decoding(sched)
    # 450 tokens: 0.45 s x 1.2 (the error margin) = 0.54 s alone, on time for the 1 s SLO;
    # twice that with decode slotted in: late. Pausing the lower tiers saves it.
    commands = arrive(sched, "c", "critical", 450, 0.3)
    assert commands[0] == Assign("c", "w0")
    assert set(commands[1:]) == {PauseDecode("x", "w0", False), PauseDecode("s", "w0", False)}
    assert step(sched, PreemptionAcked("x", "w0", 100, False), 0.31) == []
    assert step(sched, PreemptionAcked("s", "w0", 100, False), 0.32) == []
    assert sched.suspended()["w0"] == ("x", "s")
    resumed = first_token(sched, "c", 0.8, tokens=450)
    assert set(resumed) == {Resume("x", "w0"), Resume("s", "w0")}
    assert sched.state_of("x") is RequestState.DECODING
    assert sched.counters["decode_pauses"] == 2 and sched.counters["decode_resumes"] == 2


def test_a_pause_that_cannot_save_the_deadline_is_not_made():
    # Late even alone (900 tokens: 1.08 s with the margin): pausing buys nothing.
    sched = slotting()
    lower_tiers_decoding(sched)
    assert arrive(sched, "c", "critical", 900, 0.3) == [Assign("c", "w0")]
    # A critical row decodes too: its own slotted steps slow the prefill as much as before.
    sched = slotting()
    assert arrive(sched, "k", "critical", 100, 0.0, new_tokens=300) == [Assign("k", "w0")]
    assert first_token(sched, "k", 0.1) == []
    lower_tiers_decoding(sched)
    assert arrive(sched, "c", "critical", 450, 0.3) == [Assign("c", "w0")]
    assert sched.counters.get("decode_pauses", 0) == 0


def test_rows_whose_target_is_looser_than_the_prefills_are_never_paused_for_it():
    """The worker steps no row inside a prefill whose tier's TBT target is tighter than the
    row's (worker.decode_slotting): with config/tiers.toml's targets (critical 0.4 s, standard
    1 s, batch 5 s) the lower tiers' rows cannot slow a critical prefill, so pausing them
    (a copy of each row's cache on the worker) would buy nothing."""
    targets = {"critical": 0.4, "standard": 1.0, "batch": 5.0}
    sched = slotting(tiers=TierTable([replace(t, tbt_slo_s=targets[t.name]) for t in TIERS]))
    lower_tiers_decoding(sched)
    # 700 tokens: 0.84 s with the margin, on time for the 1 s SLO; 1.12 s if the standard
    # row's steps (one per second) were slotted in, which they are not.
    assert arrive(sched, "c", "critical", 700, 0.3) == [Assign("c", "w0")]
    assert sched.counters.get("decode_pauses", 0) == 0


def test_a_prefill_on_time_leaves_decode_alone_and_fifo_never_pauses():
    sched = batched()
    assert arrive(sched, "x", "batch", 100, 0.0, new_tokens=300) == [Assign("x", "w0")]
    assert first_token(sched, "x", 0.1) == []
    assert arrive(sched, "c", "critical", 200, 0.2) == [Assign("c", "w0")]  # 0.2 s: on time
    fifo = batched("fifo")
    assert arrive(fifo, "x", "batch", 100, 0.0, new_tokens=300) == [Assign("x", "w0")]
    assert first_token(fifo, "x", 0.1) == []
    assert arrive(fifo, "c", "critical", 900, 0.2) == [Assign("c", "w0")]  # at risk, no pause


def full_worker(decode_tier: str) -> Scheduler:
    """Two KV slots: x (100 tokens, of ``decode_tier``) decodes, y (a batch prefill of 800
    tokens) runs since 0.2 s."""
    sched = batched(kv_slots=2)
    assert arrive(sched, "x", decode_tier, 100, 0.0, new_tokens=300) == [Assign("x", "w0")]
    assert first_token(sched, "x", 0.1) == []
    assert arrive(sched, "y", "batch", 800, 0.2) == [Assign("y", "w0")]
    return sched


def test_on_a_full_worker_a_cheaper_decode_is_dropped_instead_of_a_long_prefills_progress():
    # y has 0.5 s of its prefill done; x's decode costs 0.1 s to recompute: dropping y's state
    # would throw away five times the work (a batch request's recompute was once dropped 13
    # times on a full worker, until its preemption bound let it block two critical requests).
    sched = full_worker(decode_tier="batch")
    commands = arrive(sched, "c", "critical", 100, 0.7)
    assert commands == [Preempt("y", "w0", drop_state=False), PauseDecode("x", "w0", True)]
    # The prefill stops first: no slot yet, and no second decode is dropped meanwhile.
    assert step(sched, PreemptionAcked("y", "w0", 500, state_dropped=False), 0.71) == []
    ack = PreemptionAcked("x", "w0", 100, state_dropped=True)
    assert step(sched, ack, 0.72) == [Assign("c", "w0")]
    assert sched.state_of("y") is RequestState.SUSPENDED  # resumes where it stopped
    assert sched.state_of("x") is RequestState.QUEUED
    # c decodes; y takes the prefill back where it stopped (x waits for a free slot).
    assert first_token(sched, "c", 0.85) == [Resume("y", "w0")]


def test_a_decode_of_a_higher_tier_than_the_victim_is_not_dropped_to_spare_it():
    sched = full_worker(decode_tier="standard")
    commands = arrive(sched, "c", "critical", 100, 0.7)
    assert commands == [Preempt("y", "w0", drop_state=True)]


def test_preempting_a_prefill_on_a_full_worker_drops_its_state_to_make_room():
    # Kept, the victim's state would fill the last slot: the higher tier could not start on
    # the freed prefill, which would go straight back to the victim (a preempt/resume loop).
    sched = batched(kv_slots=2)
    assert arrive(sched, "x", "batch", 100, 0.0, new_tokens=300) == [Assign("x", "w0")]
    assert first_token(sched, "x", 0.1) == []
    assert arrive(sched, "y", "batch", 800, 0.2) == [Assign("y", "w0")]
    commands = arrive(sched, "c", "critical", 100, 0.3)
    assert Preempt("y", "w0", drop_state=True) in commands
    ack = PreemptionAcked("y", "w0", 100, state_dropped=True)
    assert Assign("c", "w0") in step(sched, ack, 0.31)
    assert sched.state_of("y") is RequestState.QUEUED
    assert first_token(sched, "c", 0.45) == []  # x and c decode: both slots held
    assert step(sched, RequestDone("x", "w0"), 0.5) == [Assign("y", "w0")]
