"""Admission of a tier against its capacity: the rule (``scheduler.capacity``), the view shared
between instances (``core.capacity_board``) and the scheduler's committed work, on fake clocks."""

from __future__ import annotations

import dataclasses
import math

import pytest

from queue_service.core.capacity_board import (
    CapacityBoard,
    Placement,
    PublishedLoad,
    load_record,
    published_load,
)
from queue_service.scheduler import (
    Assign,
    PrefillFinished,
    PrefillSample,
    PrefillTimePredictor,
    RequestArrived,
    RequestDone,
    Scheduler,
    SchedulerConfig,
    WorkerJoined,
)
from queue_service.scheduler.admission_error import AdmissionErrors
from queue_service.scheduler.capacity import (
    MIN_SHARE_LEFT,
    KeyLoad,
    Pending,
    TierLoad,
    judge,
    predict_prefill_s,
    share_left,
)
from tierflow.tiers import TierPolicy, TierTable, loads_tiers

# 1 ms a prompt token, nothing else: a 100-token prompt prefills in 0.1 s.
PER_TOKEN = (1e-3, 0.0, 0.0)
CRITICAL = TierPolicy("critical", 0, ttft_slo_s=0.3, overflow="downgrade")
TIERS = TierTable(
    [
        CRITICAL,
        TierPolicy("standard", 1, ttft_slo_s=3.0),
        TierPolicy("batch", 2, ttft_slo_s=120.0, sheddable=True),
    ]
)


def load(committed_s: float, *, workers: int = 1, margin: float = 0.0, tier: str = "critical",
         switch_s: float = 0.0, calibrated: bool = True) -> TierLoad:  # fmt: skip
    return TierLoad(tier, workers, committed_s, switch_s, margin, PER_TOKEN, calibrated)


# ----------------------------------------------------------------------------- the rule


def test_a_request_is_admitted_exactly_while_it_still_meets_the_slo_behind_the_committed_work():
    # 0.15 s committed + 0.1 s own = 0.25 s <= 0.3 s; 0.25 + 0.1 = 0.35 s > 0.3 s.
    assert judge(CRITICAL, [load(0.15)], 100).admit
    refused = judge(CRITICAL, [load(0.25)], 100)
    assert not refused.admit
    assert refused.predicted_ttft_s == pytest.approx(0.35)
    assert refused.retry_after_s == 1
    assert "0.35 s" in refused.reason() and "0.3 s" in refused.reason()


def test_workers_share_the_committed_work_and_the_switch_adds_to_it():
    assert judge(CRITICAL, [load(0.38, workers=2)], 100).admit  # 0.19 + 0.1
    assert not judge(CRITICAL, [load(0.38, workers=1)], 100).admit
    # 0.1 + (1 + 0.4) * 0.1 = 0.24 and a switch of 0.05 s: within; one of 0.07 s: over.
    assert judge(CRITICAL, [load(0.1, margin=0.4, switch_s=0.05)], 100).admit
    assert not judge(CRITICAL, [load(0.1, margin=0.4, switch_s=0.07)], 100).admit


def test_the_margin_inflates_the_work_ahead_only_for_a_key_over_its_share():
    # 0.15 s ahead and a 50 ms prompt at a margin of 1.0. Within its share only its own
    # prefill is inflated: 0.15 + 2 x 0.05 = 0.25 s, admitted.
    within = judge(CRITICAL, [load(0.15, margin=1.0)], 50, standings={"": False})
    assert within.admit and within.predicted_ttft_s == pytest.approx(0.25)
    assert within.inflated_s == pytest.approx(0.05)
    # Over its share the work ahead is inflated too: 2 x (0.15 + 0.05) = 0.4 s, refused.
    over = judge(CRITICAL, [load(0.15, margin=1.0)], 50, standings={"": True})
    assert not over.admit and over.predicted_ttft_s == pytest.approx(0.4)
    # Its own prefill is inflated either way: a 120 ms prompt is 0.24 s at that margin,
    # refused behind 0.1 s of work.
    assert not judge(CRITICAL, [load(0.1, margin=1.0)], 120, standings={"": False}).admit


def test_a_prompt_whose_own_prefill_exceeds_the_slo_is_refused_on_an_idle_tier():
    assert not judge(CRITICAL, [load(0.0)], 400).admit  # 0.4 s alone


def test_requests_admitted_but_not_yet_counted_by_any_load_count_too():
    one = Pending("", 1.0, 100)
    assert judge(CRITICAL, [load(0.0)], 100, [one]).admit
    assert not judge(CRITICAL, [load(0.0)], 100, [one, one]).admit


def test_the_loads_of_several_owners_add_up():
    owners = [load(0.19), load(0.19)]  # 0.38 s on 2 workers: 0.19 + 0.1 fits
    assert judge(CRITICAL, owners, 100).admit
    assert not judge(CRITICAL, owners, 200).admit


def test_no_rule_without_a_worker_or_a_measured_predictor():
    assert judge(CRITICAL, [], 100) is None
    assert judge(CRITICAL, [load(99.0, workers=0)], 100) is None
    assert judge(CRITICAL, [load(99.0, calibrated=False)], 100) is None


def keyed(**committed: float) -> TierLoad:
    """A critical load split between keys of weight 1 (committed seconds per key)."""
    keys = tuple(KeyLoad(k, 1.0, c) for k, c in committed.items())
    return TierLoad("critical", 1, sum(committed.values()), 0.0, 0.0, PER_TOKEN, True, keys)


def test_a_key_within_its_share_is_admitted_ahead_of_another_keys_flood():
    # The flood holds 0.25 s of the 0.3 s tier; one key alone would refuse the newcomer.
    assert not judge(CRITICAL, [load(0.25)], 100).admit
    # In fair order it waits for as much of the flood as its own work (0.1 s), then runs 0.1 s.
    assert judge(CRITICAL, [keyed(flood=0.25, calm=0.0)], 100, key_id="calm").admit


