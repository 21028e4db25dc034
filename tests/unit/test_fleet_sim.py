"""The simulated GPU fleet of ``tierflow bench --scale``: the real scheduler and dispatcher
drive simulated workers in simulated time, and every request is served."""

from __future__ import annotations

import gc
import json

from bench.fleet import Fleet, GpuTiming, range_assignment
from bench.scale import ScaleConfig, ScalePoint, main
from bench.workload import Arrival
from tests.tiers import UNIT_TIERS

TIMING = GpuTiming()


def test_the_range_assignor_gives_a_topics_partitions_to_the_first_members():
    assert range_assignment(1, 4) == [0]  # one partition: the other instances get nothing
    assert range_assignment(4, 4) == [0, 1, 2, 3]
    assert range_assignment(5, 2) == [0, 0, 0, 1, 1]


def test_every_request_gets_its_first_token_and_finishes():
    fleet = Fleet(UNIT_TIERS, TIMING, workers=2, instances=1, partitions=1)
    arrivals = [
        Arrival(0.001 * i, f"r{i}", ("critical", "standard", "batch")[i % 3], 64 + 97 * i, 8)
        for i in range(30)
    ]
    fleet.submit(arrivals)
    assert fleet.run(until_s=30.0, wall_limit_s=60.0)
    for outcome in fleet.outcomes.values():
        assert outcome.first_token_s is not None and outcome.done_s is not None
        assert outcome.arrival_s < outcome.first_token_s < outcome.done_s


def test_a_critical_arrival_preempts_a_long_prefill_and_the_prefill_resumes():
    # Decisions take no simulated time here: what this checks must not depend on the machine.
    fleet = Fleet(UNIT_TIERS, TIMING, workers=1, instances=1, partitions=1, charge_decisions=False)
    batch_s = TIMING.prefill_s(8000)  # about 0.33 s on the simulated GPU
    fleet.submit([Arrival(0.0, "doc", "batch", 8000, 2), Arrival(0.05, "q", "critical", 64, 2)])
    assert fleet.run(until_s=10.0, wall_limit_s=60.0)
    doc, q = fleet.outcomes["doc"], fleet.outcomes["q"]
    assert q.first_token_s < doc.first_token_s  # it did not wait for the document
    # The document resumed where it stopped: it lost no more than the critical prefill's time
    # and a few interruption budgets (a drop would have cost it its first 0.05 s again).
    assert doc.first_token_s - batch_s < 0.05
    instance = fleet.instances[0]
    assert instance.scheduler.counters["preemptions"] >= 1
    assert instance.scheduler.counters.get("restarts", 0) == 0


def test_with_one_partition_per_tier_the_second_instance_schedules_nothing():
    fleet = Fleet(UNIT_TIERS, TIMING, workers=2, instances=2, partitions=1)
    fleet.submit([Arrival(0.001 * i, f"r{i}", "critical", 64, 2) for i in range(10)])
    assert fleet.run(until_s=5.0, wall_limit_s=60.0)
    assert fleet.instances[0].scheduler.counters["RequestArrived"] == 10
    assert fleet.instances[1].scheduler.counters.get("RequestArrived", 0) == 0


def test_the_scale_bench_writes_its_table_json_and_plot(tmp_path):
    cfg = ScaleConfig(
        points=(
            ScalePoint(workers=2),
            ScalePoint(workers=2, instances=2, partitions=2),
            ScalePoint(workers=2, plan_window=None),
        ),
        duration_s=0.5,
        drain_s=2.0,  # decisions take their wall time here: room for a loaded CI machine
        max_new_tokens=8,
        arrival_lives=(16,),
        arrival_samples=5,
        full_planner_samples=3,
    )
    main(cfg, tmp_path / "scale.json", tmp_path / "scale.png")
    result = json.loads((tmp_path / "scale.json").read_text())
    assert [p["point"]["instances"] for p in result["points"]] == [1, 2, 1]
    assert [p["point"]["plan_window"] for p in result["points"]][2] is None
    for point in result["points"]:
        assert point["finished"]
        assert point["critical"]["n"] > 0
        assert point["critical"]["served"] == point["critical"]["n"]
        assert point["busiest"]["core_share"] > 0
    assert (tmp_path / "scale.png").stat().st_size > 0
    windowed, full = result["arrival_cost"]
    assert windowed["live"] == full["live"] == 16
    assert (windowed["samples"], full["samples"]) == (5, 3) and full["plan_window"] is None
    for cost in (windowed, full):
        assert 0 < cost["p50_us"] <= cost["p99_us"]
        assert cost["full_gc_ms"] > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0  # the caller's collector as it was
