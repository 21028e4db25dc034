"""The audit's report: ``audit.json`` (the summary), ``audit.md`` and ``audit.html`` (the same
tables, with the plots) and four small PNGs."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ops.audit import MINUTE_S, Audit

_FIG = {"figsize": (7.5, 2.8), "dpi": 80}
PLOTS = ("lengths.png", "arrivals.png", "mix.png", "hol.png")


def write_report(audit: Audit, summary: dict, out_dir: Path, title: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "audit.json",
        "markdown": out_dir / "audit.md",
        "html": out_dir / "audit.html",
    }
    paths["json"].write_text(json.dumps(summary, indent=2, default=_nan_to_none))
    _plot_lengths(audit, out_dir / "lengths.png")
    _plot_arrivals(audit, out_dir / "arrivals.png", share=False)
    _plot_arrivals(audit, out_dir / "mix.png", share=True)
    _plot_hol(summary, out_dir / "hol.png")
    tables = _tables(summary)
    paths["markdown"].write_text(_markdown(title, tables, summary))
    paths["html"].write_text(_html(title, tables, summary))
    return paths


def _nan_to_none(value):
    return None


def _tables(summary: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    tiers = summary["tiers"]
    lengths = [
        [name, str(t["n"]), *(_f(t["prompt_tokens"][k]) for k in ("p50", "p90", "p99", "max")),
         *(_f(t["output_tokens"][k]) for k in ("p50", "p99"))]
        for name, t in tiers.items()
    ]  # fmt: skip
    arrivals = [
        [name, f"{t['rate_per_s']:.3g}", f"{t['interarrival_cv']:.2f}",
         f"{t['peak_to_mean_per_minute']:.2f}"]
        for name, t in tiers.items()
    ]  # fmt: skip
    hol = [
        [name, f"{t['slo_s']:g}", str(t["hol_exposures"]),
         _share(t["violations"]["fifo"], t["n"]), _share(t["violations"]["flowprefill"], t["n"]),
         _f(t["ttft_ms"]["fifo"]["p99"]), _f(t["ttft_ms"]["flowprefill"]["p99"])]
        for name, t in tiers.items()
    ]  # fmt: skip
    observed = [
        [name, str(t["statuses"].get("done", 0)), _share(t["violations"]["observed"], t["n"]),
         _f(t["ttft_ms"]["observed"]["p99"]), *_tbt_cells(t)]
        for name, t in tiers.items()
        if "observed" in t["ttft_ms"]
    ]  # fmt: skip
    rec = summary["recommended"]
    recommended = [[f"ttft_slo_s.{k}", f"{v:g}", rec["why"]["ttft_slo_s"]]
                   for k, v in rec["ttft_slo_s"].items()]  # fmt: skip
    recommended += [
        ["chunk_size", str(rec["chunk_size"]), rec["why"]["chunk_size"]],
        ["memory_cap_bytes", f"{rec['memory_cap_bytes']:,}", rec["why"]["memory_cap_bytes"]],
    ]
    tables = [
        ("Lengths (tokens)", ["tier", "n", "prompt p50", "p90", "p99", "max", "output p50",
                              "p99"], lengths),
        ("Arrivals", ["tier", "rate /s", "inter-arrival CV", "peak/mean per minute"], arrivals),
        ("Head-of-line blocking and SLO violations (estimated)",
         ["tier", "SLO s", "HOL exposures", "violations FIFO", "violations flowprefill",
          "TTFT p99 FIFO ms", "TTFT p99 flowprefill ms"], hol),
        ("Recommended settings", ["setting", "value", "why"], recommended),
    ]  # fmt: skip
    if observed:  # a request log: what the service measured, TTFT and time between tokens
        tables.insert(3, (
            "Observed (request log)",
            ["tier", "done", "TTFT violations", "TTFT p99 ms", "TBT violations",
             "TBT p99 ms (p99 of requests' p99)"], observed,
        ))  # fmt: skip
    return tables


def _tbt_cells(t: dict) -> list[str]:
    tbt = t.get("tbt_observed")
    if tbt is None:
        return ["-", "-"]
    return [_share(tbt["violations"], tbt["requests"]), _f(tbt["request_p99_ms"]["p99"])]


def _f(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.0f}"


def _share(k: int, n: int) -> str:
    return f"{k} ({k / n:.1%})" if n else "0"


def _intro(summary: dict) -> str:
    hours = summary["span_s"] / 3600
    return (
        f"{summary['requests']:,} requests over {hours:.2f} h; {summary['workers']} engine(s); "
        f"prefill predictor a, b, c = {', '.join(f'{c:.3g}' for c in summary['predictor'])}."
    )


def _markdown(title: str, tables, summary: dict) -> str:
    lines = [f"# {title}", "", _intro(summary), ""]
    for name, header, rows in tables:
        lines += [f"## {name}", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(header)]  # fmt: skip
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    lines += [f"![{p}]({p})" for p in PLOTS]
    return "\n".join(lines) + "\n"


def _html(title: str, tables, summary: dict) -> str:
    e = html.escape
    parts = [f"<!doctype html><meta charset=utf-8><title>{e(title)}</title>",
             "<style>body{font-family:sans-serif;max-width:60em;margin:auto}"
             "td,th{border:1px solid #ccc;padding:2px 6px}table{border-collapse:collapse}</style>",
             f"<h1>{e(title)}</h1><p>{e(_intro(summary))}</p>"]  # fmt: skip
    for name, header, rows in tables:
        parts.append(f"<h2>{e(name)}</h2><table><tr>")
        parts += [f"<th>{e(h)}</th>" for h in header]
        parts.append("</tr>")
        for row in rows:
            parts.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>")
        parts.append("</table>")
    parts += [f'<p><img src="{p}" alt="{p}"></p>' for p in PLOTS]
    return "\n".join(parts) + "\n"


def _plot_lengths(audit: Audit, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, **_FIG)
    for name, s in audit.stats.items():
        if not s.n:
            continue
        for ax, counts in ((axes[0], s.prompt), (axes[1], s.output)):
            values = sorted(counts)
            total, seen, ys = sum(counts.values()), 0, []
            for v in values:
                seen += counts[v]
                ys.append(seen / total)
            ax.step([max(v, 1) for v in values], ys, where="post", label=name)
    for ax, what in zip(axes, ("prompt tokens", "output tokens"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel(what)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _binned(audit: Audit) -> tuple[list[float], dict[str, list[int]], float]:
    """Arrivals per bin per tier; bins of a minute, or coarser to keep ~200 points."""
    minutes = 1 + max((m for m, _ in audit.per_minute), default=0)
    per_bin = max(1, math.ceil(minutes / 200))
    bins = math.ceil(minutes / per_bin)
    series = {name: [0] * bins for name in audit.stats}
    for (m, tier), n in audit.per_minute.items():
        series[tier][m // per_bin] += n
    xs = [i * per_bin * MINUTE_S / 3600 for i in range(bins)]
    return xs, series, per_bin * MINUTE_S


def _plot_arrivals(audit: Audit, path: Path, *, share: bool) -> None:
    xs, series, bin_s = _binned(audit)
    fig, ax = plt.subplots(**_FIG)
    names = [n for n in series if audit.stats[n].n]
    if share:
        totals = [sum(series[n][i] for n in names) or 1 for i in range(len(xs))]
        ax.stackplot(xs, *[[v / t for v, t in zip(series[n], totals, strict=True)]
                           for n in names], labels=names)  # fmt: skip
        ax.set_ylabel("tier share")
    else:
        for n in names:
            ax.plot(xs, [v / bin_s for v in series[n]], label=n, lw=1)
        ax.set_ylabel("arrivals / s")
    ax.set_xlabel(f"hours from the first arrival (bins of {bin_s:g} s)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_hol(summary: dict, path: Path) -> None:
    tiers = summary["tiers"]
    names = list(tiers)
    fig, ax = plt.subplots(**_FIG)
    width = 0.27
    for i, (label, get) in enumerate((
        ("HOL exposures (FIFO)", lambda t: t["hol_exposures"]),
        ("violations FIFO", lambda t: t["violations"]["fifo"]),
        ("violations flowprefill (est.)", lambda t: t["violations"]["flowprefill"]),
    )):  # fmt: skip
        ax.bar([j + (i - 1) * width for j in range(len(names))],
               [get(tiers[n]) for n in names], width, label=label)  # fmt: skip
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("requests")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