def test_a_key_over_its_share_leaves_the_other_active_keys_share_free():
    # Capacity 0.3 s of work, 0.15 s a key. The flood (0.1 s, + 0.04 s own) is within its share.
    assert judge(CRITICAL, [keyed(flood=0.1, calm=0.0)], 40, key_id="flood").admit
    # Over its share (0.14 + 0.04 > 0.15): the calm key's unused 0.15 s is kept for it.
    assert not judge(CRITICAL, [keyed(flood=0.14, calm=0.0)], 40, key_id="flood").admit
    # With the calm key inactive (gone from the load) the flood may use the whole tier.
    assert judge(CRITICAL, [keyed(flood=0.14)], 40, key_id="flood").admit


def flooding(flood: float, calm: float, *, running_s: float = 0.0, **changes) -> TierLoad:
    """A critical load of a flood over its share of the tier's rate and a calm key within it."""
    keys = (
        KeyLoad("flood", 1.0, flood, running_s=running_s, over_share=True),
        KeyLoad("calm", 1.0, calm),
    )
    return dataclasses.replace(keyed(flood=flood, calm=calm), keys=keys, **changes)


def test_a_key_over_its_share_borrows_the_tiers_spare_capacity_only_below_its_borrow_limit():
    """The tier runs before every lower tier: what a key borrows past its share they lose."""
    capped = dataclasses.replace(CRITICAL, borrow_limit=0.5)
    idle = dataclasses.replace(flooding(0.0, 0.0), busy_share=0.3)
    busy = dataclasses.replace(flooding(0.0, 0.0), busy_share=0.6)
    assert judge(capped, [idle], 40, key_id="flood").admit
    refused = judge(capped, [busy], 40, key_id="flood")
    assert not refused.admit and refused.borrow_closed and refused.predicted_ttft_s < 0.3
    assert "spare capacity" in refused.reason() and "60%" in refused.reason()
    assert judge(capped, [busy], 40, key_id="calm").admit  # within its share: not held to it
    assert judge(CRITICAL, [busy], 40, key_id="flood").admit  # no limit: the whole workers
    # Two owners: their busy shares weighted by their workers (0.9 and 0.1 x 3: 0.3 in all).
    two = [dataclasses.replace(flooding(0.0, 0.0, workers=w), busy_share=b)
           for w, b in ((1, 0.9), (3, 0.1))]  # fmt: skip
    assert judge(capped, two, 40, key_id="flood").admit


def test_a_key_within_its_share_waits_for_none_of_the_waiting_work_of_a_key_over_its_share():
    # The calm key has 0.1 s committed and a 0.05 s newcomer: within its burst credit (the
    # tier's capacity, 0.3 s) fair order runs them before the flood's waiting 0.25 s.
    verdict = judge(CRITICAL, [flooding(0.25, 0.1)], 50, key_id="calm")
    assert verdict.admit and verdict.predicted_ttft_s == pytest.approx(0.15)
    # Past its credit (0.25 + 0.1 - 0.3 = 0.05 s), as much of the flood's work is dealt in.
    beyond = judge(CRITICAL, [flooding(0.25, 0.25)], 100, key_id="calm")
    assert not beyond.admit and beyond.predicted_ttft_s == pytest.approx(0.25 + 0.05 + 0.1)
    # Two keys within their share both have the credit: dealt one for one from V - 0.3 s, the
    # newcomer (ending 0.15 s into it) waits for 0.15 s of the other key's work.
    both = judge(CRITICAL, [keyed(flood=0.25, calm=0.1)], 50, key_id="calm")
    assert both.predicted_ttft_s == pytest.approx(0.1 + 0.15 + 0.05)


def test_admission_lays_keys_out_where_their_tags_lie_not_as_if_credits_were_unspent():
    # The calm key's 0.1 s ends 0.05 s past V (its credit spent in a burst); the flood, over its
    # share, has 0.25 s dealt 0.2 s before V (with its credit, before it went over). A calm
    # newcomer of 0.05 s starts after its key's work, at 0.05 s, and all the flood's work comes
    # first: 0.1 + 0.25 + 0.05 s.
    load = flooding(0.25, 0.1)
    flood, calm = load.keys
    placed = dataclasses.replace(
        load, keys=(dataclasses.replace(flood, lead_s=0.2), dataclasses.replace(calm, lead_s=0.05))
    )
    verdict = judge(CRITICAL, [placed], 50, key_id="calm")
    assert not verdict.admit and verdict.predicted_ttft_s == pytest.approx(0.4)
    # Laid out as if the calm key's credit (the 0.3 s tier) were unspent and the flood's work
    # began at V, none of the flood's work was counted ahead: 0.1 + 0.05 s.
    assert judge(CRITICAL, [load], 50, key_id="calm").predicted_ttft_s == pytest.approx(0.15)


def test_a_flood_newcomer_waits_for_a_calm_keys_work_wherever_its_tags_lie():
    # The calm key's 0.2 s lies past V in fair order (its tags ran ahead), so a flood newcomer
    # at V would be dealt in before it; admission still counts all of it ahead, as it would
    # be delayed: 0.2 + 0.05 s.
    load = flooding(0.0, 0.2)
    calm = dataclasses.replace(load.keys[1], lead_s=-0.1)
    load = dataclasses.replace(load, keys=(load.keys[0], calm))
    verdict = judge(CRITICAL, [load], 50, key_id="flood")
    assert verdict.predicted_ttft_s == pytest.approx(0.25)


