"""The top tier's TTFT p95 against its isolated p95 + the preemption budget + one decode step
(``bench.ttft_bound``), on judged points built by hand."""

from bench import ttft_bound


def policy(
    p95: float, p99: float, step_ms: float | None, met: int = 98, behind: int = 1,
    alone: dict | None = None,
) -> dict:  # fmt: skip
    critical = {"n": 100, "met": met, "misses_behind_own_tier": behind, "alone_ttft_ms": alone,
                "ttft_ms": {"p50": 60.0, "p90": 90.0, "p95": p95, "p99": p99}}  # fmt: skip
    return {"tiers": {"critical": critical, "standard": {"n": 50, "met": 50}},
            "decode_step_ms": step_ms}  # fmt: skip


def result(points: list[dict], budget_ms: float | None = 25.0) -> dict:
    return {"points": points, "budget_ms": budget_ms}


def point(policies: dict, isolated: dict | None) -> dict:
    return {"seed": 1, "factor": 0.25, "policies": policies, "isolated_p95_ms": isolated}


def test_the_bound_is_the_isolated_p95_the_budget_and_the_runs_median_step():
    found = ttft_bound.rows(result([point(
        {"flowprefill": policy(150.0, 400.0, 30.0), "chunked": policy(260.0, 900.0, 40.0, 80, 3)},
        {"critical": 100.0, "standard": 400.0},
    )]))  # fmt: skip
    by_policy = {row["policy"]: row for row in found}
    assert by_policy["flowprefill"]["bound_ms"] == 100.0 + 25.0 + 30.0
    assert by_policy["flowprefill"]["within"] is True
    assert by_policy["chunked"]["bound_ms"] == 100.0 + 25.0 + 40.0  # its own step
    assert by_policy["chunked"]["within"] is False
    assert (by_policy["chunked"]["misses"], by_policy["chunked"]["behind_own_tier"]) == (20, 3)
    alone = {"n": 41, "p50": 120.0, "p95": 180.0}
    table = "\n".join(ttft_bound.markdown(result([point(
        {"flowprefill": policy(150.0, 400.0, 30.0, alone=alone),
         "chunked": policy(260.0, 900.0, 40.0, 80, 3)},
        {"critical": 100.0},
    )])))  # fmt: skip
    # The run's own isolated TTFT stands beside the bound and does not change the verdict.
    assert (
        "| 1 | 0.25 | flowprefill | 150 | 400 | 100 + 25 + 30 = 155 | yes | 180 (41) | 2 (1) |"
        in table
    )
    assert "| chunked | 260 | 900 | 100 + 25 + 40 = 165 | no (+95) | - | 20 (3) |" in table


def test_points_that_did_not_measure_the_parts_are_left_out():
    older = point({"flowprefill": policy(150.0, 400.0, None)}, {"critical": 100.0})
    no_isolated = point({"flowprefill": policy(150.0, 400.0, 30.0)}, None)
    assert ttft_bound.rows(result([older, no_isolated])) == []
    assert ttft_bound.rows(result([point({"f": policy(1, 2, 3)}, {"critical": 1})], None)) == []
    assert ttft_bound.markdown(result([older])) == []
