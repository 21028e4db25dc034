"""The compare verdict on request logs built with known violation and completion rates."""

from __future__ import annotations

import pytest

from ops.compare import FAIL, PASS, UNSURE, compare, format_report, wilson
from ops.records import LogRecord

TIERS = ["critical", "standard", "batch"]
SLOS = {"critical": 0.3, "standard": 3.0, "batch": 120.0}


def log(deployment, *, critical, critical_violation_rate, lower=200, lower_done_rate=1.0):
    """Records of one deployment: exact shares of critical violations and lower-tier completions."""
    out = []
    bad = round(critical * critical_violation_rate)
    for i in range(critical):
        ttft = 0.5 if i < bad else 0.1
        out.append(
            LogRecord(
                "critical",
                40,
                8,
                arrival_s=i * 0.1,
                ttft_s=ttft,
                deployment=deployment,
                slo_s=0.3,
                worker_id=f"{deployment}-w",
            )
        )
    done = round(lower * lower_done_rate)
    for i in range(lower):
        tier = "standard" if i % 2 else "batch"
        status = "done" if i < done else "shed"
        out.append(
            LogRecord(
                tier,
                900,
                8,
                arrival_s=i * 0.1,
                status=status,
                ttft_s=1.0,
                deployment=deployment,
                worker_id=f"{deployment}-w",
            )
        )
    return out


def run(old, new):
    return compare(old + new, tiers=TIERS, slos=SLOS)


def test_far_fewer_critical_violations_and_no_lower_tier_loss_passes():
    result = run(log("primary", critical=400, critical_violation_rate=0.4),
                 log("canary", critical=400, critical_violation_rate=0.05))  # fmt: skip
    assert result["verdict"] == PASS, result["why"]
    assert result["tiers"]["primary"]["critical"]["violations"] == 160
    assert result["tiers"]["canary"]["critical"]["violations"] == 20
    assert "**Verdict: PASS**" in format_report(result)


def test_a_small_reduction_fails():
    result = run(log("primary", critical=400, critical_violation_rate=0.4),
                 log("canary", critical=400, critical_violation_rate=0.35))  # fmt: skip
    assert result["checks"]["violations"] == FAIL
    assert result["verdict"] == FAIL


def test_lower_tier_loss_fails_even_when_violations_drop():
    result = run(
        log("primary", critical=400, critical_violation_rate=0.4, lower=400),
        log("canary", critical=400, critical_violation_rate=0.0, lower=400, lower_done_rate=0.8),
    )
    assert result["checks"] == {"violations": PASS, "lower_tier_throughput": FAIL}
    assert result["verdict"] == FAIL


def test_a_tiny_sample_is_not_enough_data():
    result = run(log("primary", critical=300, critical_violation_rate=0.4),
                 log("canary", critical=8, critical_violation_rate=0.0, lower=6))  # fmt: skip
    assert result["verdict"] == UNSURE
    assert "not enough data" in format_report(result)


def test_an_open_interval_is_not_enough_data_never_a_pass():
    # 40% vs 15% on 40 requests each: the point estimates pass, the intervals do not decide.
    result = run(log("primary", critical=40, critical_violation_rate=0.4),
                 log("canary", critical=40, critical_violation_rate=0.15))  # fmt: skip
    assert result["checks"]["violations"] == UNSURE
    assert result["verdict"] == UNSURE


def test_wilson_interval_matches_the_textbook_value():
    low, high = wilson(8, 10)
    assert (low, high) == pytest.approx((0.4902, 0.9433), abs=1e-3)