def test_a_key_over_its_share_leaves_free_what_a_calm_key_held_at_its_bursts():
    # The calm key holds 0.1 s; its share is 0.15 s, but it held 0.25 s at once lately. A
    # flood newcomer of 0.1 s leaves that free: 0.1 + 0.15 + 0.1 s > 0.3 s.
    assert judge(CRITICAL, [flooding(0.0, 0.1)], 100, key_id="flood").admit
    peaks = {"calm": 0.25}
    verdict = judge(CRITICAL, [flooding(0.0, 0.1)], 100, key_id="flood", peaks=peaks)
    assert not verdict.admit and verdict.predicted_ttft_s == pytest.approx(0.35)
    # At most its credit, the whole 0.3 s tier: a peak past it keeps no more.
    huge = judge(CRITICAL, [flooding(0.0, 0.1)], 10, key_id="flood", peaks={"calm": 9.0})
    assert huge.predicted_ttft_s == pytest.approx(0.3 + 0.01)


def test_admission_keeps_what_a_calm_key_holds_at_its_bursts_for_it():
    clock = Clock()
    board = board_with(clock, PublishedLoad("owner", clock.now, keyed(flood=0.0, calm=0.0), {}))
    for _ in range(200):  # the flood asks 0.05 s every 10 ms for 2 s: over its share
        clock.now += 0.01
        board.place("critical", 50, "flood")
    # Idle, the calm key's share (0.15 s) is kept: 0.15 s of the flood's newcomer fits.
    assert board.place("critical", 150, "flood").served_tier == "critical"
    # The calm key asks for 0.25 s at once (a burst, refused or not) ...
    board.place("critical", 250, "calm")
    assert board._held.peak("critical", "calm", clock.now) == pytest.approx(0.25)
    # ... and that, not its share, is kept free for it: the same newcomer no longer fits.
    assert board.place("critical", 150, "flood").served_tier == "standard"


def test_a_key_over_its_share_gets_only_what_the_key_within_its_share_leaves():
    # Nothing of its own committed, yet over its share of the rate: the calm key's committed
    # 0.1 s runs first and its unused share (0.15 - 0.1 s) is kept free: 0.1 + 0.05 + 0.1 s.
    verdict = judge(CRITICAL, [flooding(0.0, 0.1)], 100, key_id="flood")
    assert verdict.admit and verdict.predicted_ttft_s == pytest.approx(0.25)
    assert not judge(CRITICAL, [flooding(0.06, 0.1)], 100, key_id="flood").admit


def test_a_key_that_any_owner_finds_over_its_share_is_over_it():
    # Two owners, a worker each (capacity 0.6 s, 0.3 s a key). The flood's 0.2 s newcomer with
    # nothing committed: within its share it is admitted; over it at either owner, the calm
    # key's unused 0.3 s is kept free: 0.3 / 2 + 0.2 = 0.35 s.
    within = [keyed(flood=0.0, calm=0.0), keyed(flood=0.0, calm=0.0)]
    assert judge(CRITICAL, within, 200, key_id="flood").admit
    over = [flooding(0.0, 0.0), keyed(flood=0.0, calm=0.0)]
    verdict = judge(CRITICAL, over, 200, key_id="flood")
    assert not verdict.admit and verdict.predicted_ttft_s == pytest.approx(0.35)


def test_another_keys_running_prefill_is_ahead_even_within_the_burst_credit():
    # As above, the calm key's 50-token newcomer is inside its burst credit, but 0.2 s of the
    # flood's work is prefilling now: a newcomer due later does not preempt it, so it waits.
    verdict = judge(CRITICAL, [flooding(0.25, 0.1, running_s=0.2)], 50, key_id="calm")
    assert not verdict.admit and verdict.predicted_ttft_s == pytest.approx(0.1 + 0.2 + 0.05)
    # Fair order's part counts when it is the larger: 0.08 s dealt in, 0.05 s running.
    beyond = flooding(0.25, 0.28, running_s=0.05)
    assert judge(CRITICAL, [beyond], 100, key_id="calm").predicted_ttft_s == pytest.approx(
        0.28 + 0.08 + 0.1
    )


def test_a_keys_share_is_reckoned_with_its_own_error_not_the_floods():
    # The flood's first tokens come 100 ms later than predicted, the calm key's on time; the
    # tier's error is the flood's. With its own error the calm key's credit is the whole 0.3 s
    # tier: its 0.2 s committed and 0.06 s newcomer are within it and none of the flood's work
    # goes first. With the tier's error its credit would be 0.2 s, and 0.06 s of the flood
    # would be dealt in ahead of it.
    errors = flooding(0.25, 0.2, error_s=0.1)
    errors = dataclasses.replace(
        errors,
        keys=(
            KeyLoad("flood", 1.0, 0.25, error_s=0.1, over_share=True),
            KeyLoad("calm", 1.0, 0.2, error_s=0.0),
        ),
    )
    verdict = judge(CRITICAL, [errors], 60, key_id="calm")
    assert verdict.admit and verdict.predicted_ttft_s == pytest.approx(0.26)
    assert verdict.error_s == 0.0
    # A key no owner names yet is judged with the tier's error.
    assert judge(CRITICAL, [errors], 60, key_id="new").error_s == pytest.approx(0.1)


def test_a_keys_first_request_is_never_over_its_share():
    # A key's share is 0.3 / 2 = 0.15 s, less than its 200 ms prompt. With nothing of its own
    # committed it is not over its share: nothing is reserved for the idle other key, and
    # 0.2 s fits.
    assert judge(CRITICAL, [keyed(flood=0.0, calm=0.0)], 200, key_id="calm").admit
    # Its second request is over its share: the other key's 0.15 s is kept free too.
    # 0.05 + 0.15 + 0.2 = 0.4 s.
    assert not judge(CRITICAL, [keyed(flood=0.0, calm=0.05)], 200, key_id="calm").admit


