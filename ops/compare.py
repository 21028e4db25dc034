"""`tierflow compare`: the old deployment against the canary, from the request log, with a
verdict that never passes on noise or on an unfair split.

Per deployment, first its **load**: requests and prompt tokens per worker-second over the
window (and the engines' busy fraction when the caller has it from the workers' metrics). Then
per tier and deployment: n, TTFT SLO violations, attainment with its 95% Wilson interval
(``scipy.stats.binomtest``), TTFT p50/p99, TBT violations and the p99 of the requests' TBT p99
(``queue_service.core.finished.tbt_missed``), and completed tokens per worker-second.

The verdict (``Criteria``; by default the rollout rule: at least 50% fewer top-tier violations
and under 5% lower-tier throughput loss) is given in this order:

* **fairness.** A canary that carried less load per worker wins for the wrong reason. When the
  sides' requests or prompt tokens per worker-second differ by more than ``max_load_gap`` (new
  over old), the verdict is "unfair comparison", with the figures, and nothing else is judged.
* **enough data.** Each side needs ``min_n`` top-tier requests.
* **violations.** The canary's top-tier violation rate must be at most ``(1 - reduction)`` times
  the old one. PASS when the canary's upper bound is below that share of the old lower bound;
  FAIL when the canary's lower bound is above that share of the old upper bound; else unsure.
* **lower-tier throughput.** Completed lower-tier tokens per worker-second, over what the side
  was offered per worker-second (the split of random arrivals alone moves the raw figure by
  several percent at a canary's n; the fairness check already holds the offered loads close).
  The loss ``1 - canary / old`` must stay under ``max_lower_tier_loss``, judged on 95%
  bootstrap intervals (``scipy.stats.bootstrap``, resampling requests) as the violations are.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from scipy.stats import binomtest, bootstrap

from ops.records import LogRecord

PASS, FAIL, UNSURE, UNFAIR = "PASS", "FAIL", "not enough data", "unfair comparison"


@dataclass(frozen=True)
class Criteria:
    min_violation_reduction: float = 0.5
    max_lower_tier_loss: float = 0.05
    min_n: int = 30  # top-tier requests per deployment before any verdict
    confidence: float = 0.95
    # Fairness: the load per worker of the two sides may differ by this share (new over old).
    # A 50/50 split of random arrivals alone moves a side's prompt tokens by about 10% (two
    # standard deviations) at a canary's n, when long prompts are a few percent of requests.
    max_load_gap: float = 0.25


@dataclass
class _Group:
    n: int = 0
    violations: int = 0
    tbt_violations: int = 0
    done: int = 0
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tbt_p99_s: list[float] = field(default_factory=list)
    # Per request: (tokens completed, tokens offered), for the lower-tier throughput check.
    completed: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _Side:
    requests: int = 0
    prompt_tokens: int = 0
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


def worker_counts(
    records: Iterable[LogRecord], deployments: Iterable[str], given: dict[str, int] | None = None
) -> dict[str, int]:
    """Each deployment's workers: ``given``, else those its records name (at least one)."""
    seen: dict[str, set[str]] = defaultdict(set)
    for r in records:
        if r.worker_id:
            seen[r.deployment].add(r.worker_id)
    return {d: (given or {}).get(d) or max(1, len(seen[d])) for d in deployments}


def compare(
    records: Iterable[LogRecord],
    *,
    tiers: list[str],
    slos: dict[str, float],
    old: str = "primary",
    new: str = "canary",
    criteria: Criteria = Criteria(),
    workers: dict[str, int] | None = None,
    busy: dict[str, float] | None = None,
) -> dict:
    """``tiers``: most important first. Cancelled requests (the client left) are left out.
    ``workers``: each deployment's worker count (default: the workers its records name);
    ``busy``: each deployment's mean engine busy fraction, when known (shown, not judged)."""
    groups: dict[tuple[str, str], _Group] = defaultdict(_Group)
    sides = {old: _Side(), new: _Side()}
    first, last = math.inf, -math.inf
    for r in records:
        if r.status == "cancelled" or r.deployment not in sides:
            continue
        _add(groups[(r.deployment, r.tier)], sides[r.deployment], r, slos)
        first = min(first, r.arrival_s)
        last = max(last, r.finished_s or r.arrival_s)
    window = max(last - first, 1e-9) if math.isfinite(first) else 0.0
    counts = {dep: (workers or {}).get(dep) or max(1, len(s.workers)) for dep, s in sides.items()}
    load = {dep: _load(s, counts[dep], window, (busy or {}).get(dep)) for dep, s in sides.items()}
    table = {
        dep: {tier: _row(groups[(dep, tier)], window * counts[dep], criteria) for tier in tiers}
        for dep in (old, new)
    }
    lower = {dep: [c for t in tiers[1:] for c in groups[(dep, t)].completed] for dep in sides}
    verdict = _verdict(table, load, lower, tiers, old, new, criteria)
    return {"old": old, "new": new, "window_s": window, "load": load, "tiers": table, **verdict}


