"""Turning a run's request records into the numbers the policy benchmark reports."""

from __future__ import annotations

import bisect

from scipy.stats import binomtest, ttest_1samp

from bench.harness import RunResult
from tierflow.tiers import TierTable


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarise(result: RunResult, tiers: TierTable, starvation_s: float | None = None) -> dict:
    """The per-policy block of the benchmark JSON (docs/results.md, "The benchmark commands").
    ``starvation_s``: the scheduler's aging threshold, to count the requests that reached it
    (when the caller knows it; the count is None otherwise)."""
    records = list(result.records.values())
    wall = result.makespan_s
    per_tier = {
        tier.name: _tier_summary(tier, mine, records, wall, starvation_s)
        for tier in tiers
        if (mine := [r for r in records if r.arrival.tier == tier.name])
    }
    completed = [r for r in records if r.done_at is not None and r.failed is None]
    tokens = sum(r.arrival.prompt_tokens for r in completed)
    latencies = [s * 1000 for s in result.preemption_latencies_s]
    top = min(tiers, key=lambda t: t.rank).name
    lower = [r for r in records if r.arrival.tier != top and r.rejected is None]
    steps = result.decode_steps
    return {
        # Completed tokens (prompt + output) per wall-clock second of the whole run.
        "completed_tok_s": _completed_tokens(records) / wall if wall else 0.0,
        "output_tok_s": _output_tokens(completed) / wall if wall else 0.0,
        "decode": {  # batched workers: steps, their mean rows, those slotted into a prefill
            "steps": steps,
            "mean_rows": result.decode_rows / steps if steps else 0.0,
            "slotted_steps": result.slotted_steps,
            # One decode step's time (the median; the share of one in a critical request's
            # wait: bench.ttft_bound).
            "step_ms_p50": percentile(result.decode_step_s, 50) * 1000 if steps else None,
        },
        "packs": result.counters.get("packs", 0),
        "packed_requests": result.counters.get("packed_requests", 0),
        "decode_pauses": result.counters.get("decode_pauses", 0),
        "decode_drops": result.counters.get("decode_drops", 0),
        "lower_tier_completed_tok_s": _completed_tokens(lower) / wall if wall else 0.0,
        "prediction_error": result.prediction_errors,
        "scheduler": {
            "events": result.events,
            "progress_events": result.progress_events,
            "decide_us_per_event": result.decide_s / result.events * 1e6 if result.events else 0,
        },
        "throughput_tok_s": tokens / result.busy_s if result.busy_s else 0.0,
        "busy_fraction": result.busy_s / result.makespan_s if result.makespan_s else 0.0,
        "makespan_s": result.makespan_s,
        "cpu_steal": result.cpu_steal,
        "preemptions": sum(r.preemptions for r in records),
        "recomputes": sum(r.recomputes for r in records),
        "preemption_latency_ms": {
            "p50": percentile(latencies, 50),
            "p99": percentile(latencies, 99),
        },
        "lost": sum(r.done_at is None and r.rejected is None for r in records),
        "tiers": per_tier,
    }


def _tier_summary(tier, mine, records, wall: float, starvation_s: float | None) -> dict:
    """One tier's block: ``mine`` its requests among the run's ``records``."""
    accepted = [r for r in mine if r.rejected is None]
    ttfts = [r.ttft_s * 1000 for r in accepted if r.ttft_s is not None]
    slo_ms = tier.ttft_slo_s * 1000
    met = sum(t <= slo_ms for t in ttfts)
    return {
        "n": len(mine),
        "completed": sum(r.done_at is not None and r.failed is None for r in accepted),
        "rejected": len(mine) - len(accepted),
        "failed": sum(r.failed is not None for r in accepted),
        "slo_ms": slo_ms,
        # Over accepted requests: a rejected batch request has no TTFT to judge.
        "slo_attainment": met / len(accepted) if accepted else float("nan"),
        "slo_violations": len(accepted) - met,
        "ttft_ms": {
            q: percentile(ttfts, p) for q, p in (("p50", 50), ("p90", 90), ("p95", 95), ("p99", 99))
        },
        "preemptions": sum(r.preemptions for r in mine),
        "misses_behind_own_tier": _misses_behind_own_tier(accepted, slo_ms / 1000),
        # What the machine gave a request with nothing else on it, during this run.
        "alone_ttft_ms": _quantiles(alone_ttfts_ms(accepted, records)),
        # Waited the aging threshold before their first token: from then on the scheduler
        # put them first in line and no longer preempted them.
        "aged": None if starvation_s is None else sum(t >= starvation_s * 1000 for t in ttfts),
        "completed_tok_s": _completed_tokens(accepted) / wall if wall else 0.0,
        "ttft_samples_ms": sorted(ttfts),
        **_tbt(accepted, tier.tbt_slo_s),
    }


