"""`tierflow bench --trace FILE --trace-start A,B,C`: the policies over several windows of a trace.

Each window is one ordinary policy benchmark (``bench.policy_bench``) on the same model and the
same calibrated predictor; the windows are then added up per policy and tier, so that a claim
about a rare tier (a few critical requests per window) rests on enough samples: attainment
comes with its 95% Wilson interval. Throughput is completed tokens (prompt + output) per
wall-clock second, summed over the windows' wall time.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import slo_curves
from bench.calibrate import calibrate
from bench.metrics import wilson_interval
from bench.policy_bench import PolicyBenchConfig, run_policy_bench
from bench.report import render_policy_tables, write_json
from bench.tables import print_table
from queue_service.scheduler import PrefillTimePredictor
from worker.engine import EngineConfig, PrefillEngine


def run_windows(cfg: PolicyBenchConfig, starts: tuple[float, ...], console: Console) -> dict:
    from worker.models import load_model

    loaded = load_model(cfg.model, device=cfg.device)
    if cfg.predictor_file is not None:
        predictor = PrefillTimePredictor.load(cfg.predictor_file)
    else:
        engine = PrefillEngine(loaded.model, EngineConfig(chunk_size=cfg.chunk_size))
        predictor = calibrate(engine)
    windows = []
    for start in starts:
        window_cfg = replace(cfg, trace_options=replace(cfg.trace_options, start_s=start))
        console.print(f"[bold]window at {start:g} s[/bold]")
        result = run_policy_bench(window_cfg, console, loaded, predictor)
        result["window_start_s"] = start
        render_policy_tables(result, console)
        windows.append(result)
    return {"windows": windows, "aggregate": aggregate(windows)}


def aggregate(windows: list[dict]) -> dict:
    """Per policy and tier: n, met, attainment with its 95% interval; throughput over all."""
    policies: dict[str, dict] = {}
    for name in windows[0]["policies"]:
        tiers: dict[str, dict] = {}
        wall = sum(w["policies"][name]["makespan_s"] for w in windows)
        lower_tokens = sum(
            w["policies"][name]["lower_tier_completed_tok_s"] * w["policies"][name]["makespan_s"]
            for w in windows
        )
        for w in windows:
            for tier, t in w["policies"][name]["tiers"].items():
                acc = tiers.setdefault(tier, {"n": 0, "met": 0})
                accepted = t["n"] - t["rejected"]
                acc["n"] += accepted
                acc["met"] += accepted - t["slo_violations"]
        for acc in tiers.values():
            acc["attainment"] = acc["met"] / acc["n"] if acc["n"] else float("nan")
            acc["ci95"] = wilson_interval(acc["met"], acc["n"])
        policies[name] = {
            "tiers": tiers,
            "lower_tier_completed_tok_s": lower_tokens / wall if wall else 0.0,
            "wall_s": wall,
        }
    return {"policies": policies}


def render_aggregate(agg: dict, console: Console) -> None:
    policies = agg["policies"]
    best_lower = {
        name: max(
            (p["lower_tier_completed_tok_s"] for other, p in policies.items() if other != name),
            default=0.0,
        )
        for name in policies
    }
    table = Table(title="all windows together")
    for col in ("policy", "tier", "n", "SLO met", "attainment (95% CI)", "lower tiers tok/s"):
        table.add_column(col, justify="right")
    for name, p in policies.items():
        ratio = (
            p["lower_tier_completed_tok_s"] / best_lower[name] if best_lower[name] else float("nan")
        )
        for tier, t in p["tiers"].items():
            lo, hi = t["ci95"]
            table.add_row(
                name,
                tier,
                str(t["n"]),
                str(t["met"]),
                f"{t['attainment']:.3f} ({lo:.2f}-{hi:.2f})",
                f"{p['lower_tier_completed_tok_s']:.0f} ({ratio:.3f}x best other)",
            )
    print_table(console, table, keys=2)


def markdown(result: dict) -> str:
    """Per-window and aggregate tables, as docs/results.md shows them."""
    lines = []
    for w in result["windows"]:
        lines += [
            f"**{w['workload']}**: {w['requests']} requests, {w['arrival_rate_per_s']:.2f}/s",
            "",
            "| policy | critical met | standard met | batch met | lower tiers tok/s | busy |",
            "|---|---|---|---|---|---|",
        ]
        for name, p in w["policies"].items():
            cells = [_met(p["tiers"].get(t)) for t in ("critical", "standard", "batch")]
            lines.append(
                f"| {name} | {' | '.join(cells)} | {p['lower_tier_completed_tok_s']:.0f} | "
                f"{p['busy_fraction'] * 100:.0f}% |"
            )
        lines.append("")
    lines += [
        "**All windows together** (95% Wilson intervals)",
        "",
        "| policy | critical | standard | batch | lower tiers tok/s |",
        "|---|---|---|---|---|",
    ]
    for name, p in result["aggregate"]["policies"].items():
        cells = [_rate(p["tiers"].get(t)) for t in ("critical", "standard", "batch")]
        lines.append(f"| {name} | {' | '.join(cells)} | {p['lower_tier_completed_tok_s']:.0f} |")
    return "\n".join(lines) + "\n"


def _met(tier: dict | None) -> str:
    if not tier:
        return "-"
    accepted = tier["n"] - tier["rejected"]
    return f"{accepted - tier['slo_violations']}/{accepted}"


def _rate(tier: dict | None) -> str:
    if not tier:
        return "-"
    lo, hi = tier["ci95"]
    return f"{tier['met']}/{tier['n']} = {tier['attainment']:.3f} ({lo:.2f}-{hi:.2f})"


def main(
    cfg: PolicyBenchConfig, starts: tuple[float, ...], json_path: Path | None, png_path: Path | None
) -> dict:
    console = Console()
    result = run_windows(cfg, starts, console)
    render_aggregate(result["aggregate"], console)
    result["slo_sensitivity"] = slo_curves.slo_sensitivity([result])  # the windows pooled
    slo_png = png_path.with_name(png_path.stem + "_slo.png") if png_path else None
    slo_curves.report(result["slo_sensitivity"], console, slo_png)
    write_json(result, json_path, console)
    if json_path is not None:
        json_path.with_suffix(".md").write_text(markdown(result))
        console.print(f"wrote {json_path.with_suffix('.md')}")
    return result
