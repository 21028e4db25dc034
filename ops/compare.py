"""`tierflow compare`: the old deployment against the canary, from the request log, with a
verdict that never passes on noise.

Per tier and deployment: n, SLO violations, attainment with its 95% Wilson interval
(``scipy.stats.binomtest``), TTFT p50/p99, and throughput (completed tokens per second per
worker over the window). The verdict (``Criteria``, default the rollout rule: at least 50% fewer
top-tier violations, less than 5% throughput loss for the lower tiers):

* violations: the canary's top-tier violation rate must be at most ``(1 - reduction)`` times
  the old one. PASS when the canary's upper bound is below that share of the old lower bound;
  FAIL when the canary's lower bound is above that share of the old upper bound; else unsure.
* lower tiers: the share of lower-tier requests completed (done / all that ended), per
  deployment, so that a 10% canary is compared with the same load share, not with 90% of the
  traffic; the loss ``1 - canary / old`` must stay under ``max_loss``. PASS when the worst case
  (canary lower bound over old upper bound) is under it, FAIL when the best case is over it.
* "not enough data" when any side has fewer than ``min_n`` top-tier requests or an interval
  leaves the answer open.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from scipy.stats import binomtest

from ops.records import LogRecord

PASS, FAIL, UNSURE = "PASS", "FAIL", "not enough data"


@dataclass(frozen=True)
class Criteria:
    min_violation_reduction: float = 0.5
    max_lower_tier_loss: float = 0.05
    min_n: int = 30  # top-tier requests per deployment before any verdict
    confidence: float = 0.95


@dataclass
class _Group:
    n: int = 0
    violations: int = 0
    done: int = 0
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    workers: set[str] = field(default_factory=set)


def wilson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    ci = binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def violated(r: LogRecord, slos: dict[str, float]) -> bool:
    """Done over the SLO, or never served (shed, failed); as the service's metrics count."""
    slo = r.slo_s if r.slo_s is not None else slos.get(r.tier, math.inf)
    if r.status == "done":
        return r.ttft_s is not None and r.ttft_s > slo
    return r.status in ("shed", "failed")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def compare(
    records: Iterable[LogRecord],
    *,
    tiers: list[str],
    slos: dict[str, float],
    old: str = "primary",
    new: str = "canary",
    criteria: Criteria = Criteria(),
) -> dict:
    """``tiers``: most important first. Cancelled requests (the client left) are left out."""
    groups: dict[tuple[str, str], _Group] = defaultdict(_Group)
    first, last = math.inf, -math.inf
    for r in records:
        if r.status == "cancelled" or r.deployment not in (old, new):
            continue
        g = groups[(r.deployment, r.tier)]
        g.n += 1
        g.violations += violated(r, slos)
        if r.status == "done":
            g.done += 1
            g.tokens += r.prompt_tokens + r.output_tokens
            if r.ttft_s is not None:
                g.ttft_s.append(r.ttft_s)
        if r.worker_id:
            g.workers.add(r.worker_id)
        first = min(first, r.arrival_s)
        last = max(last, r.finished_s or r.arrival_s)
    window = max(last - first, 1e-9) if math.isfinite(first) else 0.0
    table = {
        dep: {tier: _row(groups[(dep, tier)], window, criteria) for tier in tiers}
        for dep in (old, new)
    }
    verdict = _verdict(table, tiers, old, new, criteria)
    return {"old": old, "new": new, "window_s": window, "tiers": table, **verdict}


def _row(g: _Group, window_s: float, criteria: Criteria) -> dict:
    low, high = wilson(g.n - g.violations, g.n, criteria.confidence)
    return {
        "n": g.n,
        "violations": g.violations,
        "attainment": (g.n - g.violations) / g.n if g.n else float("nan"),
        "attainment_ci": [low, high],
        "done": g.done,
        "ttft_ms": {f"p{q}": _percentile(g.ttft_s, q) * 1000 for q in (50, 99)},
        "tokens_per_s_per_worker": g.tokens / window_s / max(1, len(g.workers))
        if window_s
        else 0.0,
    }


