"""Goodput at sustained rates: fresh arrivals per point, enough critical requests, interval
lower bounds, the first failing point ends a seed's goodput."""

import json

from bench import sustained
from bench.sustained import goodput, judge, sustained_workload
from launch.cli import main


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
    assert set(result["goodput_req_s"]["fifo"]["per_seed"]) == {"0", "1"}
    assert sustained.meets(result["points"][0]["policies"]["fifo"], 0.0)
    # Pooled over the seeds: per factor, met and n are the sums of the two seeds' points.
    first = result["pooled"][0]["policies"]["flowprefill"]["tiers"]["critical"]
    per_seed = [p["policies"]["flowprefill"]["tiers"]["critical"] for p in result["points"][::2]]
    assert (first["met"], first["n"]) == (
        sum(t["met"] for t in per_seed),
        sum(t["n"] for t in per_seed),
    )
