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
and the tables show what that leaves of each tier, with how many requests were shed and how many
reached the aging threshold.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import slo_curves, ttft_bound
from bench.metrics import wilson_interval
from bench.tables import print_table
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
            "aged": t.get("aged"),  # None: a run from before the bench counted them
            # Misses while another request of the tier got its first token: its own load.
            "misses_behind_own_tier": t.get("misses_behind_own_tier"),
            "ttft_ms": t.get("ttft_ms"),  # p50, p90, p95, p99 of those that got a first token
            # Those that had the engines to themselves: the run's own isolated TTFT.
            "alone_ttft_ms": t.get("alone_ttft_ms"),
        }  # fmt: skip
    return {
        "tiers": tiers,
        "busy_fraction": summary["busy_fraction"],
        "lower_tier_completed_tok_s": summary["lower_tier_completed_tok_s"],
        "cpu_steal": summary.get("cpu_steal"),  # None: a run from before the bench measured it
        "decode_step_ms": summary.get("decode", {}).get("step_ms_p50"),
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
    isolated_p95_ms: Callable[[Workload], dict[str, float]] | None = None,
    budget_ms: float | None = None,
) -> dict:
    """``isolated_p95_ms``: each tier's isolated TTFT p95 on a workload, and ``budget_ms`` the
    preemption budget, for the top tier's TTFT bound (``bench.ttft_bound``)."""
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
                    "isolated_p95_ms": isolated_p95_ms(workload) if isolated_p95_ms else None,
                }
            )
    return {**summarise(points, seeds, target, min_critical), "budget_ms": budget_ms}


def summarise(points: list[dict], seeds: tuple[int, ...], target: float, min_critical: int) -> dict:
    policies = list(points[0]["policies"]) if points else []
    return {
        "target": target,
        "min_critical": min_critical,
        "points": points,
        "pooled": pooled_over_seeds(points),
        "goodput_req_s": {name: _spread(points, name, seeds, target) for name in policies},
    }


def merged(results: list[dict]) -> dict | None:
    """The sustained points of several ``tierflow bench`` runs as one result (``tierflow
    pool``), for a measurement too long for one command: say one policy and one seed per run.
    A point (seed, rate factor) has the same arrivals in every run, so the policies measured on
    it in different runs stand side by side. A point that lacks a policy that others have is
    left out of the tables and listed under ``incomplete_points``."""
    parts = [r["sustained"] for r in results if r.get("sustained")]
    if not parts:
        return None
    if len({(p["target"], p["min_critical"]) for p in parts}) > 1:
        raise ValueError("sustained runs with different targets or min_critical do not pool")
    by_point: dict[tuple[int, float], dict] = {}
    for point in (point for part in parts for point in part["points"]):
        key = (point["seed"], point["factor"])
        into = by_point.setdefault(key, {**point, "policies": {}})
        if into["requests"] != point["requests"]:
            raise ValueError(f"seed {key[0]} x{key[1]:g}: two runs had different arrivals")
        if set(into["policies"]) & set(point["policies"]):
            raise ValueError(f"seed {key[0]} x{key[1]:g}: a policy was measured twice")
        into["policies"].update(point["policies"])
    names = list(dict.fromkeys(n for p in by_point.values() for n in p["policies"]))
    complete, incomplete = [], []
    for key, point in sorted(by_point.items()):
        if set(point["policies"]) == set(names):
            complete.append({**point, "policies": {n: point["policies"][n] for n in names}})
        else:
            incomplete.append(list(key))
    seeds = tuple(sorted({p["seed"] for p in complete}))
    result = summarise(complete, seeds, parts[0]["target"], parts[0]["min_critical"])
    budgets = {p["budget_ms"] for p in parts if p.get("budget_ms") is not None}
    if len(budgets) > 1:
        raise ValueError(f"sustained runs with different preemption budgets: {sorted(budgets)}")
    budget = budgets.pop() if budgets else None
    return {**result, "budget_ms": budget, "incomplete_points": incomplete}