def test_weights_set_the_shares():
    heavy = dataclasses.replace(
        keyed(flood=0.14, calm=0.0),
        keys=(KeyLoad("flood", 3.0, 0.14), KeyLoad("calm", 1.0, 0.0)),
    )
    # 3:1, the flood's share is 0.225 s: 0.18 fits, and the calm key's 0.075 s is kept.
    assert judge(CRITICAL, [heavy], 40, key_id="flood", key_weight=3.0).admit


def test_the_prediction_is_the_predictors_model():
    predictor = PrefillTimePredictor(2e-3, 1e-7, 0.01)
    assert predict_prefill_s(predictor.coefficients, 700) == pytest.approx(predictor.predict(700))


# ----------------------------------------------------------------------------- the board


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def board_with(clock: Clock, *loads: PublishedLoad) -> CapacityBoard:
    board = CapacityBoard("edge-a", TIERS, stale_after_s=3.0, ledger_ttl_s=10.0, clock=clock)
    for published in loads:
        board.update(published)
    return board


def owner_load(clock: Clock, committed_s: float, counted_ms: int = 0) -> PublishedLoad:
    return PublishedLoad("owner", clock.now, load(committed_s), {"edge-a": counted_ms})


def test_downgrade_serves_the_request_at_the_next_tier_down():
    clock = Clock()
    board = board_with(clock, owner_load(clock, 0.25))
    placement = board.place("critical", 100)
    assert placement.served_tier == "standard" and placement.downgraded
    assert placement.requested_tier == "critical"
    assert board.place("critical", 40).served_tier == "critical"  # 0.25 + 0.04 fits


def test_reject_refuses_the_request_and_a_lower_tier_with_its_own_rule_is_judged_too():
    clock = Clock()
    tiers = TierTable(
        [
            TierPolicy("critical", 0, 0.3, overflow="downgrade"),
            TierPolicy("standard", 1, 0.5, overflow="reject"),
            TierPolicy("batch", 2, 120.0),
        ]
    )
    board = CapacityBoard("edge-a", tiers, clock=clock)
    board.update(owner_load(clock, 0.25))
    board.update(PublishedLoad("owner", clock.now, load(0.45, tier="standard"), {}))
    placement = board.place("critical", 100)
    assert placement.served_tier is None and not placement.downgraded
    assert [v.tier for v in placement.verdicts] == ["critical", "standard"]
    assert placement.refusal.tier == "standard"


def test_admission_finds_a_key_that_asks_more_than_its_share_over_it():
    clock = Clock()
    board = board_with(clock, PublishedLoad("owner", clock.now, keyed(flood=0.0, calm=0.0), {}))
    # A 0.2 s prompt fits the idle 0.3 s tier from a key within its share.
    assert board.place("critical", 200, "calm").served_tier == "critical"
    for _ in range(200):  # the flood asks 0.05 s every 10 ms for 2 s, refused or not
        clock.now += 0.01
        board.place("critical", 50, "flood")
    calm, flood = board.place("critical", 50, "calm"), board.place("critical", 50, "flood")
    assert calm.served_tier == flood.served_tier == "critical"
    assert not calm.over_share and flood.over_share  # what the owner will be told
    # Over its share, what the calm key held at once (its first 0.2 s, 2 s ago, more than its
    # 0.15 s share) is kept free: 0.2 * exp(-2 / 30) + 0.2 > 0.3 s.
    big = board.place("critical", 200, "flood")
    assert big.served_tier == "standard"
    assert big.verdicts[0].predicted_ttft_s == pytest.approx(0.2 * math.exp(-2 / 30) + 0.2)


def test_a_keys_start_burst_keeps_its_standing_and_a_floods_start_does_not():
    clock = Clock()
    board = board_with(clock, PublishedLoad("owner", clock.now, keyed(flood=0.0, calm=0.0), {}))
    # The calm key's first four 50 ms requests in 0.2 s: twice its share's rate (0.5 s a
    # second), within the burst of its credit (the 0.3 s tier).
    for _ in range(4):
        clock.now += 0.05
        assert not board.place("critical", 50, "calm").over_share
    # The flood asks 0.05 s every 10 ms: past its share and the same burst within 0.1 s.
    standings = []
    for _ in range(10):
        clock.now += 0.01
        standings.append(board.place("critical", 50, "flood").over_share)
    assert standings[:4] == [False] * 4 and standings[-3:] == [True] * 3


def test_a_keys_share_is_reckoned_in_what_its_requests_cost_as_first_calibrated():
    clock = Clock()
    # Under a flood the owner's refit predicts 1.6x what the calibration did.
    slowed = dataclasses.replace(
        keyed(flood=0.0, calm=0.0),
        coefficients=(1.6e-3, 0.0, 0.0),
        reference_coefficients=PER_TOKEN,
    )

    def calm_for_20_s(load: TierLoad) -> list[Placement]:
        board = board_with(clock)
        placements = []
        for _ in range(200):
            clock.now += 0.1
            board.update(PublishedLoad("owner", clock.now, load, {}))  # kept fresh
            placements.append(board.place("critical", 40, "calm"))
        return placements

    # The calm key asks 0.4 of the worker as calibrated for 20 s: within its half share. As
    # the refit predicts it would be 0.64, past its share and its burst.
    placements = calm_for_20_s(slowed)
    assert all(p.admitting is not None for p in placements)  # every one judged
    assert not any(p.over_share for p in placements)
    unreferenced = dataclasses.replace(slowed, reference_coefficients=None)
    assert calm_for_20_s(unreferenced)[-1].over_share