def _add(g: _Group, side: _Side, r: LogRecord, slos: dict[str, float]) -> None:
    g.n += 1
    g.violations += violated(r, slos)
    g.tbt_violations += r.tbt_violated
    side.requests += 1
    side.prompt_tokens += r.prompt_tokens
    if r.worker_id:
        side.workers.add(r.worker_id)
    done_tokens = r.prompt_tokens + r.output_tokens if r.status == "done" else 0
    g.completed.append((done_tokens, r.prompt_tokens + max(r.output_tokens, 1)))
    if r.status != "done":
        return
    g.done += 1
    g.tokens += done_tokens
    if r.ttft_s is not None:
        g.ttft_s.append(r.ttft_s)
    if r.tbt_p99_s is not None:
        g.tbt_p99_s.append(r.tbt_p99_s)


def _load(side: _Side, workers: int, window_s: float, busy: float | None) -> dict:
    worker_s = workers * window_s
    return {
        "workers": workers,
        "requests_per_worker_s": side.requests / worker_s if worker_s else 0.0,
        "prompt_tokens_per_worker_s": side.prompt_tokens / worker_s if worker_s else 0.0,
        "busy_fraction": busy,
    }


def _row(g: _Group, worker_s: float, criteria: Criteria) -> dict:
    low, high = wilson(g.n - g.violations, g.n, criteria.confidence)
    return {
        "n": g.n,
        "violations": g.violations,
        "attainment": (g.n - g.violations) / g.n if g.n else float("nan"),
        "attainment_ci": [low, high],
        "done": g.done,
        "ttft_ms": {f"p{q}": _percentile(g.ttft_s, q) * 1000 for q in (50, 99)},
        "tbt_violations": g.tbt_violations,
        "tbt_p99_ms": _percentile(g.tbt_p99_s, 99) * 1000,
        "tokens_per_worker_s": g.tokens / worker_s if worker_s else 0.0,
    }


def _verdict(table, load, lower, tiers, old: str, new: str, criteria: Criteria) -> dict:
    unfair = _fairness(load, old, new, criteria)
    if unfair:
        return {"verdict": UNFAIR, "checks": {"fairness": UNFAIR}, "why": unfair}
    top = tiers[0]
    o, c = table[old][top], table[new][top]
    if min(o["n"], c["n"]) < criteria.min_n:
        why = f"{top}: {o['n']} ({old}) and {c['n']} ({new}) requests, fewer than {criteria.min_n}"
        return {"verdict": UNSURE, "checks": {"fairness": PASS, "violations": UNSURE}, "why": [why]}
    why: list[str] = []
    checks = {
        "fairness": PASS,
        "violations": _violation_check(o, c, top, old, new, criteria, why),
        "lower_tier_throughput": _lower_tier_check(lower[old], lower[new], old, new, criteria, why),
    }
    if FAIL in checks.values():
        verdict = FAIL
    elif all(v == PASS for v in checks.values()):
        verdict = PASS
    else:
        verdict = UNSURE
    return {"verdict": verdict, "checks": checks, "why": why}


def _fairness(load: dict, old: str, new: str, criteria: Criteria) -> list[str]:
    """The reasons the split is unfair; empty when it is fair."""
    reasons = []
    for key, what in (("requests_per_worker_s", "requests"), ("prompt_tokens_per_worker_s",
                                                                "prompt tokens")):  # fmt: skip
        o, n = load[old][key], load[new][key]
        ratio = n / o if o > 0 else math.inf
        if not abs(ratio - 1) <= criteria.max_load_gap:
            reasons.append(
                f"{what} per worker-second: {old} {o:.3g}, {new} {n:.3g} ({ratio:.2f}x); the "
                f"sides may differ by {criteria.max_load_gap:.0%} at most"
            )
    return reasons


