"""Tables and pictures of the policy benchmark."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.tables import print_table

POLICY_COLOURS = {
    "fifo": "tab:gray",
    "priority": "tab:blue",
    "chunked": "tab:orange",
    "recompute": "tab:red",
    "flowprefill": "tab:green",
}


SMOKE_NOTE = (
    "QUICK RUN: a smoke test of the command, with too few samples to compare policies or "
    "engines; every number in the README and docs/results.md comes from a full run"
)


def mark_smoke(result: dict, console: Console) -> None:
    """Quick runs are for smoke tests only: said in the output and in the JSON."""
    result["smoke_test_only"] = True
    console.print(f"[bold red]{SMOKE_NOTE}[/]")


def finish(
    result: dict,
    *,
    smoke: bool,
    json_path: Path | None,
    png_path: Path | None,
    render,
    plot,
    console: Console,
) -> dict:
    """What every engine benchmark ends with: its tables, the smoke note of a quick run, the
    JSON and the PNG."""
    render(result, console)
    if smoke:
        mark_smoke(result, console)
    write_json(result, json_path, console)
    if png_path:
        plot(result, png_path)
        console.print(f"wrote {png_path}")
    return result


def write_json(result: dict, path: Path | None, console: Console) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {path}")


def render_policy_tables(result: dict, console: Console) -> None:
    print_table(console, _tier_table(result), keys=2)
    print_table(console, _totals_table(result))
    print_table(console, _rates_table(result))


def _table(title: str, columns: tuple[str, ...], left: tuple[str, ...]) -> Table:
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    return table


def _tier_table(result: dict) -> Table:
    table = _table(
        f"tierflow bench: {result['model']} on {result['device']}, {result['workload']}, "
        f"{result['requests']} requests",
        ("policy", "tier", "n", "done", "rej", "SLO ms", "SLO met", "p50 ms", "p90 ms", "p99 ms",
         "isolated ms", "TBT p50/p99 ms", "TBT met"),
        ("policy", "tier"),
    )  # fmt: skip
    for name, summary in result["policies"].items():
        for i, (tier, t) in enumerate(summary["tiers"].items()):
            q = t["ttft_ms"]
            table.add_row(
                name if i == 0 else "",
                tier,
                str(t["n"]),
                str(t["completed"]),
                str(t["rejected"]),
                f"{t['slo_ms']:.0f}",
                f"{t['slo_attainment'] * 100:.1f}%",
                f"{q['p50']:.0f}",
                f"{q['p90']:.0f}",
                f"{q['p99']:.0f}",
                f"{result['isolated_ttft_ms'].get(tier, float('nan')):.0f}",
                _tbt_cell(t),
                _share(t.get("tbt_attainment")),
            )
        table.add_section()
    return table


def _tbt_cell(tier: dict) -> str:
    tbt = tier.get("tbt_ms")
    if not tbt or tbt["p50"] != tbt["p50"]:  # NaN: no request had a second token
        return "-"
    return f"{tbt['p50']:.0f} / {tbt['p99']:.0f}"


def _share(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value * 100:.1f}%"


def _totals_table(result: dict) -> Table:
    table = _table(
        "per policy",
        ("policy", "engine", "throughput tok/s", "busy", "preemptions", "recomputes",
         "preempt latency p50/p99 ms", "lost", "ran as", "speed probe ms"),
        ("policy", "engine"),
    )  # fmt: skip
    for name, s in result["policies"].items():
        lat = s["preemption_latency_ms"]
        table.add_row(
            name,
            f"C={s['engine']['chunk_size']}, check={s['engine']['check']}",
            f"{s['throughput_tok_s']:.0f}",
            f"{s['busy_fraction'] * 100:.0f}%",
            str(s["preemptions"]),
            str(s["recomputes"]),
            f"{lat['p50']:.1f} / {lat['p99']:.1f}",
            str(s["lost"]),
            _position(s.get("run_position")),
            f"{s['speed_probe_ms']:.0f}" if "speed_probe_ms" in s else "-",
        )
    return table


def _position(position: int | None) -> str:
    """Which run of the bench this policy's was (older JSON files do not say)."""
    return "-" if position is None else f"#{position + 1}"