def test_admission_judges_every_key_it_saw_ask_by_what_it_asked_not_by_the_owners_stamp():
    clock = Clock()
    # The owner last saw the flood within its share: admission refused everything after.
    board = board_with(clock, PublishedLoad("owner", clock.now, keyed(flood=0.0, calm=0.1), {}))
    for _ in range(200):  # the flood asks 0.05 s every 10 ms for 2 s, refused or not
        clock.now += 0.01
        board.place("critical", 50, "flood")
    board.update(PublishedLoad("owner", clock.now, keyed(flood=0.0, calm=0.1), {}))
    # The calm key holds more than its share (0.1 + 0.1 > 0.15 s); a flood within its share
    # would have its unused 0.15 s kept free: 0.1 + 0.15 + 0.1 = 0.35 s. Over it, it has none
    # kept: 0.2 s.
    calm = board.place("critical", 100, "calm")
    assert calm.served_tier == "critical" and not calm.over_share
    assert calm.admitting.predicted_ttft_s == pytest.approx(0.2)


def test_own_admissions_count_until_a_load_counts_them():
    clock = Clock()
    board = board_with(clock, owner_load(clock, 0.0))
    board.admitted("critical", 1_000_000, 100)  # stamped at the clock's now, in ms
    board.admitted("critical", 1_000_001, 100)
    assert [p.prompt_tokens for p in board.pending("critical")] == [100, 100]
    assert board.place("critical", 100).served_tier == "standard"  # 0.2 s pending + 0.1 s
    board.update(owner_load(clock, 0.0, counted_ms=1_000_000))  # the owner counted the first
    assert [p.prompt_tokens for p in board.pending("critical")] == [100]
    assert board.place("critical", 100).served_tier == "critical"


def test_a_tier_without_a_rule_is_admitted_whatever_its_load():
    clock = Clock()
    board = board_with(clock, PublishedLoad("owner", clock.now, load(99.0, tier="standard"), {}))
    placement = board.place("standard", 100)
    assert placement.served_tier == "standard" and placement.verdicts == ()


def test_a_downgrade_is_served_below_only_if_it_meets_that_tiers_slo_behind_the_higher_tier():
    clock = Clock()
    board = board_with(clock, owner_load(clock, 0.25))
    standard = PublishedLoad("owner", clock.now, load(2.6, tier="standard"), {})
    board.update(standard)
    # At standard: 0.25 s of critical work first, then 2.6 s, then its own 0.1 s: 2.95 s <= 3 s.
    assert board.place("critical", 100).served_tier == "standard"
    board.update(dataclasses.replace(standard, load=load(2.7, tier="standard")))
    placement = board.place("critical", 100)  # 3.05 s: no room below either
    assert placement.served_tier is None
    assert [v.tier for v in placement.verdicts] == ["critical", "standard"]
    assert placement.refusal.predicted_ttft_s == pytest.approx(3.05)
    # The standard tier's own requests have no rule: they are not judged.
    assert board.place("standard", 100).served_tier == "standard"


def test_below_the_top_tier_its_own_work_drains_at_the_share_the_higher_tiers_leave():
    standard = TIERS["standard"]
    busy = dataclasses.replace(load(0.2), busy_share=0.75)  # critical took 3/4 of the worker
    # 0.2 s of critical work first; then 0.5 s of standard work and its own 0.1 s, at a
    # quarter of the worker: 0.2 + (0.5 + 0.1) / 0.25 = 2.6 s.
    verdict = judge(standard, [load(0.5, tier="standard")], 100, above=[busy])
    assert verdict.share_left == pytest.approx(0.25)
    assert verdict.predicted_ttft_s == pytest.approx(2.6) and verdict.admit
    assert not judge(standard, [load(0.7, tier="standard")], 100, above=[busy]).admit  # 3.4 s
    # Idle above, the same work fits whole: 0.2 + 0.6 + 0.1 s.
    idle = judge(standard, [load(0.6, tier="standard")], 100, above=[load(0.2)])
    assert idle.share_left == 1.0 and idle.predicted_ttft_s == pytest.approx(0.9)
    # Two owners of the tier above: their shares weighted by their workers.
    two = [dataclasses.replace(load(0.0, workers=w), busy_share=b) for w, b in ((1, 0.9), (3, 0.1))]
    assert share_left(two) == pytest.approx(1 - (0.9 + 0.3) / 4)
    # A tier above that takes everything leaves a floor: the shortest still get measured.
    assert share_left([dataclasses.replace(load(0.0), busy_share=1.3)]) == MIN_SHARE_LEFT


def test_a_downgrade_is_refused_where_the_higher_tier_leaves_too_little_to_meet_the_slo():
    clock = Clock()
    critical = PublishedLoad("owner", clock.now, load(0.25), {})
    board = board_with(clock, critical)
    board.update(PublishedLoad("owner", clock.now, load(0.6, tier="standard"), {}))
    # 0.25 + 0.6 + 0.1 s at standard: served there while critical's prefills leave it all.
    assert board.place("critical", 100).served_tier == "standard"
    # Critical's prefills took 80 % of the worker lately: 0.25 + 0.7 / 0.2 = 3.75 s > 3 s.
    busy = dataclasses.replace(critical.load, busy_share=0.8)
    board.update(dataclasses.replace(critical, load=busy))
    placement = board.place("critical", 100)
    assert placement.served_tier is None
    assert placement.refusal.predicted_ttft_s == pytest.approx(3.75)


def test_admission_judges_the_tiers_with_a_rule_and_the_tier_a_downgrade_sends_to():
    assert TIERS.judged() == ("critical", "standard")
    assert loads_tiers(SHIPPED_LIKE).judged() == ("critical",)