def _violation_check(o: dict, c: dict, top: str, old: str, new: str, criteria, why) -> str:
    keep = 1 - criteria.min_violation_reduction
    o_rate = (1 - o["attainment_ci"][1], 1 - o["attainment_ci"][0])  # violation-rate interval
    c_rate = (1 - c["attainment_ci"][1], 1 - c["attainment_ci"][0])
    if c_rate[1] <= keep * o_rate[0]:
        result = PASS
    elif c_rate[0] > keep * o_rate[1]:
        result = FAIL
    else:
        result = UNSURE
    why.append(
        f"{top} violation rate: {old} [{o_rate[0]:.1%}, {o_rate[1]:.1%}], {new} "
        f"[{c_rate[0]:.1%}, {c_rate[1]:.1%}]; needs {new} <= {keep:.0%} of {old}: {result}"
    )
    return result


def completed_share_ci(pairs: list[tuple[int, int]], confidence: float) -> tuple[float, float]:
    """The interval of completed over offered tokens, resampling requests (seeded)."""
    done, offered = (np.array(col, dtype=float) for col in zip(*pairs, strict=True))
    if np.array_equal(done, offered) or not done.any():  # every resample gives the same share
        share = float(done.sum() / offered.sum())
        return share, share
    result = bootstrap(
        (done, offered), lambda d, o, axis: d.sum(axis) / o.sum(axis), paired=True,
        vectorized=True, confidence_level=confidence, method="percentile", n_resamples=2000,
        rng=np.random.default_rng(0),
    )  # fmt: skip
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def _lower_tier_check(old_pairs, new_pairs, old: str, new: str, criteria: Criteria, why) -> str:
    if not old_pairs or not new_pairs:
        why.append("lower tiers: no requests on one side")
        return UNSURE
    lo_o, hi_o = completed_share_ci(old_pairs, criteria.confidence)
    lo_c, hi_c = completed_share_ci(new_pairs, criteria.confidence)
    worst, best = 1 - lo_c / hi_o, 1 - hi_c / lo_o if lo_o > 0 else -math.inf
    if worst < criteria.max_lower_tier_loss:
        result = PASS
    elif best >= criteria.max_lower_tier_loss:
        result = FAIL
    else:
        result = UNSURE
    why.append(
        f"lower-tier tokens completed of those offered: {old} [{lo_o:.1%}, {hi_o:.1%}], {new} "
        f"[{lo_c:.1%}, {hi_c:.1%}]; loss between {max(best, -1):.1%} and {worst:.1%}, needs "
        f"< {criteria.max_lower_tier_loss:.0%}: {result}"
    )
    return result


def format_report(result: dict) -> str:
    """Markdown: the load per side, the table, then the verdict and why."""
    lines = [
        f"## {result['old']} vs {result['new']} over {result['window_s']:.0f} s",
        "",
        "| deployment | workers | requests/worker-s | prompt tokens/worker-s | busy |",
        "|---|---|---|---|---|",
    ]
    for dep, ld in result["load"].items():
        busy = "-" if ld["busy_fraction"] is None else f"{ld['busy_fraction']:.0%}"
        lines.append(
            f"| {dep} | {ld['workers']} | {ld['requests_per_worker_s']:.3f} | "
            f"{ld['prompt_tokens_per_worker_s']:.0f} | {busy} |"
        )
    lines += [
        "",
        "| tier | deployment | n | TTFT violations | attainment (95% CI) | TTFT p50 ms | "
        "TTFT p99 ms | TBT violations | TBT p99 ms | tokens/worker-s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dep, rows in result["tiers"].items():
        for tier, r in rows.items():
            lo, hi = r["attainment_ci"]
            att = "-" if not r["n"] else f"{r['attainment']:.1%} [{lo:.1%}, {hi:.1%}]"
            lines.append(
                f"| {tier} | {dep} | {r['n']} | {r['violations']} | {att} | "
                f"{_ms(r['ttft_ms']['p50'])} | {_ms(r['ttft_ms']['p99'])} | "
                f"{r['tbt_violations']} | {_ms(r['tbt_p99_ms'])} | "
                f"{r['tokens_per_worker_s']:.1f} |"
            )
    lines += ["", f"**Verdict: {result['verdict']}**", ""]
    lines += [f"- {w}" for w in result["why"]]
    return "\n".join(lines) + "\n"


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0f}"
