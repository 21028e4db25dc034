"""The top tier's TTFT against what preemption promises it, at each sustained point.

A critical request that arrives while another request's prefill runs waits for that prefill's
next interruption point (at most the preemption budget), and for at most one decode step
slotted in for critical rows; then its own prefill runs. Its TTFT is then bounded by its
isolated TTFT + the budget + one decode step. Over a run: the tier's TTFT p95 against its
isolated TTFT p95 (the prompt at the 95th percentile of its lengths, alone on an idle engine)
+ the budget + the run's median decode step. What else a request can wait for shows here as the
excess: another critical request ahead of it (counted apart, "behind own tier"), a machine
slower than when the isolated TTFT was measured (CPU steal is in the sustained tables).

The isolated TTFT is measured before the run, prompts back to back on a warm engine. Next to
the bound stands the run's own: the TTFT p95 of the tier's requests that had the engines to
themselves from arrival to first token ("alone in the run"). On the development machine it
has been up to 3x the one measured before: after an idle gap the caches are cold (a short
prefill after 3 s of idle took 1.3-1.4x as long, and a CPU kept spinning meanwhile did not
help: docs/results.md, "A lone request after an idle gap"). It explains an excess, it does not
move the bound.

The budget is flowprefill's (``EngineConfig.preempt_budget_ms``, the bench's engines'); the
baselines, which stop elsewhere (chunked at chunk ends) or drop state (recompute), are set
against the same bound, with their own decode step, for comparison. The p99 is reported with
it, never judged: over ~100 requests a point it is the worst one or two.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from bench.tables import print_table

COLUMNS = ("seed", "x", "policy", "p95 ms", "p99 ms", "isolated p95 + budget + step ms",
           "p95 within", "alone in the run: p95 ms (n)", "misses (own tier)")  # fmt: skip


def rows(result: dict) -> list[dict]:
    """Per point and policy: the top tier's TTFT p95 and p99, the bound and its parts. Points
    from runs that did not measure them (older JSON) are left out."""
    out = []
    budget = result.get("budget_ms")
    for point in result["points"]:
        isolated = point.get("isolated_p95_ms") or {}
        for name, p in point["policies"].items():
            tier_name, top = next(iter(p["tiers"].items()))
            ttft, step = top.get("ttft_ms"), p.get("decode_step_ms")
            if budget is None or ttft is None or step is None or tier_name not in isolated:
                continue
            bound = isolated[tier_name] + budget + step
            out.append({
                "seed": point["seed"], "factor": point["factor"], "policy": name,
                "tier": tier_name, "p95_ms": ttft["p95"], "p99_ms": ttft["p99"],
                "isolated_p95_ms": isolated[tier_name], "budget_ms": budget, "step_ms": step,
                "bound_ms": bound, "within": ttft["p95"] <= bound,
                "misses": top["n"] - top["met"],
                "behind_own_tier": top.get("misses_behind_own_tier"),
                "alone": top.get("alone_ttft_ms"),  # None: a run from before it was measured
            })  # fmt: skip
    return out


def _cells(row: dict) -> tuple[str, ...]:
    behind = "-" if row["behind_own_tier"] is None else str(row["behind_own_tier"])
    return (
        str(row["seed"]), f"{row['factor']:g}", row["policy"], f"{row['p95_ms']:.0f}",
        f"{row['p99_ms']:.0f}",
        f"{row['isolated_p95_ms']:.0f} + {row['budget_ms']:.0f} + {row['step_ms']:.0f} = "
        f"{row['bound_ms']:.0f}",
        "yes" if row["within"] else f"no (+{row['p95_ms'] - row['bound_ms']:.0f})",
        _alone(row["alone"]),
        f"{row['misses']} ({behind})",
    )  # fmt: skip


def _alone(alone: dict | None) -> str:
    if alone is None:
        return "-"
    return "- (0)" if not alone["n"] else f"{alone['p95']:.0f} ({alone['n']})"


def render(result: dict, console: Console) -> None:
    found = rows(result)
    if not found:
        return
    table = Table(title=f"{found[0]['tier']} TTFT p95 against isolated p95 + budget + one step")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "policy" else "right")
    for row in found:
        table.add_row(*_cells(row))
    print_table(console, table)


def markdown(result: dict) -> list[str]:
    found = rows(result)
    if not found:
        return []
    lines = [f"**{found[0]['tier']} TTFT p95 against its isolated p95 + the preemption budget + "
             "one decode step** (the run's median step; misses behind another request of the "
             "tier in brackets)", "",
             "| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]  # fmt: skip
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in found]
    return lines
