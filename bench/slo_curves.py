"""SLO sensitivity: a tier's TTFT attainment as a function of its SLO, per policy.

One SLO invites the question whether it was picked to suit the mechanism under test (the
bound that layer-boundary preemption gives by construction). The curve answers it: the share
of the tier's requests whose TTFT is within ``m`` x the tier's isolated TTFT (its median-length
prompt alone on an idle engine, measured in the same run), for every ``m`` from 1.2 to 20.
Runs (seeds, trace windows) pool: each TTFT is taken as a multiple of its own run's isolated
TTFT. A request shed at admission or failed counts as a miss at every SLO.

With ``tierflow bench --slo-sweep``, ``configured`` adds points where the SLO was not only
judged but configured (``bench.slo_sweep``): the policies that plan by deadlines run again
under it (dots with their 95% intervals on the plot).

``flowprefill_vs`` gives, per baseline, the SLO ranges over which flowprefill met the SLO for
more requests (by at least one), those over which it met it for fewer, and the parts of each
where the two policies' 95% Wilson intervals do not overlap.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from bench.metrics import wilson_interval
from bench.tables import print_table

TABLE_MULTIPLES = (1.2, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0)
MULTIPLES = tuple(
    sorted({round(float(m), 4) for m in np.geomspace(1.2, 20.0, 36)} | set(TABLE_MULTIPLES))
)
SUBJECT = "flowprefill"


def runs_in(result: dict) -> list[dict]:
    """The policy runs in a ``tierflow bench`` JSON: itself, or each of its trace windows."""
    return result.get("windows", [result])


def ttft_multiples(run: dict, tier: str) -> dict[str, tuple[list[float], int]]:
    """Per policy: the tier's TTFTs as multiples of the run's isolated TTFT, and the number of
    the tier's requests (completed or not)."""
    isolated = run["isolated_ttft_ms"].get(tier)
    out = {}
    for name, policy in run["policies"].items():
        t = policy["tiers"].get(tier)
        if t is None or not isolated:
            continue
        out[name] = ([ms / isolated for ms in t["ttft_samples_ms"]], t["n"])
    return out


def pooled(results: list[dict], tier: str) -> dict[str, tuple[list[float], int]]:
    pool: dict[str, tuple[list[float], int]] = {}
    for run in (r for result in results for r in runs_in(result)):
        for name, (multiples, n) in ttft_multiples(run, tier).items():
            have, count = pool.get(name, ([], 0))
            pool[name] = (have + multiples, count + n)
    return pool


def attainment(ttfts: list[float], n: int, slo: float) -> int:
    """How many of the ``n`` requests had a TTFT within ``slo`` (in the TTFTs' own unit: ms,
    or multiples of the isolated TTFT)."""
    return sum(t <= slo for t in ttfts) if n else 0


def ranges(grid: tuple[float, ...], mask: list[bool]) -> list[list[float]]:
    """The contiguous stretches of ``grid`` where ``mask`` holds, as [first, last] pairs."""
    out: list[list[float]] = []
    for x, on, before in zip(grid, mask, [False, *mask[:-1]], strict=True):
        if on and not before:
            out.append([x, x])
        elif on:
            out[-1][1] = x
    return out


def slo_sensitivity(results: list[dict], tier: str = "critical") -> dict:
    pool = pooled(results, tier)
    met = {name: [attainment(m, n, x) for x in MULTIPLES] for name, (m, n) in pool.items()}
    n = {name: count for name, (_, count) in pool.items()}
    out = {
        "tier": tier,
        "runs": sum(len(runs_in(r)) for r in results),
        "multiples": list(MULTIPLES),
        "n": n,
        "attainment": {name: [k / n[name] for k in met[name]] for name in pool},
        "ci95": {name: [list(wilson_interval(k, n[name])) for k in met[name]] for name in pool},
        "configured_slo_multiple": _configured_multiple(results, tier),
    }
    if SUBJECT in met:
        out["flowprefill_vs"] = {
            name: _versus(met[SUBJECT], n[SUBJECT], counts, n[name])
            for name, counts in met.items()
            if name != SUBJECT
        }
    configured = _configured(results, tier, pool)
    if configured:
        out["configured"] = configured
    return out


def _configured(results: list[dict], tier: str, pool: dict) -> list[dict]:
    """The ``--slo-sweep`` points pooled over runs: per multiple, each policy's requests within
    that SLO, from its rerun under it where it was rerun (``rerun``: True), else judged from
    the main run (exact for a policy that never reads a deadline)."""
    sums: dict[float, dict[str, list[int]]] = {}
    for run in (r for result in results for r in runs_in(result)):
        sweep = run.get("slo_configured")
        if not sweep or sweep["tier"] != tier:
            continue
        for point in sweep["points"]:
            into = sums.setdefault(point["multiple"], {})
            for name, counts in point["policies"].items():
                acc = into.setdefault(name, [0, 0])
                acc[0] += counts["met"]
                acc[1] += counts["n"]
    points = []
    for multiple in sorted(sums):
        row = {}
        for name, (ttfts, n) in pool.items():
            rerun = name in sums[multiple]
            k, total = sums[multiple][name] if rerun else (attainment(ttfts, n, multiple), n)
            row[name] = {
                "met": k, "n": total, "rerun": rerun,
                "attainment": k / total if total else float("nan"),
                "ci95": list(wilson_interval(k, total)),
            }  # fmt: skip
        points.append({"multiple": multiple, "policies": row})
    return points


