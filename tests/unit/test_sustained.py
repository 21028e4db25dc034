"""Goodput at sustained rates: fresh arrivals per point, enough critical requests, interval
lower bounds, the first failing point ends a seed's goodput."""

import json

import pytest

from bench import sustained, ttft_bound
from bench.harness import RequestRecord, RunResult
from bench.metrics import summarise
from bench.sustained import goodput, judge, sustained_workload
from bench.workload import Arrival
from launch.cli import main
from tierflow.tiers import load_tiers
from worker.config import EngineConfig


def test_each_point_is_fresh_poisson_arrivals_with_enough_critical_requests():
    slow = sustained_workload(1.0, seed=0, min_critical=30)
    fast = sustained_workload(3.0, seed=0, min_critical=30)
    for workload in (slow, fast):
        assert sum(a.tier == "critical" for a in workload.arrivals) >= 30
    # Not the same arrivals compressed: a different draw, over about a third of the time.
    assert [a.prompt_tokens for a in fast.arrivals[:10]] != [
        a.prompt_tokens for a in slow.arrivals[:10]
    ]
    assert fast.duration_s < 0.6 * slow.duration_s
    assert sustained_workload(3.0, seed=0, min_critical=30) == fast  # repeatable
    assert sustained_workload(3.0, seed=1, min_critical=30) != fast


def summary(met_ms: list[float], n: int, rejected: int = 0) -> dict:
    tier = {"n": n, "rejected": rejected, "slo_ms": 100.0, "ttft_samples_ms": met_ms}
    return {"tiers": {"critical": tier}, "busy_fraction": 0.9, "lower_tier_completed_tok_s": 1.0}


def test_shed_and_unfinished_requests_are_misses():
    judged = judge(summary([50.0] * 8 + [150.0], n=10, rejected=1))["tiers"]["critical"]
    assert (judged["met"], judged["n"], judged["attainment"]) == (8, 10, 0.8)
    low, high = judged["ci95"]
    assert low < 0.8 < high


def test_goodput_is_the_highest_rate_before_the_first_point_whose_lower_bound_fails():
    def point(factor, met, n=200):
        policy = judge(summary([50.0] * met, n=n))
        return {"seed": 0, "factor": factor, "rate_per_s": factor, "policies": {"p": policy}}

    # 200/200 and 196/200 have lower bounds above 0.9; 180/200 does not (0.85); a lucky pass
    # after a failure does not count.
    points = [point(1, 200), point(2, 196), point(3, 180), point(4, 200)]
    assert goodput(points, "p", seed=0, target=0.9) == 2
    assert goodput(points[2:], "p", seed=0, target=0.9) == 0.0


def test_the_bench_command_runs_sustained_points_per_seed(tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "--model", "tiny-llama", "--quick", "--duration", "2",
            "--policies", "fifo,flowprefill", "--sustained", "1,2",
            "--sustained-seeds", "0,1", "--min-critical", "3", "--json", str(out),
            "--plot", str(tmp_path / "bench.png")]  # fmt: skip
    assert main(args) == 0
    assert (tmp_path / "bench_sustained.png").stat().st_size > 0
    tables = (tmp_path / "bench_sustained.md").read_text()
    assert "| 0 | 2 |" in tables and "| flowprefill |" in tables
    result = json.loads(out.read_text())["sustained"]
    assert [(p["seed"], p["factor"]) for p in result["points"]] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for point in result["points"]:
        assert point["policies"]["flowprefill"]["tiers"]["critical"]["n"] >= 3
    assert set(result["goodput_req_s"]) == {"fifo", "flowprefill"}
    # The critical tier's TTFT p95 against isolated p95 + budget + step, with its parts.
    assert result["budget_ms"] == EngineConfig.preempt_budget_ms
    assert all(p["isolated_p95_ms"]["critical"] > 0 for p in result["points"])
    assert "critical TTFT p95 against its isolated p95" in tables
    assert len(ttft_bound.rows(result)) == 2 * len(result["points"])
    assert set(result["goodput_req_s"]["fifo"]["per_seed"]) == {"0", "1"}
    assert sustained.meets(result["points"][0]["policies"]["fifo"], 0.0)
    # Pooled over the seeds: per factor, met and n are the sums of the two seeds' points.
    first = result["pooled"][0]["policies"]["flowprefill"]["tiers"]["critical"]
    per_seed = [p["policies"]["flowprefill"]["tiers"]["critical"] for p in result["points"][::2]]
    assert (first["met"], first["n"]) == (
        sum(t["met"] for t in per_seed),
        sum(t["n"] for t in per_seed),
    )
    # The same points measured one policy per run, then pooled: the same tables.
    whole = json.loads(out.read_text())
    runs = []
    for name in ("fifo", "flowprefill"):
        part = json.loads(out.read_text())
        for point in part["sustained"]["points"]:
            point["policies"] = {name: point["policies"][name]}
        runs.append(tmp_path / f"{name}.json")
        runs[-1].write_text(json.dumps(part))
    pooled = tmp_path / "pooled.json"
    args = ["pool", *map(str, runs), "--json", str(pooled), "--plot", str(tmp_path / "p.png")]
    assert main(args) == 0
    again = json.loads(pooled.read_text())["sustained"]
    for key in ("points", "pooled", "goodput_req_s"):
        assert again[key] == whole["sustained"][key]
    assert again["incomplete_points"] == []
    assert (tmp_path / "p_sustained.png").stat().st_size > 0
    assert (tmp_path / "pooled_sustained.md").read_text() == tables