def alone_ttfts_ms(mine, records) -> list[float]:
    """TTFTs of the requests of ``mine`` that had the engines to themselves from arrival to
    first token: no other accepted request of ``records`` was live (arrived, not yet done) at
    any moment of it. The run's own isolated TTFT: on a shared machine whose speed drifts, and
    whose caches go cold while the engine idles, it can differ from the one measured before."""
    live = [r for r in records if r.rejected is None and r.arrived_at]
    starts = sorted(r.arrived_at for r in live)
    ends = sorted(r.done_at if r.done_at is not None else float("inf") for r in live)
    alone = []
    for r in mine:
        if r.first_token_at is None:
            continue
        # Live intervals that overlap [arrived, first token]: all that start before its end,
        # but those that ended by its start; the request itself is one of them.
        overlapping = bisect.bisect_left(starts, r.first_token_at) - bisect.bisect_right(
            ends, r.arrived_at
        )
        if overlapping <= 1:
            alone.append(r.ttft_s * 1000)
    return alone


def _quantiles(values: list[float]) -> dict:
    return {"n": len(values), "p50": percentile(values, 50), "p95": percentile(values, 95)}


def _misses_behind_own_tier(records, slo_s: float) -> int:
    """SLO misses during whose wait another request of the same tier got its first token:
    the tier's own load made them late (more of the tier than the machine can serve at once),
    not lower-tier work that preemption should have cleared."""
    firsts = sorted(r.first_token_at for r in records if r.first_token_at is not None)
    behind = 0
    for r in records:
        ttft = r.ttft_s
        if ttft is not None and ttft <= slo_s:
            continue
        end = r.first_token_at if r.first_token_at is not None else float("inf")
        i = bisect.bisect_right(firsts, r.arrived_at)
        behind += i < len(firsts) and firsts[i] < end
    return behind


def _tbt(records, target_s: float | None) -> dict:
    """Times between consecutive tokens of the tier's requests, pooled: p50 / p99, and the
    share within the tier's TBT target (NaN without a target or a second token)."""
    gaps = [g * 1000 for r in records for g in r.tbt_s]
    within = float("nan")
    if gaps and target_s:
        within = sum(g <= target_s * 1000 for g in gaps) / len(gaps)
    return {
        "tbt_ms": {"p50": percentile(gaps, 50), "p99": percentile(gaps, 99)},
        "tbt_slo_ms": target_s * 1000 if target_s else None,
        "tbt_attainment": within,
        "output_tokens": _output_tokens(r for r in records if r.done_at is not None),
    }


def _output_tokens(records) -> int:
    """Tokens the requests streamed (each once)."""
    return sum(len(r.token_times) for r in records if r.failed is None)


def _completed_tokens(records) -> int:
    done = [r for r in records if r.done_at is not None and r.failed is None]
    return sum(r.arrival.prompt_tokens for r in done) + _output_tokens(done)


def wilson_interval(successes: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a rate (sound near 0 and 1, unlike the normal one)."""
    if n == 0:
        return (float("nan"), float("nan"))
    ci = binomtest(successes, n).proportion_ci(confidence_level=0.95, method="wilson")
    return (float(ci.low), float(ci.high))


def mean_interval(samples: list[float]) -> tuple[float, float]:
    """95% t interval of a mean (n >= 2)."""
    if min(samples) == max(samples):
        return (samples[0], samples[0])  # no spread (a policy against itself)
    ci = ttest_1samp(samples, 0.0).confidence_interval(confidence_level=0.95)
    return (float(ci.low), float(ci.high))