SHIPPED_LIKE = """
[tiers.critical]
rank = 0
ttft_slo_s = 0.3
overflow = "reject"

[tiers.standard]
rank = 1
ttft_slo_s = 3.0
"""


def test_admissions_of_tiers_admission_does_not_judge_are_not_kept():
    clock = Clock()
    board = board_with(clock)
    board.admitted("batch", 1_000_000, 100)
    assert board.pending("batch") == []
    board.admitted("standard", 1_000_000, 100)  # a downgrade's tier: judged, so kept
    assert [p.prompt_tokens for p in board.pending("standard")] == [100]


def test_a_stale_load_no_longer_counts_and_old_admissions_leave_the_ledger():
    clock = Clock()
    board = board_with(clock, owner_load(clock, 5.0))
    board.admitted("critical", 1_000_000, 100)
    assert board.place("critical", 10).served_tier == "standard"
    clock.now += 3.5  # the owner stopped publishing: no load, no rule
    assert board.loads("critical") == []
    assert board.place("critical", 10).served_tier == "critical"
    clock.now += 7.0
    assert board.pending("critical") == []


def test_a_request_admitted_without_a_judgement_says_why():
    clock = Clock()
    standard = PublishedLoad("owner", clock.now, load(0.0, tier="standard"), {})
    board = board_with(clock, owner_load(clock, 0.5), standard)
    judged = board.place("critical", 10)  # downgraded, judged at standard too
    assert judged.unjudged is None and judged.served_tier == "standard"
    board = board_with(clock, owner_load(clock, 0.5))
    assert board.place("critical", 10).unjudged == "no fresh load"  # at standard: nothing
    clock.now += 3.5  # the owner's load went stale
    assert board.place("critical", 10).unjudged == "no fresh load"
    board.update(PublishedLoad("owner", clock.now, load(5.0, workers=0), {}))
    assert board.place("critical", 10).unjudged == "no workers"
    board.update(PublishedLoad("owner", clock.now + 0.1, load(5.0, calibrated=False), {}))
    placement = board.place("critical", 10)
    assert (placement.served_tier, placement.unjudged) == ("critical", "uncalibrated predictor")
    assert board.place("standard", 10).unjudged is None  # no rule at standard: nothing to judge


def test_an_older_load_of_the_same_owner_does_not_replace_a_newer_one():
    clock = Clock()
    board = board_with(clock, owner_load(clock, 0.0))
    board.update(PublishedLoad("owner", clock.now - 1.0, load(9.0), {}))
    assert [p.load.committed_s for p in board.loads("critical")] == [0.0]


def test_a_load_survives_its_record_and_a_malformed_one_is_refused():
    keyed = dataclasses.replace(
        load(0.7, workers=3, margin=0.2),
        busy_share=0.4,
        reference_coefficients=(5e-4, 1e-8, 0.01),
        keys=(
            KeyLoad("acme", 2.0, 0.5, running_s=0.25, over_share=True),
            KeyLoad("zed", 1.0, 0.2),
        ),
    )
    published = PublishedLoad("owner", 1234.5, keyed, {"edge-a": 7})
    assert published_load(load_record(published)) == published
    broken = load_record(published)
    del broken.coefficients[:]
    with pytest.raises(ValueError, match="coefficients"):
        published_load(broken)
    broken = load_record(published)
    del broken.reference_coefficients[1:]
    with pytest.raises(ValueError, match="reference"):
        published_load(broken)
    unknown = dataclasses.replace(
        published, load=dataclasses.replace(keyed, reference_coefficients=None)
    )
    assert published_load(load_record(unknown)) == unknown


# ----------------------------------------------------------------------------- the owner's side


def test_the_scheduler_commits_the_prefill_left_of_its_live_requests_of_the_tier():
    predictor = PrefillTimePredictor(*PER_TOKEN)
    scheduler = Scheduler("flowprefill", TIERS, predictor)
    scheduler.handle(WorkerJoined("w0", kv_slots=4), 0.0)
    for i, tokens in enumerate((100, 200)):
        scheduler.handle(RequestArrived(f"c{i}", "critical", tokens), 0.0)
    scheduler.handle(RequestArrived("s0", "standard", 500), 0.0)
    committed = scheduler.tier_load("critical", 0.0)
    assert committed.workers == 1
    assert committed.committed_s == pytest.approx(0.3)
    assert not committed.calibrated  # the fallback coefficients were never measured
    # c0 is prefilling: its 0.1 s is the key's running part, c1's 0.2 s waits.
    assert committed.keys[0].running_s == pytest.approx(0.1)
    # c0 started at 0 and reached its first token: only c1 is left, and it runs now.
    commands = scheduler.handle(PrefillFinished("c0", "w0", 100, 0.1), 0.1)
    assert any(isinstance(c, Assign) and c.request_id == "c1" for c in commands)
    after = scheduler.tier_load("critical", 0.1)
    assert after.committed_s == pytest.approx(0.2)
    assert after.keys[0].running_s == pytest.approx(0.2)


def test_admissions_margin_is_the_tiers_own_prefill_error_once_it_has_enough():
    scheduler = Scheduler("flowprefill", TIERS, PrefillTimePredictor(*PER_TOKEN))
    scheduler.handle(WorkerJoined("w0", kv_slots=4), 0.0)
    now = 0.0
    # Critical prefills come 10 % over their predictions; batch ones 90 % over.
    for i in range(20):
        for tier, taken_s in (("critical", 0.11), ("batch", 0.19)):
            rid = f"{tier}-{i}"
            scheduler.handle(RequestArrived(rid, tier, 100), now)
            now += taken_s
            scheduler.handle(PrefillFinished(rid, "w0", 100, taken_s), now)
            scheduler.handle(RequestDone(rid, "w0"), now)
    assert scheduler.tier_load("critical", now).margin == pytest.approx(0.1)
    assert scheduler.tier_load("batch", now).margin == pytest.approx(0.9)
    # A tier with too few prefills of its own: every prefill's margin.
    assert scheduler.tier_load("standard", now).margin == scheduler.prediction_errors.margin()