def pooled_over_seeds(points: list[dict]) -> list[dict]:
    """Per rate factor, each policy's tiers over all seeds together (met and n summed, a Wilson
    interval on the sum): the curve of attainment against load, with the seeds' samples."""
    pooled = []
    for factor in sorted({p["factor"] for p in points}):
        at = [p for p in points if p["factor"] == factor]
        policies = {}
        for name in at[0]["policies"]:
            tiers = {}
            for tier in at[0]["policies"][name]["tiers"]:
                met = sum(p["policies"][name]["tiers"][tier]["met"] for p in at)
                n = sum(p["policies"][name]["tiers"][tier]["n"] for p in at)
                tiers[tier] = {"met": met, "n": n, "attainment": met / n,
                               "ci95": list(wilson_interval(met, n))}  # fmt: skip
            policies[name] = {"tiers": tiers}
        rate = statistics.fmean(p["rate_per_s"] for p in at)
        pooled.append(
            {"factor": factor, "rate_per_s": rate, "seeds": len(at), "policies": policies}
        )
    return pooled


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
    columns = (
        "seed", "x", "req/s", "policy", "tiers (met/n, lower bound)", "busy", "shed / aged",
        "top misses (own tier)",
    )  # fmt: skip
    for column in columns:
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
                tiers, f"{p['busy_fraction']:.0%}", shed_and_aged(p), top_misses(p),
            )  # fmt: skip
    print_table(console, table)
    good = Table(title="goodput at sustained rates (req/s) per seed")
    for column in ("policy", "per seed", "mean", "min-max"):
        good.add_column(column, justify="left" if column == "policy" else "right")
    for name, g in result["goodput_req_s"].items():
        seeds = " ".join(f"{v:.2f}" for v in g["per_seed"].values())
        good.add_row(name, seeds, f"{g['mean']:.2f}", f"{g['min']:.2f}-{g['max']:.2f}")
    print_table(console, good)
    ttft_bound.render(result, console)


def shed_and_aged(point_policy: dict) -> str:
    """Requests refused at admission, and those that reached the aging threshold, over all
    tiers: what overload did at this point."""
    tiers = point_policy["tiers"].values()
    shed = sum(t["rejected"] for t in tiers)
    aged = [t.get("aged") for t in tiers]
    return f"{shed} / {'-' if None in aged else sum(aged)}"


def top_misses(point_policy: dict) -> str:
    """The top tier's misses, and how many of them waited while another request of that tier
    got its first token (the tier's own load, not lower-tier work)."""
    top = next(iter(point_policy["tiers"].values()))
    behind = top.get("misses_behind_own_tier")
    return f"{top['n'] - top['met']} ({'-' if behind is None else behind})"


def tiers_of(result: dict) -> list[str]:
    """The tiers in the result's points, in the mix's order (none without points)."""
    if not result["pooled"]:
        return []
    return list(next(iter(result["pooled"][0]["policies"].values()))["tiers"])


