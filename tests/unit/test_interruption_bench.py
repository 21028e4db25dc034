"""`tierflow engine-bench --blocks` on a tiny model: the command runs end to end, writes what it
promises, and every resumed prefill is exact. Its timings are measured, never asserted here."""

from __future__ import annotations

import json

from bench.interruption_bench import InterruptionBenchConfig, main


def test_interruption_bench_writes_json_and_png_and_resumes_exactly(tmp_path):
    cfg = InterruptionBenchConfig.quick(
        model="tiny-llama", prompt_tokens=600, latency_samples=3, budget_ms=0.5
    )
    out, png = tmp_path / "blocks.json", tmp_path / "blocks.png"
    main(cfg, out, png)
    result = json.loads(out.read_text())
    assert png.stat().st_size > 0 and result["smoke_test_only"]
    assert set(result["by_chunk"]) == {"512", "whole"}
    for row in result["by_chunk"].values():
        assert row["slowdown"]["pairs"] == 2 == len(row["slowdown"]["ratios"])
        for check in ("block", "layer"):
            latency = row["latency"][check]
            assert latency["n"] >= 3 == cfg.latency_samples
            assert latency["max_abs_logit_error"] <= 1e-4