def test_the_scheduler_measures_the_share_of_the_workers_time_each_tiers_prefills_take():
    scheduler = Scheduler("flowprefill", TIERS, PrefillTimePredictor(*PER_TOKEN))
    for worker in ("w0", "w1"):
        scheduler.handle(WorkerJoined(worker, kv_slots=4), 0.0)
    # 0.5 s of critical prefill a second on two workers, for 20 s (two window's lengths).
    for i in range(40):
        t = i * 0.5
        scheduler.handle(RequestArrived(f"c{i}", "critical", 250), t)
        scheduler.handle(PrefillFinished(f"c{i}", "w0", 250, 0.25), t + 0.25)
        scheduler.handle(RequestDone(f"c{i}", "w0"), t + 0.25)
    assert scheduler.tier_load("critical", 20.0).busy_share == pytest.approx(0.25, rel=0.1)
    assert scheduler.tier_load("standard", 20.0).busy_share == 0.0


def test_a_tiers_first_busy_share_is_that_of_the_time_since_its_first_prefill():
    scheduler = Scheduler("flowprefill", TIERS, PrefillTimePredictor(*PER_TOKEN))
    scheduler.handle(WorkerJoined("w0", kv_slots=4), 0.0)
    scheduler.handle(RequestArrived("c0", "critical", 200), 0.0)
    scheduler.handle(PrefillFinished("c0", "w0", 200, 0.2), 0.2)
    scheduler.handle(RequestArrived("c1", "critical", 200), 0.2)
    scheduler.handle(PrefillFinished("c1", "w0", 200, 0.2), 0.4)
    # 0.4 s of prefill since it began: the whole worker (read high, at most 1), not 0.4 of it.
    assert scheduler.tier_load("critical", 0.4).busy_share == 1.0


def measured_scheduler() -> Scheduler:
    """One worker and a predictor calibrated to ``PER_TOKEN``, kept as it is."""
    predictor = PrefillTimePredictor(*PER_TOKEN)
    for tokens in range(50, 450, 50):
        predictor.observe(PrefillSample(tokens, 0, tokens * PER_TOKEN[0]))
    config = SchedulerConfig(refit_predictor=False, default_prediction_margin=0.0)
    scheduler = Scheduler("flowprefill", TIERS, predictor, config)
    scheduler.handle(WorkerJoined("w0", kv_slots=4), 0.0)
    return scheduler


def serve_one_at_a_time(
    scheduler: Scheduler, first: int, n: int, ttft_s: float, key_id: str = ""
) -> None:
    """``n`` critical 100-token requests of ``key_id``, each alone: its prefill takes the
    predicted 0.1 s, but its first token comes ``ttft_s`` after its arrival (what no prefill
    counts: a decode step before it, say). Each carries the TTFT that admission predicted for
    it on the owner's load, as a queue service's admission stamps it on the request."""
    for i in range(first, first + n):
        t = float(i)
        rid = f"{key_id}c{i}"
        verdict = judge(CRITICAL, [scheduler.tier_load("critical", t)], 100, key_id=key_id)
        predicted_s = verdict.predicted_ttft_s - verdict.error_s
        arrival = RequestArrived(rid, "critical", 100, key_id=key_id, admission_ttft_s=predicted_s)
        scheduler.handle(arrival, t)
        scheduler.handle(PrefillFinished(rid, "w0", 100, 0.1), t + ttft_s)
        scheduler.handle(RequestDone(rid, "w0"), t + ttft_s)


def test_admission_learns_how_much_later_than_predicted_first_tokens_come_and_adds_it():
    scheduler = measured_scheduler()
    serve_one_at_a_time(scheduler, 0, 19, ttft_s=0.2)
    # Not yet enough requests: nothing is added.
    assert scheduler.tier_load("critical", 19.0).error_s == 0.0
    serve_one_at_a_time(scheduler, 19, 1, ttft_s=0.2)
    critical = scheduler.tier_load("critical", 20.0)
    # Predicted 0.1 s (no work ahead, its own prefill), took 0.2 s: 0.1 s is added.
    assert critical.error_s == pytest.approx(0.1)
    assert scheduler.prediction_errors.margin() == pytest.approx(0.0)  # the prefills were exact
    # The standard tier (the downgrade's) had no request: nothing is added there.
    assert scheduler.tier_load("standard", 20.0).error_s == 0.0
    # So admission now refuses a 250-token prompt on an idle tier, which it admitted before.
    verdict = judge(CRITICAL, [critical], 250)
    assert verdict is not None and not verdict.admit
    assert verdict.predicted_ttft_s == pytest.approx(0.35)
    assert verdict.error_s == pytest.approx(0.1)
    assert judge(CRITICAL, [dataclasses.replace(critical, error_s=0.0, keys=())], 250).admit


def test_each_key_is_judged_on_its_own_errors_once_it_has_enough():
    scheduler = measured_scheduler()
    serve_one_at_a_time(scheduler, 0, 20, ttft_s=0.25, key_id="flood")
    serve_one_at_a_time(scheduler, 20, 4, ttft_s=0.1, key_id="calm")
    load_now = scheduler.tier_load("critical", 24.0)
    errors = {k.key_id: k.error_s for k in load_now.keys}
    assert errors["flood"] == pytest.approx(0.15)
    assert errors["calm"] == pytest.approx(0.15, abs=1e-3)  # too few yet: the tier's
    serve_one_at_a_time(scheduler, 24, 1, ttft_s=0.1, key_id="calm")  # 5: its own
    load_now = scheduler.tier_load("critical", 25.0)
    errors = {k.key_id: k.error_s for k in load_now.keys}
    assert errors["calm"] == pytest.approx(0.0)
    assert judge(CRITICAL, [load_now], 200, key_id="calm").admit
    assert not judge(CRITICAL, [load_now], 200, key_id="flood").admit
    # A key none of the owners names is judged on the tier's errors.
    assert judge(CRITICAL, [load_now], 200, key_id="new").error_s == pytest.approx(load_now.error_s)