def _rates_table(result: dict) -> Table:
    table = _table(
        "per policy: wall-clock throughput, predictor, scheduler cost",
        ("policy", "completed tok/s", "lower tiers tok/s", "output tok/s", "rows/step",
         "packs (requests)", "decode pauses / drops", "predictor |err| p50 / p95 (n)",
         "decide us/event", "progress events"),
        ("policy",),
    )  # fmt: skip
    for name, s in result["policies"].items():
        table.add_row(
            name,
            f"{s['completed_tok_s']:.0f}",
            f"{s['lower_tier_completed_tok_s']:.0f}",
            f"{s['output_tok_s']:.1f}",
            f"{s['decode']['mean_rows']:.1f}",
            f"{s['packs']} ({s['packed_requests']})",
            f"{s['decode_pauses']} / {s['decode_drops']}",
            _prediction_cell(s["prediction_error"]),
            f"{s['scheduler']['decide_us_per_event']:.0f}",
            str(s["scheduler"]["progress_events"]),
        )
    return table


def _prediction_cell(error: dict) -> str:
    """The predictor's |error| p50 / p95 (n); "-" when it measured nothing: a run through the
    services (`bench --stack`) has no in-process predictor, so its summary is empty."""
    if not error.get("n"):
        return "-"
    return f"{error['abs_p50']:.0%} / {error['abs_p95']:.0%} ({error['n']})"


def comparison_lines(result: dict) -> list[str]:
    """The issue's targets as ratios measured in this run (printed, never asserted here)."""
    p = result["policies"]
    lines = []
    if "flowprefill" not in p:
        return lines
    fp = p["flowprefill"]
    crit = fp["tiers"].get("critical")
    if crit:
        lines.append(f"flowprefill critical SLO attainment: {crit['slo_attainment'] * 100:.1f}%")
        iso = result["isolated_ttft_ms"].get("critical")
        if iso is not None:
            lines.append(
                f"flowprefill critical TTFT p99 {crit['ttft_ms']['p99']:.0f} ms vs isolated "
                f"{iso:.0f} ms (+{crit['ttft_ms']['p99'] - iso:.0f} ms)"
            )
        for base in ("fifo", "chunked", "recompute", "priority"):
            if base in p and "critical" in p[base]["tiers"]:
                theirs = p[base]["tiers"]["critical"]["slo_violations"]
                fewer = 1 - crit["slo_violations"] / theirs if theirs else float("nan")
                lines.append(
                    f"critical SLO violations: flowprefill {crit['slo_violations']} vs {base} "
                    f"{theirs} ({fewer * 100:.0f}% fewer)"
                )
    if "priority" in p and p["priority"]["throughput_tok_s"]:
        ratio = fp["throughput_tok_s"] / p["priority"]["throughput_tok_s"]
        lines.append(f"throughput flowprefill / priority: {ratio:.3f}x")
    best = max((v["completed_tok_s"] for k, v in p.items() if k != "flowprefill"), default=0.0)
    if best:
        ratio = fp["completed_tok_s"] / best
        lines.append(f"completed tok/s (wall clock) flowprefill / best baseline: {ratio:.3f}x")
    lines.append(f"requests lost under flowprefill: {fp['lost']}")
    if "sustained" in result:
        g = {name: v["mean"] for name, v in result["sustained"]["goodput_req_s"].items()}
        best = max((v for k, v in g.items() if k != "flowprefill"), default=0.0)
        if best:
            ratio = g.get("flowprefill", 0.0) / best
            lines.append(f"sustained goodput (mean) flowprefill / best baseline: {ratio:.2f}x")
        else:
            lines.append("sustained goodput: no baseline met the target at any rate tried")
    return lines


def render_comparison(result: dict, console: Console) -> None:
    for line in comparison_lines(result):
        console.print(line)


def latency_cdf_axis(ax, title: str) -> None:
    """The axis of a preemption-latency CDF (log milliseconds)."""
    ax.set_xscale("log")
    ax.set_xlabel("preemption latency (ms, log)")
    ax.set_ylabel("CDF")
    ax.set_title(title)


def save_figure(fig, path: Path) -> None:
    plt = pyplot()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _null_formatter():
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def plot_ttft_cdfs(result: dict, path: Path) -> None:
    plt = pyplot()
    tiers = list(next(iter(result["policies"].values()))["tiers"])
    fig, axes = plt.subplots(1, len(tiers), figsize=(5 * len(tiers), 4), squeeze=False)
    for ax, tier in zip(axes[0], tiers, strict=True):
        for name, summary in result["policies"].items():
            samples = summary["tiers"][tier]["ttft_samples_ms"]
            if not samples:
                continue
            ys = [(i + 1) / len(samples) for i in range(len(samples))]
            ax.step(samples, ys, where="post", label=name, color=POLICY_COLOURS.get(name))
        slo = next(iter(result["policies"].values()))["tiers"][tier]["slo_ms"]
        ax.axvline(slo, color="black", linestyle="--", linewidth=1, label="SLO")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(_null_formatter())
        ax.set_title(f"{tier}: TTFT CDF")
        ax.set_xlabel("TTFT (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{result['model']} on {result['device']}: {result['workload']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