def _verdict(table: dict, tiers: list[str], old: str, new: str, criteria: Criteria) -> dict:
    top, lower = tiers[0], tiers[1:]
    o, c = table[old][top], table[new][top]
    if min(o["n"], c["n"]) < criteria.min_n:
        why = f"{top}: {o['n']} ({old}) and {c['n']} ({new}) requests, fewer than {criteria.min_n}"
        return {"verdict": UNSURE, "checks": {"violations": UNSURE}, "why": [why]}
    keep = 1 - criteria.min_violation_reduction
    o_rate = (1 - o["attainment_ci"][1], 1 - o["attainment_ci"][0])  # violation-rate interval
    c_rate = (1 - c["attainment_ci"][1], 1 - c["attainment_ci"][0])
    if c_rate[1] <= keep * o_rate[0]:
        violations = PASS
    elif c_rate[0] > keep * o_rate[1]:
        violations = FAIL
    else:
        violations = UNSURE
    why = [
        f"{top} violation rate: {old} [{o_rate[0]:.1%}, {o_rate[1]:.1%}], {new} "
        f"[{c_rate[0]:.1%}, {c_rate[1]:.1%}]; needs {new} <= {keep:.0%} of {old}: {violations}"
    ]
    throughput = _lower_tier_check(table, lower, old, new, criteria, why)
    checks = {"violations": violations, "lower_tier_throughput": throughput}
    if FAIL in checks.values():
        verdict = FAIL
    elif all(v == PASS for v in checks.values()):
        verdict = PASS
    else:
        verdict = UNSURE
    return {"verdict": verdict, "checks": checks, "why": why}


def _lower_tier_check(table, lower, old, new, criteria: Criteria, why: list[str]) -> str:
    def completed(dep: str) -> tuple[int, int]:
        rows = [table[dep][t] for t in lower]
        return sum(r["done"] for r in rows), sum(r["n"] for r in rows)

    (k_o, n_o), (k_c, n_c) = completed(old), completed(new)
    if min(n_o, n_c) == 0:
        why.append("lower tiers: no requests on one side")
        return UNSURE
    lo_o, hi_o = wilson(k_o, n_o, criteria.confidence)
    lo_c, hi_c = wilson(k_c, n_c, criteria.confidence)
    worst, best = 1 - lo_c / hi_o, 1 - hi_c / lo_o if lo_o > 0 else -math.inf
    if worst < criteria.max_lower_tier_loss:
        result = PASS
    elif best >= criteria.max_lower_tier_loss:
        result = FAIL
    else:
        result = UNSURE
    why.append(
        f"lower tiers completed: {old} {k_o}/{n_o}, {new} {k_c}/{n_c}; loss between "
        f"{max(best, -1):.1%} and {worst:.1%}, needs < {criteria.max_lower_tier_loss:.0%}: {result}"
    )
    return result


def format_report(result: dict) -> str:
    """Markdown: the table, then the verdict and why."""
    lines = [
        f"## {result['old']} vs {result['new']} over {result['window_s']:.0f} s",
        "",
        "| tier | deployment | n | violations | attainment (95% CI) | TTFT p50 ms | "
        "TTFT p99 ms | tokens/s/worker |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dep, rows in result["tiers"].items():
        for tier, r in rows.items():
            lo, hi = r["attainment_ci"]
            att = "-" if not r["n"] else f"{r['attainment']:.1%} [{lo:.1%}, {hi:.1%}]"
            lines.append(
                f"| {tier} | {dep} | {r['n']} | {r['violations']} | {att} | "
                f"{_ms(r['ttft_ms']['p50'])} | {_ms(r['ttft_ms']['p99'])} | "
                f"{r['tokens_per_s_per_worker']:.1f} |"
            )
    lines += ["", f"**Verdict: {result['verdict']}**", ""]
    lines += [f"- {w}" for w in result["why"]]
    return "\n".join(lines) + "\n"


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0f}"