def markdown(result: dict) -> str:
    """The pooled, goodput and per-point tables, as docs/results.md shows them."""
    tiers = tiers_of(result)
    head = "| " + " | ".join(tiers) + " |"
    rule = "|---" * len(tiers) + "|"
    lines = ["**Per rate, seeds pooled** (met/n, share, 95% Wilson interval)", "",
             "| x | req/s | policy " + head, "|---|---|---" + rule]  # fmt: skip
    for point in result["pooled"]:
        for name, p in point["policies"].items():
            cells = " | ".join(_share(p["tiers"][t]) for t in tiers)
            lines.append(f"| {point['factor']:g} | {point['rate_per_s']:.2f} | {name} | {cells} |")
    lines += ["", f"**Goodput** (req/s; every tier's lower bound >= {result['target']:.0%})", "",
              "| policy | per seed | mean | min-max |", "|---|---|---|---|"]  # fmt: skip
    for name, g in result["goodput_req_s"].items():
        seeds = ", ".join(f"{v:.2f}" for v in g["per_seed"].values())
        lines.append(f"| {name} | {seeds} | {g['mean']:.2f} | {g['min']:.2f}-{g['max']:.2f} |")
    if result.get("incomplete_points"):
        left = ", ".join(f"seed {seed} x{factor:g}" for seed, factor in result["incomplete_points"])
        lines += ["", f"Left out, not measured under every policy: {left}."]
    lines += ["", "**Per seed and rate** (met/n, lower bound)", "",
              "| seed | x | req/s | policy " + head + " busy | lower tiers tok/s | shed / aged | "
              "CPU steal |",
              "|---|---|---|---" + rule + "---|---|---|---|"]  # fmt: skip
    for point in result["points"]:
        for name, p in point["policies"].items():
            cells = " | ".join(
                f"{p['tiers'][t]['met']}/{p['tiers'][t]['n']} ({p['tiers'][t]['ci95'][0]:.2f})"
                for t in tiers
            )
            lines.append(
                f"| {point['seed']} | {point['factor']:g} | {point['rate_per_s']:.2f} | {name} | "
                f"{cells} | {p['busy_fraction']:.0%} | {p['lower_tier_completed_tok_s']:.0f} | "
                f"{shed_and_aged(p)} | {_percent(p.get('cpu_steal'))} |"
            )
    bound = ttft_bound.markdown(result)
    lines += ["", *bound] if bound else []
    return "\n".join(lines) + "\n"


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def write_outputs(
    result: dict, json_path: Path | None, png_path: Path | None, console: Console
) -> None:
    """Next to the run's JSON and PNG: ``<json>_sustained.md`` and ``<png>_sustained.png``."""
    if json_path:
        tables = json_path.with_name(json_path.stem + "_sustained.md")
        tables.write_text(markdown(result))
        console.print(f"wrote {tables}")
    if png_path and result["pooled"]:
        plot = png_path.with_name(png_path.stem + "_sustained.png")
        plot_sustained(result, plot)
        console.print(f"wrote {plot}")


def _share(tier: dict) -> str:
    lo, hi = tier["ci95"]
    return f"{tier['met']}/{tier['n']} = {tier['attainment']:.3f} ({lo:.2f}-{hi:.2f})"


def plot_sustained(result: dict, path: Path) -> None:
    """One panel per tier: attainment against the arrival rate, per policy, pooled over seeds
    (95% Wilson bars), with the goodput target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.report import POLICY_COLOURS

    pooled = result["pooled"]
    tiers = tiers_of(result)
    fig, axes = plt.subplots(1, len(tiers), figsize=(4.2 * len(tiers), 4), squeeze=False)
    names = list(pooled[0]["policies"])
    for ax, tier in zip(axes[0], tiers, strict=True):
        for i, name in enumerate(names):
            dodge = 1 + 0.015 * (i - (len(names) - 1) / 2)  # bars side by side, not on top
            rates = [p["rate_per_s"] * dodge for p in pooled]
            cells = [p["policies"][name]["tiers"][tier] for p in pooled]
            shares = [c["attainment"] for c in cells]
            bars = [[s - c["ci95"][0] for s, c in zip(shares, cells, strict=True)],
                    [c["ci95"][1] - s for s, c in zip(shares, cells, strict=True)]]  # fmt: skip
            ax.errorbar(rates, shares, yerr=bars, label=name, color=POLICY_COLOURS.get(name),
                        marker="o", capsize=3)  # fmt: skip
        ax.axhline(result["target"], color="gray", linestyle=":", label="target")
        n = sum(p["policies"][name]["tiers"][tier]["n"] for p in pooled) // max(len(pooled), 1)
        ax.set_title(f"{tier} (about {n} per point)")
        ax.set_xlabel("arrival rate (req/s), fresh Poisson")
        ax.set_ylim(0, 1.02)
    axes[0][0].set_ylabel("share within the SLO (all seeds)")
    axes[0][-1].legend(loc="lower left", fontsize=8)
    counts = sorted({p["seeds"] for p in pooled})
    seeds = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    fig.suptitle(f"sustained rates, {seeds} seed(s) pooled per rate; 95% intervals")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
