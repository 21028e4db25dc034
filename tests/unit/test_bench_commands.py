"""The benchmark commands run end to end on the tiny model and write what they promise.

These check behaviour and the JSON contract, not speed: speed is what the commands report.
"""

from __future__ import annotations

import json
import statistics

import pytest

from bench.policy_bench import run_order
from launch.cli import main


def test_engine_bench_writes_json_and_png(tmp_path):
    out = tmp_path / "engine.json"
    png = tmp_path / "engine.png"
    args = [
        "engine-bench",
        "--model",
        "tiny-llama",
        "--quick",
        "--prompt-tokens",
        "512",
        "--chunk-size",
        "128",
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result.pop("smoke_test_only") is True  # a quick run says it is only a smoke test
    assert result["model"] == "tiny-llama" and result["layers"] == 4
    assert 0 < result["layer_time_ms"]["mean"] <= result["layer_time_ms"]["max"]
    assert set(result["chunk_cost"]) == {"256", "1024"}
    # The estimate is checks x the cost of one over the unchecked prefill: 512 tokens in
    # chunks of 128 on 4 layers are 16 checks.
    assert result["checks_per_prefill"] == 16 and result["check_cost_ns"] >= 0
    estimate = (
        16
        * result["check_cost_ns"]
        * 1e-9
        / (result["check_overhead_ab"]["prefill_none_ms"] / 1000)
    )
    assert result["check_overhead_pct"] == pytest.approx(estimate * 100)
    assert result["progress_report_us"] > 0 and result["progress_report_pct_of_layer"] > 0
    ab = result["check_overhead_ab"]
    assert ab["pairs"] == 2 and ab["ci95_pct"][0] <= ab["mean_pct"] <= ab["ci95_pct"][1]
    assert set(result["preemption_latency_ms"]) == {"1024"}  # quick: one C
    for check in ("layer", "chunk"):
        lat = result["preemption_latency_ms"]["1024"][check]
        assert lat["n"] == 8 and 0 < lat["p50"] <= lat["p99"]
    assert png.stat().st_size > 10_000


def test_policy_bench_compares_every_policy_on_the_same_arrivals(tmp_path):
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    args = [
        "bench",
        "--model",
        "tiny-llama",
        "--quick",
        "--duration",
        "4",
        "--max-new-tokens",
        "4",
        "--slo-sweep",
        "3",
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result.pop("smoke_test_only") is True  # a quick run says it is only a smoke test
    assert set(result["policies"]) == {"fifo", "priority", "chunked", "recompute", "flowprefill"}
    # Every tier that had requests was measured alone (an empty dict is not enough), and took time.
    with_requests = {tier for tier, t in result["policies"]["fifo"]["tiers"].items() if t["n"]}
    assert with_requests and set(result["isolated_ttft_ms"]) == with_requests
    assert all(ms > 0 for ms in result["isolated_ttft_ms"].values())
    # The SLO judged at many multiples, and configured at 3x for every policy: on batched
    # workers each reads deadlines (packing, decode pauses).
    curve = result["slo_sensitivity"]
    assert set(curve["attainment"]) == set(result["policies"])
    assert set(result["slo_configured"]["rerun"]) == set(result["policies"])
    (point,) = curve["configured"]
    assert point["multiple"] == 3.0 and point["policies"]["flowprefill"]["rerun"]
    assert (tmp_path / "bench_slo.png").stat().st_size > 10_000
    ns = set()
    for name, p in result["policies"].items():
        assert p["lost"] == 0, name
        assert p["throughput_tok_s"] > 0
        assert set(p["preemption_latency_ms"]) == {"p50", "p99"}
        for tier, t in p["tiers"].items():
            assert t["completed"] + t["rejected"] == t["n"], (name, tier)
            assert 0 <= t["slo_attainment"] <= 1
            assert set(t["ttft_ms"]) == {"p50", "p90", "p95", "p99"}
        ns.add(tuple(sorted((tier, t["n"]) for tier, t in p["tiers"].items())))
    assert len(ns) == 1  # every policy saw the same requests
    assert png.stat().st_size > 10_000


def test_policy_bench_with_batched_workers_reports_tbt_and_decode(tmp_path):
    out = tmp_path / "batched.json"
    args = ["bench", "--model", "tiny-llama", "--quick", "--duration", "4"]  # batched: default
    args += ["--kv-slots", "6", "--max-new-tokens", "12", "--seed", "2", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result.pop("smoke_test_only") is True  # a quick run says it is only a smoke test
    # Listed in the usual order, run in the order seed 2 rotates them to, each after a probe.
    assert list(result["policies"]) == ["fifo", "priority", "chunked", "recompute", "flowprefill"]
    positions = {name: p["run_position"] for name, p in result["policies"].items()}
    assert positions == {"chunked": 0, "recompute": 1, "flowprefill": 2, "fifo": 3, "priority": 4}
    assert all(p["speed_probe_ms"] > 0 for p in result["policies"].values())
    for name, p in result["policies"].items():
        assert p["lost"] == 0 and p["engine"]["kv_slots"] == 6, name
        assert p["output_tok_s"] > 0 and p["completed_tok_s"] > p["output_tok_s"]
        assert p["decode"]["steps"] > 0 and p["decode"]["mean_rows"] >= 1
        outputs = 0
        for tier, t in p["tiers"].items():
            assert set(t["tbt_ms"]) == {"p50", "p99"}, (name, tier)
            assert t["tbt_slo_ms"] > 0  # config/tiers.toml sets one per tier
            outputs += t["output_tokens"]
        assert outputs > sum(t["completed"] for t in p["tiers"].values())  # more than 1 each


def test_batch_engine_bench_writes_the_promised_json_shape(tmp_path):
    out = tmp_path / "batch.json"
    args = ["engine-bench", "--batch", "--model", "tiny-llama", "--quick", "--repeats", "3"]
    args += ["--tbt-sweep", "0.6", "--prompt-tokens", "600", "--chunk-size", "300"]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result.pop("smoke_test_only") is True  # a quick run says it is only a smoke test
    assert set(result) == {
        "model", "max_layer_ms", "decode_step_ms", "decode", "tbt_during_prefill_ms",
        "prefill_slowdown", "prefill_slowdown_ci95", "prefill_slowdown_pairs",
        "prefills_per_run", "tbt_target_ms",
        "slot_check", "layer_sweep", "steps_in_prefill",
    }  # fmt: skip
    assert result["tbt_target_ms"] == 400.0  # the tightest tier's tbt_slo_s (critical)
    assert [p["target_ms"] for p in result["layer_sweep"]] == [600.0]
    assert all(p["p50"] <= p["p99"] and p["slowdown"] > 0 for p in result["layer_sweep"])
    assert result["model"] == "tiny-llama"
    assert set(result["decode"]) == {"1", "4", "16", "32"}
    for row in result["decode"].values():
        assert set(row) == {"tok_s", "raw_tok_s"} and row["tok_s"] > 0 and row["raw_tok_s"] > 0
    assert set(result["tbt_during_prefill_ms"]) == {"sequential", "chunk", "layer"}
    for row in result["tbt_during_prefill_ms"].values():
        assert set(row) == {"p50", "p99", "samples"} and 0 < row["p50"] <= row["p99"]
        assert row["samples"] > 0
    assert set(result["prefill_slowdown"]) == {"chunk", "layer"}
    # Three prefills per run (--repeats): a paired ratio each, the mean inside its interval.
    assert result["prefills_per_run"] == 3
    for mode, (low, high) in result["prefill_slowdown_ci95"].items():
        assert low <= result["prefill_slowdown"][mode] <= high
        pairs = result["prefill_slowdown_pairs"][mode]  # each pair's ratio, for pooling runs
        assert len(pairs) == 3 and statistics.fmean(pairs) == pytest.approx(
            result["prefill_slowdown"][mode]
        )
    assert all(p["prefills"] == 3 and p["slowdown_ci95"] for p in result["layer_sweep"])
    # The slowdown split: the steps inside the prefill (the chunked baseline's one between its
    # two chunks of C=512 over 600 tokens) and their own time, a part of the whole slowdown.
    steps = result["steps_in_prefill"]
    assert steps["chunk"]["steps_per_prefill"] == 1
    assert steps["chunk"]["step_ms"] > 0 and steps["chunk"]["steps_share"] > 0
    for mode, row in steps.items():  # the split adds up, and the rest's mean is in its interval
        assert row["rest"] == pytest.approx(
            result["prefill_slowdown"][mode] - 1 - row["steps_share"]
        )
        assert row["rest_ci95"][0] <= row["rest"] <= row["rest_ci95"][1]
    for row in [steps["layer"], *result["layer_sweep"]]:  # none, where no row was due
        assert (row["steps_per_prefill"] > 0) == (row["step_ms"] > 0) == (row["steps_share"] > 0)
    assert result["max_layer_ms"] > 0 and result["decode_step_ms"] > 0


def test_thread_bench_measures_each_way_in_a_process_of_its_own(tmp_path):
    out, png = tmp_path / "threads.json", tmp_path / "threads.png"
    args = ["engine-bench", "--threads", "--model", "tiny-llama", "--quick", "--prompt-tokens",
            "32", "--json", str(out), "--plot", str(png)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result.pop("smoke_test_only") is True
    # Two rounds of three prompts each way (after a warm-up), every time a real one.
    assert all(len(w["samples"]) == 6 and w["min"] > 0 for w in result["ms"].values())
    assert len(result["ms"]) == 4
    for ratio in result["ratios"].values():
        assert ratio["n"] == 2 and ratio["ci95"][0] <= ratio["mean"] <= ratio["ci95"][1]
    assert png.stat().st_size > 10_000


def test_idle_bench_measures_every_gap_against_back_to_back(tmp_path):
    out, png = tmp_path / "idle.json", tmp_path / "idle.png"
    args = ["engine-bench", "--idle", "--model", "tiny-llama", "--quick", "--prompt-tokens",
            "32", "--json", str(out), "--plot", str(png)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result.pop("smoke_test_only") is True
    assert list(result["ms"]) == [
        "back to back",
        "after 0.2 s idle",
        "after 0.2 s of a spinning CPU",
    ]
    # Two rounds of two prompts each way, every time a real one.
    assert all(len(w["samples"]) == 4 and w["min"] > 0 for w in result["ms"].values())
    assert list(result["ratios"]) == [f"{way} / back to back" for way in list(result["ms"])[1:]]
    for ratio in result["ratios"].values():
        assert ratio["n"] == 2 and ratio["ci95"][0] <= ratio["mean"] <= ratio["ci95"][1]
    assert png.stat().st_size > 10_000


def test_consecutive_seeds_run_every_policy_once_in_every_position():
    policies = ("fifo", "priority", "chunked", "recompute", "flowprefill")
    orders = [run_order(policies, seed) for seed in range(3, 3 + len(policies))]
    assert all(sorted(order) == sorted(policies) for order in orders)
    for position in range(len(policies)):
        assert sorted(order[position] for order in orders) == sorted(policies)
    assert run_order(policies, 0) == policies
