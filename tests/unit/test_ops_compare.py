"""The compare verdict on request logs built with known violation and completion rates and known
loads per worker: the fairness rule first, then the three outcomes of the verdict."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ops.compare import FAIL, PASS, UNFAIR, UNSURE, Criteria, compare, format_report, wilson
from ops.records import LogRecord

TIERS = ["critical", "standard", "batch"]
SLOS = {"critical": 0.3, "standard": 3.0, "batch": 120.0}


def log(
    deployment, *, critical, critical_violation_rate, lower=200, lower_done_rate=1.0, span_s=40.0
):
    """Records of one deployment over ``span_s``: exact shares of critical violations and
    lower-tier completions, on one worker."""
    out = []
    bad = round(critical * critical_violation_rate)
    for i in range(critical):
        ttft = 0.5 if i < bad else 0.1
        out.append(
            LogRecord(
                "critical",
                40,
                8,
                arrival_s=i * span_s / critical,
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
                arrival_s=i * span_s / lower,
                status=status,
                ttft_s=1.0,
                deployment=deployment,
                worker_id=f"{deployment}-w",
            )
        )
    return out


def run(old, new, **kwargs):
    return compare(old + new, tiers=TIERS, slos=SLOS, **kwargs)


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
    assert result["checks"] == {
        "fairness": PASS, "violations": PASS, "lower_tier_throughput": FAIL,
    }  # fmt: skip
    assert result["verdict"] == FAIL


def test_a_tiny_sample_is_not_enough_data():
    result = run(log("primary", critical=20, critical_violation_rate=0.4, lower=10),
                 log("canary", critical=20, critical_violation_rate=0.0, lower=10))  # fmt: skip
    assert result["checks"]["fairness"] == PASS
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


def test_a_ten_percent_canary_on_one_worker_against_one_primary_worker_is_unfair():
    # Envoy sends 10% to the canary; each side has one worker: the canary's worker idles.
    primary = log("primary", critical=360, critical_violation_rate=0.4, lower=180)
    canary = log("canary", critical=40, critical_violation_rate=0.0, lower=20)
    result = run(primary, canary)
    assert result["verdict"] == UNFAIR
    assert result["checks"] == {"fairness": UNFAIR}
    window = 40.0 - 40.0 / 360  # the first arrival to the last
    assert result["load"]["canary"]["requests_per_worker_s"] == pytest.approx(60 / window)
    assert result["load"]["primary"]["requests_per_worker_s"] == pytest.approx(540 / window)
    assert any("0.11x" in why for why in result["why"]), result["why"]
    assert "**Verdict: unfair comparison**" in format_report(result)
    # The same records, nine primary workers to the canary's one: a fair 10% canary.
    fair = run(primary, canary, workers={"primary": 9, "canary": 1})
    assert fair["checks"]["fairness"] == PASS
    assert fair["verdict"] != UNFAIR


def test_the_load_tolerance_is_the_criterion_s():
    primary = log("primary", critical=400, critical_violation_rate=0.4)
    canary = log("canary", critical=360, critical_violation_rate=0.05, lower=180)  # 0.9x
    assert run(primary, canary)["verdict"] == PASS  # 0.90x requests and prompt tokens: within 25%
    strict = run(primary, canary, criteria=Criteria(max_load_gap=0.05))
    assert strict["verdict"] == UNFAIR


def test_lower_tier_throughput_is_completed_tokens_per_worker_second():
    primary = log("primary", critical=400, critical_violation_rate=0.4, lower=400)
    canary = log("canary", critical=400, critical_violation_rate=0.05, lower=400,
                 lower_done_rate=0.5)  # fmt: skip
    result = run(primary, canary, workers={"primary": 2, "canary": 2})
    window = 40.0 - 40.0 / 400  # first arrival to the last (finished_s unknown: the arrival)
    standard = result["tiers"]["canary"]["standard"]
    # Of the canary's 200 standard requests (odd indices), the first half are done.
    assert standard["done"] == 100
    assert standard["tokens_per_worker_s"] == pytest.approx(100 * 908 / window / 2)


def test_tbt_violations_are_counted_per_tier_and_shown():
    records = log("primary", critical=40, critical_violation_rate=0.0, lower=0)
    slow = [replace(r, tbt_p99_s=0.5, tbt_slo_s=0.4) for r in records[:3]]
    fast = [replace(r, tbt_p99_s=0.1, tbt_slo_s=0.4) for r in records[3:]]
    result = run(slow + fast, log("canary", critical=40, critical_violation_rate=0.0, lower=0))
    assert result["tiers"]["primary"]["critical"]["tbt_violations"] == 3
    assert result["tiers"]["canary"]["critical"]["tbt_violations"] == 0
    assert result["tiers"]["primary"]["critical"]["tbt_p99_ms"] == pytest.approx(500)
    assert "| TBT violations |" in format_report(result)
