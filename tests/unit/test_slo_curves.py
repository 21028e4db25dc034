"""SLO sensitivity curves: attainment per SLO multiple, pooled over runs, and the ranges where
flowprefill is ahead of or behind a baseline; the lower tiers' throughput against fifo."""

import json

from bench import pooled
from bench.slo_curves import MULTIPLES, ranges, slo_sensitivity


def run(
    isolated_ms: float,
    samples: dict[str, list[float]],
    n: int,
    slo_ms: float = 300.0,
    lower_tok_s: dict[str, float] | None = None,
):
    lower_tok_s = lower_tok_s or {}
    return {
        "isolated_ttft_ms": {"critical": isolated_ms},
        "policies": {
            name: {
                "tiers": {"critical": {"n": n, "ttft_samples_ms": ttfts, "slo_ms": slo_ms}},
                "lower_tier_completed_tok_s": lower_tok_s.get(name, 100.0),
            }
            for name, ttfts in samples.items()
        },
    }


def test_attainment_counts_ttfts_within_each_multiple_and_unfinished_requests_as_misses():
    # 4 requests, one never finished (no TTFT): at most 3/4 ever meet the SLO.
    curve = slo_sensitivity([run(100.0, {"flowprefill": [110, 190, 900]}, n=4)])
    shares = dict(zip(curve["multiples"], curve["attainment"]["flowprefill"], strict=True))
    assert shares[1.2] == 0.25 and shares[2.0] == 0.5 and shares[10.0] == 0.75
    assert shares[20.0] == 0.75
    assert curve["n"] == {"flowprefill": 4}
    assert curve["configured_slo_multiple"] == 3.0


def test_runs_pool_as_multiples_of_their_own_isolated_ttft():
    # The same shape at two speeds: 1.5x and 4x the isolated TTFT in both runs.
    fast = run(10.0, {"flowprefill": [15, 40]}, n=2)
    slow = run(100.0, {"flowprefill": [150, 400]}, n=2)
    windows = {"windows": [fast, slow]}
    for results in ([fast, slow], [windows]):
        curve = slo_sensitivity(results)
        shares = dict(zip(curve["multiples"], curve["attainment"]["flowprefill"], strict=True))
        assert curve["runs"] == 2 and curve["n"] == {"flowprefill": 4}
        assert shares[1.2] == 0 and shares[1.5] == 0.5 and shares[3.0] == 0.5
        assert shares[5.0] == 1.0


def test_ranges_where_flowprefill_is_ahead_and_behind():
    # flowprefill: everything by 1.5x; baseline: 2 of 10 by 1.2x, the rest only at 9x.
    fp = [150.0] * 10
    base = [110.0] * 2 + [900.0] * 8
    curve = slo_sensitivity([run(100.0, {"flowprefill": fp, "priority": base}, n=10)])
    versus = curve["flowprefill_vs"]["priority"]
    assert versus["worse"] == [[1.2, MULTIPLES[MULTIPLES.index(1.5) - 1]]]
    assert versus["better"] == [[1.5, max(m for m in MULTIPLES if m < 9.0)]]
    assert versus["clearly_better"] and versus["clearly_better"][0][0] >= 1.5
    assert versus["clearly_worse"] == []  # 2/10 against 0/10 is inside the noise


def test_ranges_of_a_mask():
    grid = (1.0, 2.0, 3.0, 4.0, 5.0)
    assert ranges(grid, [True, True, False, True, False]) == [[1.0, 2.0], [4.0, 4.0]]
    assert ranges(grid, [False] * 5) == []


def test_the_command_pools_json_files_and_writes_json_and_a_plot(tmp_path):
    paths = []
    for seed, isolated in enumerate((50.0, 60.0)):
        path = tmp_path / f"seed{seed}.json"
        path.write_text(json.dumps(run(isolated, {"flowprefill": [70.0], "fifo": [900.0]}, n=1)))
        paths.append(path)
    out, png = tmp_path / "slo.json", tmp_path / "slo.png"
    pooled.main(paths, "critical", out, png)
    written = json.loads(out.read_text())
    curve = written["slo_sensitivity"]
    assert curve["runs"] == 2 and curve["n"] == {"flowprefill": 2, "fifo": 2}
    assert written["sources"] == [str(p) for p in paths]
    assert png.stat().st_size > 10_000


def test_lower_tier_throughput_against_fifo_is_one_ratio_per_run_with_an_interval():
    runs = [
        run(
            50.0,
            {"fifo": [], "flowprefill": []},
            n=0,
            lower_tok_s={"fifo": 100.0, "flowprefill": f},
        )
        for f in (90.0, 100.0, 95.0)
    ]
    table = pooled.lower_tier_vs_fifo(runs)
    fp = table["flowprefill"]
    assert fp["per_run"] == [0.9, 1.0, 0.95] and abs(fp["mean"] - 0.95) < 1e-12
    low, high = fp["ci95"]
    assert low < 0.95 < high and high - low > 0.1  # three runs: a wide interval, said so
    assert table["fifo"]["per_run"] == [1.0, 1.0, 1.0]
    assert pooled.lower_tier_vs_fifo(runs[:1])["flowprefill"]["ci95"] is None
