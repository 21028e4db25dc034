"""What the policy benchmark counts from request records (made up here, no run)."""

from __future__ import annotations

from bench.harness import RequestRecord
from bench.metrics import _misses_behind_own_tier, alone_ttfts_ms
from bench.workload import Arrival


def record(
    rid: str, arrived: float, first: float | None, done: float | None = None, tier="critical"
) -> RequestRecord:
    return RequestRecord(Arrival(arrived, rid, tier, 10, 1), arrived, first, done)


def test_a_miss_counts_as_behind_its_own_tier_only_if_another_got_served_during_its_wait():
    records = [
        record("a", 0.0, 0.2),  # met (SLO 0.3 s)
        record("b", 0.1, 0.6),  # missed while a got its first token at 0.2: behind its tier
        record("c", 1.0, 1.5),  # missed, nobody of its tier served meanwhile: not behind
        record("d", 2.0, None),  # never served; e got served during its wait: behind
        record("e", 2.1, 2.2),  # met
    ]
    assert _misses_behind_own_tier(records, slo_s=0.3) == 2


def test_a_request_is_alone_only_if_no_other_was_live_from_its_arrival_to_its_first_token():
    records = [
        record("a", 1.0, 1.1, 1.5),  # alone: nothing else live in [1.0, 1.1]
        record("b", 2.0, 2.1, 2.2),  # c arrives at 2.05, before b's first token: not alone
        record("c", 2.05, 2.3, 2.4, tier="batch"),  # b still decoding at 2.05: not alone
        record("e", 3.5, 3.6, 3.7),  # alone
        record("f", 5.0, 5.05, 5.1),  # alone: e done at 3.7, long before
        record("d", 6.0, 6.1, None),  # alone (never done: live to the end)
        record("h", 7.0, 7.1, 7.2),  # d is still live (never done): not alone
    ]
    records.append(RequestRecord(Arrival(5.01, "g", "batch", 10, 1), 5.01, rejected="shed"))
    critical = [r for r in records if r.arrival.tier == "critical"]
    got = alone_ttfts_ms(critical, records)
    assert [round(t) for t in got] == [100, 100, 50, 100]  # a, e, f, d (a shed one is not live)