def test_a_key_within_its_share_is_judged_at_a_lower_quantile_of_its_errors():
    errors = AdmissionErrors({"critical": 0.3})
    for i in range(100):  # 1 in 20 of its first tokens came 0.1 s late, the rest on time
        errors.observe("critical", "calm", 0.1, 0.2 if i % 20 == 0 else 0.1)
    assert errors.error_s("critical", "calm") == pytest.approx(0.1)  # p99: over its share
    assert errors.error_s("critical", "calm", within_share=True) == pytest.approx(0.0)  # p90
    # A key with too few errors of its own is judged on the tier's at the p99, either way.
    errors.observe("critical", "new", 0.1, 0.1)
    assert errors.error_s("critical", "new", within_share=True) == pytest.approx(0.1)


def test_only_a_request_that_admission_judged_measures_its_error():
    scheduler = measured_scheduler()
    for i in range(20):  # admission did not judge these (no prediction came with them)
        scheduler.handle(RequestArrived(f"u{i}", "critical", 100), float(i))
        scheduler.handle(PrefillFinished(f"u{i}", "w0", 100, 0.1), i + 0.3)
        scheduler.handle(RequestDone(f"u{i}", "w0"), i + 0.3)
    assert scheduler.admission_errors.summary() == {}
    serve_one_at_a_time(scheduler, 20, 20, ttft_s=0.2)
    # Each was predicted 0.1 s and took 0.2 s: the error is the carried prediction's.
    assert scheduler.admission_errors.summary()["critical"]["n"] == 20
    assert scheduler.tier_load("critical", 40.0).error_s == pytest.approx(0.1)


def test_the_error_added_is_at_most_half_the_slo():
    scheduler = measured_scheduler()
    serve_one_at_a_time(scheduler, 0, 20, ttft_s=2.0)
    assert scheduler.tier_load("critical", 20.0).error_s == pytest.approx(0.15)


def test_a_loads_errors_survive_the_capacity_topic():
    load_now = dataclasses.replace(
        load(0.2), error_s=0.05, keys=(KeyLoad("calm", 1.0, 0.1, error_s=0.02),)
    )
    back = published_load(load_record(PublishedLoad("i0", 1.0, load_now, {}))).load
    assert back.error_s == pytest.approx(0.05)
    assert back.keys[0].error_s == pytest.approx(0.02)
    assert back.keys[0].lead_s is None  # unknown stays unknown, not 0
    led = dataclasses.replace(load_now, keys=(KeyLoad("calm", 1.0, 0.1, lead_s=0.0),))
    back = published_load(load_record(PublishedLoad("i0", 1.0, led, {}))).load
    assert back.keys[0].lead_s == 0.0


def test_admissions_error_counts_the_work_that_was_ahead_of_a_request():
    scheduler = measured_scheduler()
    # Two at once, 50 times: the second's prediction holds the first's 0.1 s, and it gets its
    # first token at 0.2 s, as predicted. The first's is exact too.
    for i in range(50):
        t = float(i)
        scheduler.handle(RequestArrived(f"a{i}", "critical", 100), t)
        scheduler.handle(RequestArrived(f"b{i}", "critical", 100), t)
        for rid, done in ((f"a{i}", t + 0.1), (f"b{i}", t + 0.2)):
            scheduler.handle(PrefillFinished(rid, "w0", 100, 0.1), done)
            scheduler.handle(RequestDone(rid, "w0"), done)
    assert scheduler.tier_load("critical", 50.0).error_s == pytest.approx(0.0, abs=1e-9)


# ----------------------------------------------------------------------------- the tier table


def test_the_overflow_rule_is_read_checked_and_the_lowest_tier_cannot_downgrade():
    text = """
    [tiers.gold]
    rank = 0
    ttft_slo_s = 0.2
    overflow = "reject"
    [tiers.silver]
    rank = 1
    ttft_slo_s = 2.0
    """
    tiers = loads_tiers(text)
    assert tiers["gold"].overflow == "reject" and tiers["silver"].overflow is None
    assert tiers.below("gold") == tiers["silver"] and tiers.below("silver") is None
    with pytest.raises(ValueError, match="overflow must be one of"):
        loads_tiers(text.replace('"reject"', '"drop"'))
    with pytest.raises(ValueError, match="no tier to downgrade to"):
        loads_tiers(text + '    overflow = "downgrade"\n')
    assert tiers["gold"].borrow_limit == 1.0  # by default a key may borrow all the workers
    limited = loads_tiers(text.replace('"reject"', '"reject"\n    borrow_limit = 0.25'))
    assert limited["gold"].borrow_limit == 0.25
    for bad in ("1.5", "-0.1", "true", '"half"'):
        with pytest.raises(ValueError, match="borrow_limit must be a number in"):
            loads_tiers(text.replace('"reject"', f'"reject"\n    borrow_limit = {bad}'))


def test_the_shipped_table_downgrades_critical_overflow():
    from tierflow.tiers import load_tiers

    tiers = load_tiers()
    assert tiers["critical"].overflow == "downgrade" and tiers["critical"].borrow_limit == 0.5
    assert tiers.below("critical").name == "standard"
