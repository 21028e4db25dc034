"""The audit on small files whose answers are known: counts and length percentiles of the file
itself, head-of-line exposures of a constructed case, and the report files."""

from __future__ import annotations

import json
import math
import random

import pytest

from bench.traces import TraceOptions
from ops.audit import Audit, counter_percentile
from ops.audit_report import PLOTS, write_report
from ops.records import LogRecord, read_source
from queue_service.scheduler.predictor import PrefillTimePredictor
from tierflow.tiers import load_tiers


def nearest_rank(values, q):
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def write_mooncake(path, rows):
    path.write_text("".join(json.dumps(
        {"timestamp": t_ms, "input_length": n_in, "output_length": n_out}) + "\n"
        for t_ms, n_in, n_out in rows))  # fmt: skip


def test_counter_percentile_is_nearest_rank():
    from collections import Counter

    values = [5, 1, 9, 9, 3, 7, 2]
    counts = Counter(values)
    for q in (1, 50, 90, 99, 100):
        assert counter_percentile(counts, q) == nearest_rank(values, q)


@pytest.mark.parametrize("shape", ["mooncake", "azure"])
def test_audit_of_a_trace_reports_the_files_own_counts_and_percentiles(tmp_path, shape):
    rng = random.Random(3)
    rows = [(i * 250, rng.choice([20, 60, 100, 400, 900, 3000, 6000]), rng.randint(1, 300))
            for i in range(500)]  # fmt: skip
    path = tmp_path / ("trace.jsonl" if shape == "mooncake" else "trace.csv")
    if shape == "mooncake":
        write_mooncake(path, rows)
    else:
        lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [
            f"2023-11-16 18:{t // 60000:02d}:{t % 60000 / 1000:09.6f}0,{a},{b}" for t, a, b in rows
        ]
        path.write_text("\n".join(lines) + "\n")
    # critical_share 1: every prompt <= 128 tokens is critical, so the tiers are known.
    opts = TraceOptions(critical_share=1.0)
    audit = Audit(load_tiers(), PrefillTimePredictor()).add_all(
        read_source(str(path), trace_options=opts)
    )
    summary = audit.summary(kv_bytes_per_token=1000)
    expected_tier = {"critical": lambda n: n <= 128, "standard": lambda n: 128 < n <= 1024,
                     "batch": lambda n: n > 1024}  # fmt: skip
    assert summary["requests"] == 500
    assert summary["span_s"] == pytest.approx(499 * 0.25)
    for tier, belongs in expected_tier.items():
        mine = [r for r in rows if belongs(r[1])]
        got = summary["tiers"][tier]
        assert got["n"] == len(mine)
        for q in (50, 90, 99):
            assert got["prompt_tokens"][f"p{q}"] == nearest_rank([r[1] for r in mine], q)
            assert got["output_tokens"][f"p{q}"] == nearest_rank([r[2] for r in mine], q)
        assert got["prompt_tokens"]["max"] == max(r[1] for r in mine)


def test_a_short_critical_request_behind_a_long_batch_prefill_is_one_exposure():
    predictor = PrefillTimePredictor(1e-3, 0.0, 0.0)  # 1 ms per token
    audit = Audit(load_tiers(), predictor, switch_s=0.01)
    audit.add(LogRecord("batch", 4000, 10, arrival_s=0.0))  # runs 4 s under FIFO
    audit.add(LogRecord("critical", 50, 10, arrival_s=0.1))  # SLO 0.3 s
    audit.add(LogRecord("critical", 50, 10, arrival_s=10.0))  # nothing running
    s = audit.summary(kv_bytes_per_token=1000)["tiers"]["critical"]
    assert s["hol_exposures"] == 1
    assert s["violations"] == {"fifo": 1, "flowprefill": 0}
    assert s["ttft_ms"]["fifo"]["p99"] == pytest.approx(3950, abs=1)


def test_report_files_are_written(tmp_path):
    audit = Audit(load_tiers(), PrefillTimePredictor())
    for i in range(200):
        tier = ("critical", "standard", "batch")[i % 3]
        audit.add(LogRecord(tier, 50 + 100 * (i % 7), 20, arrival_s=i * 3.0))
    summary = audit.summary(kv_bytes_per_token=12288)
    paths = write_report(audit, summary, tmp_path, "test audit")
    assert json.loads(paths["json"].read_text())["requests"] == 200
    assert "Head-of-line blocking" in paths["markdown"].read_text()
    assert all((tmp_path / p).stat().st_size > 1000 for p in PLOTS)
    assert '<img src="hol.png"' in paths["html"].read_text()
    rec = summary["recommended"]
    assert rec["chunk_size"] in (512, 1024, 2048, 4096) and rec["memory_cap_bytes"] > 0


def test_a_request_log_shows_observed_ttft_and_tbt_violations(tmp_path):
    audit = Audit(load_tiers(), PrefillTimePredictor())
    for i in range(10):
        audit.add(
            LogRecord(
                "critical", 50, 20, arrival_s=i * 3.0, ttft_s=0.1 if i else 0.5,
                tbt_p99_s=0.6 if i < 3 else 0.1, tbt_slo_s=0.4,
            )
        )  # fmt: skip
    summary = audit.summary(kv_bytes_per_token=1000)
    critical = summary["tiers"]["critical"]
    assert critical["violations"]["observed"] == 1
    assert critical["tbt_observed"]["violations"] == 3
    assert critical["tbt_observed"]["request_p99_ms"]["p99"] == 600
    markdown = write_report(audit, summary, tmp_path, "observed")["markdown"].read_text()
    assert "Observed (request log)" in markdown and "3 (30.0%)" in markdown
