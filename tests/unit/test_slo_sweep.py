"""`--slo-sweep`: every policy runs again under each configured SLO (on the batched engine each
reads deadlines: packing and decode pauses), and the pooled curve takes those reruns in place
of judging the main run."""

from dataclasses import dataclass

from bench import slo_sweep
from bench.slo_curves import slo_sensitivity
from tierflow.tiers import TierPolicy, TierTable

TIERS = TierTable(
    [TierPolicy("critical", 0, ttft_slo_s=0.3), TierPolicy("batch", 1, ttft_slo_s=60.0)]
)


@dataclass(frozen=True)
class Cfg:
    policies: tuple[str, ...]
    slo_multiples: tuple[float, ...]


def test_each_multiple_sets_the_top_tier_slo_and_counts_requests_within_it():
    seen = []

    def run_policies(tiers, cfg, label):
        seen.append((tiers["critical"].ttft_slo_s, tiers["batch"].ttft_slo_s, cfg.policies))
        # A tighter SLO makes this fake policy preempt sooner: faster first tokens.
        fast = tiers["critical"].ttft_slo_s < 0.1
        ttfts = [30.0, 45.0, 400.0] if fast else [60.0, 90.0, 400.0]
        return {"flowprefill": {"tiers": {"critical": {"n": 4, "ttft_samples_ms": ttfts}}}}

    cfg = Cfg(("flowprefill",), (1.5, 5.0))
    out = slo_sweep.run(cfg, {"critical": 20.0}, TIERS, run_policies)
    assert [s[:2] for s in seen] == [(0.03, 60.0), (0.1, 60.0)]
    assert all(s[2] == ("flowprefill",) for s in seen)
    assert out["tier"] == "critical" and out["rerun"] == ["flowprefill"]
    assert [p["policies"]["flowprefill"] for p in out["points"]] == [
        {"met": 1, "n": 4},  # 30 ms within 1.5 x 20 ms; the 4th request never finished
        {"met": 2, "n": 4},
    ]
    assert slo_sweep.run(Cfg(("flowprefill",), ()), {"critical": 20.0}, TIERS, run_policies) is None


def test_the_curve_takes_reruns_where_there_are_some_and_judges_the_rest():
    run = {
        "isolated_ttft_ms": {"critical": 100.0},
        "policies": {
            name: {"tiers": {"critical": {"n": 2, "ttft_samples_ms": ttfts, "slo_ms": 300.0}}}
            for name, ttfts in {"fifo": [150.0, 900.0], "flowprefill": [250.0, 260.0]}.items()
        },
        "slo_configured": {
            "tier": "critical",
            "rerun": ["flowprefill"],
            "points": [
                {"multiple": 2.0, "slo_ms": 200.0, "policies": {"flowprefill": {"met": 2, "n": 2}}}
            ],
        },
    }
    (point,) = slo_sensitivity([run, run])["configured"]
    assert point["multiple"] == 2.0
    assert (
        point["policies"]["flowprefill"]["met"] == 4 and point["policies"]["flowprefill"]["rerun"]
    )
    fifo = point["policies"]["fifo"]
    assert (fifo["met"], fifo["n"], fifo["rerun"]) == (2, 4, False)  # 150 ms <= 2 x 100 ms