def _versus(mine: list[int], my_n: int, theirs: list[int], their_n: int) -> dict:
    """Where flowprefill met the SLO for at least one request more (or fewer) than a baseline
    (the runs give every policy the same arrivals), and where the two 95% intervals do not
    even overlap ("clearly")."""
    mine_ci = [wilson_interval(k, my_n) for k in mine]
    theirs_ci = [wilson_interval(k, their_n) for k in theirs]
    delta = [a / my_n - b / their_n for a, b in zip(mine, theirs, strict=True)]
    one = 1 / max(my_n, their_n)
    return {
        "better": ranges(MULTIPLES, [d >= one - 1e-12 for d in delta]),
        "worse": ranges(MULTIPLES, [d <= -one + 1e-12 for d in delta]),
        "clearly_better": ranges(
            MULTIPLES, [m[0] > t[1] for m, t in zip(mine_ci, theirs_ci, strict=True)]
        ),
        "clearly_worse": ranges(
            MULTIPLES, [m[1] < t[0] for m, t in zip(mine_ci, theirs_ci, strict=True)]
        ),
    }


def _configured_multiple(results: list[dict], tier: str) -> float | None:
    """The configured SLO over the isolated TTFT (median over runs), to mark on the curve."""
    ratios = []
    for run in (r for result in results for r in runs_in(result)):
        isolated = run["isolated_ttft_ms"].get(tier)
        policy = next(iter(run["policies"].values()))
        slo_ms = policy["tiers"].get(tier, {}).get("slo_ms")
        if isolated and slo_ms:
            ratios.append(slo_ms / isolated)
    return statistics.median(ratios) if ratios else None


def render_slo_table(curve: dict, console: Console) -> None:
    table = Table(
        title=f"{curve['tier']} TTFT SLO sensitivity: share within m x isolated TTFT "
        f"({curve['runs']} run(s) pooled)"
    )
    table.add_column("policy")
    table.add_column("n", justify="right")
    for m in TABLE_MULTIPLES:
        table.add_column(f"{m:g}x", justify="right")
    for name, n in curve["n"].items():
        cells = [_share_at(curve, name, m) for m in TABLE_MULTIPLES]
        table.add_row(name, str(n), *cells)
    print_table(console, table)
    if "configured" in curve:
        _render_configured(curve, console)
    for name, sides in curve.get("flowprefill_vs", {}).items():
        console.print(
            f"flowprefill vs {name}: more within the SLO at {_ranges_text(sides['better'])} "
            f"(95% intervals apart at {_ranges_text(sides['clearly_better'])}); fewer at "
            f"{_ranges_text(sides['worse'])} (apart at {_ranges_text(sides['clearly_worse'])})"
        )


def _render_configured(curve: dict, console: Console) -> None:
    names = list(curve["n"])
    table = Table(
        title=f"{curve['tier']} SLO configured at m x isolated TTFT (*: run again under it; "
        "others judged from the main run, which they do not plan by)"
    )
    table.add_column("m", justify="right")
    for name in names:
        table.add_column(name, justify="right")
    for point in curve["configured"]:
        cells = []
        for name in names:
            p = point["policies"][name]
            star = "*" if p["rerun"] else ""
            cells.append(f"{p['met']}/{p['n']}{star} ({p['attainment'] * 100:.0f}%)")
        table.add_row(f"{point['multiple']:g}x", *cells)
    print_table(console, table)


def _share_at(curve: dict, name: str, m: float) -> str:
    n = curve["n"][name]
    share = curve["attainment"][name][curve["multiples"].index(m)]
    return f"{share * 100:.0f}% ({round(share * n)})"


def _ranges_text(spans: list[list[float]]) -> str:
    if not spans:
        return "none"
    return ", ".join(f"{a:.2g}x-{b:.2g}x" for a, b in spans)


def plot_slo_sensitivity(curve: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.report import POLICY_COLOURS

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = curve["multiples"]
    for name, shares in curve["attainment"].items():
        colour = POLICY_COLOURS.get(name)
        low = [lo for lo, _ in curve["ci95"][name]]
        high = [hi for _, hi in curve["ci95"][name]]
        ax.plot(xs, shares, color=colour, label=f"{name} (n={curve['n'][name]})")
        ax.fill_between(xs, low, high, color=colour, alpha=0.12, linewidth=0)
    for point in curve.get("configured", []):
        for name, p in point["policies"].items():
            if p["rerun"]:
                low, high = p["ci95"]
                share = p["attainment"]
                ax.errorbar(
                    [point["multiple"]], [share], yerr=[[share - low], [high - share]],
                    color=POLICY_COLOURS.get(name), marker="o", capsize=3, linestyle="none",
                )  # fmt: skip
    if curve["configured_slo_multiple"]:
        ax.axvline(
            curve["configured_slo_multiple"], color="gray", linestyle=":", label="configured SLO"
        )
    ax.set_xscale("log")
    ax.set_xlabel(f"{curve['tier']} TTFT SLO (x isolated TTFT, log)")
    ax.set_ylabel("share of requests within the SLO")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"SLO sensitivity, {curve['tier']} tier ({curve['runs']} run(s); 95% bands)")
    if ax.get_legend_handles_labels()[0]:  # a run with no curve to draw has no legend either
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(curve: dict, console: Console, png_path: Path | None) -> None:
    render_slo_table(curve, console)
    if png_path is not None:
        plot_slo_sensitivity(curve, png_path)
        console.print(f"wrote {png_path}")
