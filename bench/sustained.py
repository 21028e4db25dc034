"""`tierflow bench --sustained F,...`: goodput at sustained rates, with confidence intervals.

The older sweep (``--sweep-rate``) replays one set of arrivals compressed in time, so its higher
"rates" are bursts, and each point holds a handful of critical requests. Here every point is a
fresh Poisson workload: every tier arrives at F x its base rate (``bench.workload.DEFAULT_MIX``)
for as long as it takes ``min_critical`` critical requests to arrive, from a seed of its own.
A tier's attainment at a point is its requests within the SLO over all of them (a request shed
at admission or failed is a miss), with its 95% Wilson interval. A policy's goodput on a seed is
the highest rate up to which, at every point, each tier's interval lower bound met ``target``
(the first failing point ends it). The seeds' goodputs give the spread. Include a factor at
which the engine saturates: there the scheduler sheds the sheddable tier and ages starved work,
and the table shows what that leaves of each tier.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from bench import slo_curves
from bench.metrics import wilson_interval
from bench.workload import DEFAULT_MIX, TierMix, Workload, synthetic

# Runs the configured policies on a workload; returns their summaries (``bench.metrics``).
RunPolicies = Callable[[Workload, str], dict]


def point_seed(seed: int, factor: float) -> int:
    """Each (seed, rate) its own arrivals, and the same ones in every run."""
    return seed * 100_000 + round(factor * 1000)


def sustained_workload(
    factor: float,
    seed: int,
    min_critical: int,
    max_new_tokens: int = 1,
    mix: tuple[TierMix, ...] = DEFAULT_MIX,
) -> Workload:
    """Every tier at ``factor`` x its rate, until ``min_critical`` requests of the first tier
    (the most important in the mix) arrived."""
    if factor <= 0 or min_critical < 1:
        raise ValueError("a sustained point needs factor > 0 and min_critical >= 1")
    scaled = tuple(replace(m, rate_per_s=m.rate_per_s * factor) for m in mix)
    top = scaled[0].tier
    duration = min_critical / scaled[0].rate_per_s
    while True:
        workload = synthetic(
            scaled,
            duration_s=duration,
            seed=point_seed(seed, factor),
            max_new_tokens=max_new_tokens,
        )
        if sum(a.tier == top for a in workload.arrivals) >= min_critical:
            return replace(workload, name=f"{workload.name}, x{factor:g} sustained")
        duration *= 1.25


def judge(summary: dict) -> dict:
    """Per tier: met, n (shed and failed requests count as misses), attainment, 95% interval."""
    tiers = {}
    for name, t in summary["tiers"].items():
        met = slo_curves.attainment(t["ttft_samples_ms"], t["n"], t["slo_ms"])
        tiers[name] = {
            "met": met, "n": t["n"], "rejected": t["rejected"], "attainment": met / t["n"],
            "ci95": list(wilson_interval(met, t["n"])),
        }  # fmt: skip
    return {
        "tiers": tiers,
        "busy_fraction": summary["busy_fraction"],
        "lower_tier_completed_tok_s": summary["lower_tier_completed_tok_s"],
    }


def meets(point_policy: dict, target: float) -> bool:
    return all(t["ci95"][0] >= target for t in point_policy["tiers"].values())


def goodput(points: list[dict], policy: str, seed: int, target: float) -> float:
    """The highest rate (req/s) up to which every point of ``seed`` met the target."""
    best = 0.0
    for point in sorted((p for p in points if p["seed"] == seed), key=lambda p: p["factor"]):
        if not meets(point["policies"][policy], target):
            break
        best = point["rate_per_s"]
    return best


def run(
    factors: tuple[float, ...],
    seeds: tuple[int, ...],
    min_critical: int,
    target: float,
    max_new_tokens: int,
    run_policies: RunPolicies,
) -> dict:
    points = []
    for seed in seeds:
        for factor in sorted(factors):
            workload = sustained_workload(factor, seed, min_critical, max_new_tokens)
            summaries = run_policies(workload, f"seed {seed} x{factor:g} ")
            points.append(
                {
                    "seed": seed,
                    "factor": factor,
                    "requests": len(workload.arrivals),
                    "rate_per_s": len(workload.arrivals) / max(workload.duration_s, 1e-9),
                    "policies": {name: judge(s) for name, s in summaries.items()},
                }
            )
    policies = list(points[0]["policies"]) if points else []
    return {
        "target": target,
        "min_critical": min_critical,
        "points": points,
        "goodput_req_s": {name: _spread(points, name, seeds, target) for name in policies},
    }


def _spread(points: list[dict], policy: str, seeds: tuple[int, ...], target: float) -> dict:
    per_seed = {str(seed): goodput(points, policy, seed, target) for seed in seeds}
    values = list(per_seed.values())
    return {
        "per_seed": per_seed,
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
    }


def render(result: dict, console: Console) -> None:
    table = Table(
        title=f"sustained rates: each tier's share within its SLO (95% interval); goodput needs "
        f"every lower bound >= {result['target']:.0%}"
    )
    for column in ("seed", "x", "req/s", "policy", "tiers (met/n, lower bound)", "busy"):
        table.add_column(
            column, justify="left" if column.startswith(("policy", "tiers")) else "right"
        )
    for point in result["points"]:
        for name, p in point["policies"].items():
            tiers = "  ".join(
                f"{tier} {t['met']}/{t['n']} ({t['ci95'][0]:.2f})" for tier, t in p["tiers"].items()
            )
            table.add_row(
                str(point["seed"]), f"{point['factor']:g}", f"{point['rate_per_s']:.2f}", name,
                tiers, f"{p['busy_fraction']:.0%}",
            )  # fmt: skip
    console.print(table)
    good = Table(title="goodput at sustained rates (req/s) per seed")
    for column in ("policy", "per seed", "mean", "min-max"):
        good.add_column(column, justify="left" if column == "policy" else "right")
    for name, g in result["goodput_req_s"].items():
        seeds = " ".join(f"{v:.2f}" for v in g["per_seed"].values())
        good.add_row(name, seeds, f"{g['mean']:.2f}", f"{g['min']:.2f}-{g['max']:.2f}")
    console.print(good)