def one_point(seed: int, factor: float, requests: int, policy: str, met: int) -> dict:
    judged = judge(summary([50.0] * met, n=100))
    return {"seed": seed, "factor": factor, "requests": requests, "rate_per_s": factor,
            "policies": {policy: judged}}  # fmt: skip


def bench_run(*points: dict) -> dict:
    return {"sustained": {"target": 0.9, "min_critical": 100, "points": list(points)}}


def test_runs_of_one_policy_each_are_pooled_point_by_point():
    a = bench_run(one_point(0, 1, 300, "a", 99), one_point(1, 1, 280, "a", 97))
    b = bench_run(one_point(0, 1, 300, "b", 60), one_point(0, 2, 500, "a", 99))
    result = sustained.merged([a, b, {"policies": {}}])  # a run without sustained points
    assert [(p["seed"], p["factor"], list(p["policies"])) for p in result["points"]] == [
        (0, 1, ["a", "b"])
    ]
    # Seed 1 x1 lacks b, seed 0 x2 lacks b: left out, and said so.
    assert result["incomplete_points"] == [[0, 2], [1, 1]]
    assert result["goodput_req_s"]["a"]["per_seed"] == {"0": 1}
    assert result["goodput_req_s"]["b"]["per_seed"] == {"0": 0.0}
    assert sustained.merged([{"policies": {}}]) is None


def test_pooling_refuses_points_that_do_not_belong_together():
    a = bench_run(one_point(0, 1, 300, "a", 99))
    with pytest.raises(ValueError, match="different arrivals"):
        sustained.merged([a, bench_run(one_point(0, 1, 301, "b", 99))])
    with pytest.raises(ValueError, match="measured twice"):
        sustained.merged([a, bench_run(one_point(0, 1, 300, "a", 98))])
    other = bench_run(one_point(0, 1, 300, "b", 99))
    other["sustained"]["target"] = 0.95
    with pytest.raises(ValueError, match="different targets"):
        sustained.merged([a, other])
    a["sustained"]["budget_ms"] = 25.0
    other = bench_run(one_point(0, 1, 300, "b", 99))
    other["sustained"]["budget_ms"] = 10.0
    with pytest.raises(ValueError, match="different preemption budgets"):
        sustained.merged([a, other])
    older = bench_run(one_point(0, 1, 300, "b", 99))  # a run from before budgets were kept
    assert sustained.merged([older, a])["budget_ms"] == 25.0


def test_a_point_counts_the_shed_and_the_requests_that_reached_the_aging_threshold():
    def record(i: int, ttft_s: float | None, rejected: str | None = None) -> RequestRecord:
        arrival = Arrival(0.0, f"r{i}", "batch", 100)
        first = None if ttft_s is None else 10.0 + ttft_s
        return RequestRecord(arrival, 10.0, first, first, rejected=rejected)

    records = [record(0, 5.0), record(1, 299.0), record(2, 301.0), record(3, None, "shed")]
    result = RunResult("p", {r.arrival.request_id: r for r in records}, makespan_s=400.0)
    judged = judge(summarise(result, load_tiers(), starvation_s=300.0))
    assert (judged["tiers"]["batch"]["aged"], judged["tiers"]["batch"]["rejected"]) == (1, 1)
    assert sustained.shed_and_aged(judged) == "1 / 1"
    before = {"tiers": {"batch": {**judged["tiers"]["batch"], "aged": None}}}
    assert sustained.shed_and_aged(before) == "1 / -"  # not counted is not zero
