"""What the policy benchmark counts from request records (made up here, no run)."""

from __future__ import annotations

from bench.harness import RequestRecord
from bench.metrics import _misses_behind_own_tier
from bench.workload import Arrival


def record(rid: str, arrived: float, first: float | None) -> RequestRecord:
    return RequestRecord(Arrival(arrived, rid, "critical", 10, 1), arrived, first)


def test_a_miss_counts_as_behind_its_own_tier_only_if_another_got_served_during_its_wait():
    records = [
        record("a", 0.0, 0.2),  # met (SLO 0.3 s)
        record("b", 0.1, 0.6),  # missed while a got its first token at 0.2: behind its tier
        record("c", 1.0, 1.5),  # missed, nobody of its tier served meanwhile: not behind
        record("d", 2.0, None),  # never served; e got served during its wait: behind
        record("e", 2.1, 2.2),  # met
    ]
    assert _misses_behind_own_tier(records, slo_s=0.3) == 2
