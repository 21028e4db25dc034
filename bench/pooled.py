"""`tierflow pool RUN.json ...`: several `tierflow bench` runs (seeds, trace windows) pooled.

- the SLO sensitivity curves of a tier over all runs (``bench.slo_curves``);
- the sustained-rate points of the runs side by side, when they have any
  (``bench.sustained.merged``): goodput and attainment per rate over every seed measured;
- the lower tiers' throughput loss as FlowPrefill defines it: their completed tokens per
  wall-clock second under each policy against fifo on the same arrivals, one ratio per run,
  with the mean's 95% t interval over the runs (each run is one sample: its makespan, not its
  requests, is what varies).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import slo_curves, sustained
from bench.metrics import mean_interval
from bench.report import write_json
from bench.tables import print_table

REFERENCE = "fifo"


def lower_tier_vs_fifo(results: list[dict]) -> dict:
    """Per policy: each run's lower-tier completed tokens/s over fifo's, their mean and 95%
    interval (``None`` with one run)."""
    ratios: dict[str, list[float]] = {}
    for run in (r for result in results for r in slo_curves.runs_in(result)):
        policies = run["policies"]
        base = policies.get(REFERENCE, {}).get("lower_tier_completed_tok_s")
        if not base:
            continue
        for name, policy in policies.items():
            ratios.setdefault(name, []).append(policy["lower_tier_completed_tok_s"] / base)
    return {
        name: {
            "per_run": values,
            "mean": statistics.fmean(values),
            "ci95": list(mean_interval(values)) if len(values) > 1 else None,
        }
        for name, values in ratios.items()
    }


def render_throughput(table_data: dict, console: Console) -> None:
    if not table_data:
        console.print(f"(no {REFERENCE} run to compare the lower tiers' throughput with)")
        return
    table = Table(title="lower tiers' completed tokens per wall-clock second, against fifo")
    for column in ("policy", "runs", "mean", "95% interval", "per run"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, row in table_data.items():
        ci = row["ci95"]
        table.add_row(
            name, str(len(row["per_run"])), f"{row['mean']:.3f}x",
            f"{ci[0]:.3f}-{ci[1]:.3f}" if ci else "-",
            " ".join(f"{r:.3f}" for r in row["per_run"]),
        )  # fmt: skip
    print_table(console, table)


def main(paths: list[Path], tier: str, json_path: Path | None, png_path: Path | None) -> dict:
    console = Console()
    results = [json.loads(path.read_text()) for path in paths]
    pooled = {
        "sources": [str(path) for path in paths],
        "slo_sensitivity": slo_curves.slo_sensitivity(results, tier),
        "lower_tier_vs_fifo": lower_tier_vs_fifo(results),
    }
    slo_curves.report(pooled["slo_sensitivity"], console, png_path)
    render_throughput(pooled["lower_tier_vs_fifo"], console)
    side_by_side = sustained.merged(results)
    if side_by_side is not None:
        pooled["sustained"] = side_by_side
        sustained.render(side_by_side, console)
        sustained.write_outputs(side_by_side, json_path, png_path, console)
    write_json(pooled, json_path, console)
    return pooled
