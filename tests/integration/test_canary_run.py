"""`tierflow canary run` against the real parts: the local stack with both schedulers (a worker
each, a core each), a real Prometheus, the request log on Kafka. What each side served is counted
three times (by the client, from each request's Queued event; by the request log; by
Prometheus), and the counts must agree. The standard tier's TBT target is set to be missed on
purpose: the per-token TBT histogram and the TBT violation counter must move by exactly what the
request log says was served.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from launch.canary_run import CanaryRunConfig, format_run, measure_canary, write_report
from launch.local_stack import CANARY, PRIMARY, LocalStack
from launch.prometheus import PrometheusServer, scrape_config
from ops.compare import FAIL, PASS, UNFAIR, UNSURE
from ops.records import LogRecord, iter_kafka

REPO = Path(__file__).resolve().parents[2]
MISSED_TBT_S = 1e-6  # any two tokens are further apart than this


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("canary")
    tiers = (REPO / "config" / "demo-tiers.toml").read_text()
    tiers = tiers.replace("[tiers.standard]\n", f"[tiers.standard]\ntbt_slo_s = {MISSED_TBT_S}\n")
    (out / "tiers.toml").write_text(tiers)
    # A tiny model: the capacity measured is mostly the services' own cost per request.
    cfg = CanaryRunConfig(
        model="tiny-llama", tiers_file=out / "tiers.toml", load=0.3, min_n=8,
        time_limit_s=180.0, probe_requests=8, out_dir=out,
    )  # fmt: skip
    with LocalStack(cfg.stack_config()) as stack:
        e = stack.endpoints
        prometheus = PrometheusServer(scrape_config(e.metrics, e.envoy_admin), out / "prom")
        try:
            report = measure_canary(cfg, e, prometheus, Console(quiet=True))
            write_report(cfg, report, Console(quiet=True))
            records = [LogRecord.from_proto(m) for m in iter_kafka(e.operator_kafka())]
            yield cfg, report, records, prometheus
        finally:
            prometheus.stop()


def test_each_side_s_counts_agree_between_client_request_log_and_prometheus(run):
    cfg, report, _, _ = run
    counts = report["counts"]
    assert {key.split("/")[0] for key in counts} == {PRIMARY, CANARY}
    for key, c in counts.items():
        assert c["client"] == c["request_log"] == c["prometheus"], (key, c)
    for side in (PRIMARY, CANARY):  # arrivals stopped once each side had min_n critical ones
        assert counts[f"{side}/critical"]["client"] >= cfg.min_n, format_run(report)
    result = report["compare"]
    assert result["verdict"] in (PASS, FAIL, UNSURE, UNFAIR)
    assert {side: result["load"][side]["workers"] for side in (PRIMARY, CANARY)} == {
        PRIMARY: 1, CANARY: 1,
    }  # fmt: skip
    assert all(0 < result["load"][side]["busy_fraction"] <= 1 for side in (PRIMARY, CANARY))
    text = format_run(report)
    assert "| side/tier done | client | request log | Prometheus |" in text
    assert f"**Verdict: {result['verdict']}**" in text


def test_a_missed_tbt_target_moves_the_histogram_and_the_violation_counter(run):
    _, _, records, prometheus = run
    standard = [r for r in records if r.tier == "standard" and r.status == "done"]
    with_gaps = [r for r in standard if r.output_tokens >= 2]
    assert with_gaps, "the workload streams several tokens per standard request"
    assert all(r.tbt_slo_s == pytest.approx(MISSED_TBT_S) and r.tbt_violated for r in with_gaps)
    prometheus.scraped_after(max(r.finished_s for r in records) + 0.5)
    violations = prometheus.values(
        'sum by (tier) (tierflow_tbt_violations_total{tier="standard"})', "tier"
    )
    gaps = prometheus.values('sum by (tier) (tierflow_tbt_seconds_count{tier="standard"})', "tier")
    assert violations["standard"] == len(with_gaps)
    assert gaps["standard"] == sum(r.output_tokens - 1 for r in standard)
    critical = prometheus.values(
        'sum by (tier) (tierflow_tbt_violations_total{tier="critical"})', "tier"
    )
    assert critical["critical"] == 0  # the demo's tiers have no TBT target
