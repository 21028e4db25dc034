"""`tierflow audit`: is tiered scheduling worth deploying on this traffic? One streaming pass.

Memory is bounded whatever the length of the source: per tier, lengths (and TTFTs, in ms) are
kept as value -> count tables (at most as many entries as distinct values, so exact
percentiles), arrivals as counts per minute, inter-arrival gaps as a running mean and variance,
and the two queue simulations hold one entry per worker.

Head-of-line blocking, with the calibrated prefill-time predictor
(``queue_service.scheduler.predictor``) and ``workers`` engines, prefill only:

* **FIFO**: requests start in arrival order on the first free engine. An *exposure* is a request
  that arrives while every engine is busy and one of them runs a prefill of a less important
  tier that is longer than the arriving tier's SLO: under FIFO it waits behind it.
* **flowprefill** (estimated): a running prefill is preempted at a layer boundary, so a tier
  only waits for work of its own tier and more important ones (plus ``switch_s``): each tier is
  simulated as FIFO over the tiers at or above it. This is optimistic for middle tiers (a later
  more important arrival also preempts them), exact for the top tier up to the switch time.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from ops.records import LogRecord
from queue_service.scheduler.predictor import PrefillTimePredictor
from tierflow.tiers import TierTable

MINUTE_S = 60.0


def counter_percentile(counts: Counter, q: float) -> float:
    """The q-th percentile (0-100, nearest rank) of the values a value -> count table holds."""
    n = sum(counts.values())
    if n == 0:
        return float("nan")
    rank = max(1, math.ceil(q / 100 * n))
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return float(value)
    return float(max(counts))


@dataclass
class Welford:
    """Running mean and variance."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else float("nan")


@dataclass
class TierStats:
    n: int = 0
    prompt: Counter = field(default_factory=Counter)
    output: Counter = field(default_factory=Counter)
    ttft_ms: Counter = field(default_factory=Counter)  # observed (request-log sources)
    statuses: Counter = field(default_factory=Counter)
    gaps: Welford = field(default_factory=Welford)
    last_arrival: float | None = None
    exposures: int = 0  # FIFO head-of-line blocking exposures
    fifo_violations: int = 0
    flow_violations: int = 0
    observed_violations: int = 0
    tbt_p99_ms: Counter = field(default_factory=Counter)  # observed: each request's gaps' p99
    tbt_violations: int = 0  # observed (queue_service.core.finished.tbt_missed)
    flow_ttft_ms: Counter = field(default_factory=Counter)
    fifo_ttft_ms: Counter = field(default_factory=Counter)


class FifoEngines:
    """``workers`` engines taking prefills in arrival order."""

    def __init__(self, workers: int) -> None:
        # (free at, rank of what runs, predicted length of what runs) per engine
        self.engines = [(0.0, -1, 0.0) for _ in range(workers)]

    def admit(self, at: float, rank: int, prefill_s: float) -> tuple[float, bool, float]:
        """Start the request; returns (TTFT, blocked by a longer lower-tier prefill, the
        lower-tier prefill's length)."""
        free_at, _, _ = self.engines[0]
        blocker = max(
            (length for end, r, length in self.engines if end > at and r > rank), default=0.0
        )
        all_busy = free_at > at
        start = max(at, free_at)
        heapq.heapreplace(self.engines, (start + prefill_s, rank, prefill_s))
        return start + prefill_s - at, all_busy and blocker > 0, blocker


class Audit:
    def __init__(
        self,
        tiers: TierTable,
        predictor: PrefillTimePredictor,
        *,
        workers: int = 1,
        switch_s: float = 0.05,
    ) -> None:
        self.tiers = tiers
        self.predictor = predictor
        self.switch_s = switch_s
        self.workers = workers
        self.rank = {t.name: t.rank for t in tiers}
        self.slo = {t.name: t.ttft_slo_s for t in tiers}
        self.stats = {t.name: TierStats() for t in tiers}
        self.per_minute: Counter = Counter()  # (minute index, tier) -> arrivals
        self.first_arrival: float | None = None
        self.last_arrival: float | None = None
        self.unknown_tiers: Counter = Counter()
        self.out_of_order = 0
        self.fifo = FifoEngines(workers)
        self.flow = {t.name: FifoEngines(workers) for t in tiers}

    def add_all(self, records: Iterable[LogRecord]) -> Audit:
        for record in records:
            self.add(record)
        return self

    def add(self, r: LogRecord) -> None:
        stats = self.stats.get(r.tier)
        if stats is None:
            self.unknown_tiers[r.tier] += 1
            return
        self._count(r, stats)
        if self.last_arrival is not None and r.arrival_s < self.last_arrival:
            self.out_of_order += 1  # simulated at the latest time seen: order is kept
        at = max(r.arrival_s, self.last_arrival or r.arrival_s)
        self.first_arrival = at if self.first_arrival is None else self.first_arrival
        self.last_arrival = at
        self.per_minute[(int((at - self.first_arrival) // MINUTE_S), r.tier)] += 1
        self._simulate(r, stats, at)

    def _count(self, r: LogRecord, stats: TierStats) -> None:
        stats.n += 1
        stats.prompt[r.prompt_tokens] += 1
        stats.output[r.output_tokens] += 1
        stats.statuses[r.status] += 1
        if r.ttft_s is not None:
            stats.ttft_ms[round(r.ttft_s * 1000)] += 1
            slo = r.slo_s if r.slo_s is not None else self.slo[r.tier]
            stats.observed_violations += r.ttft_s > slo
        if r.tbt_p99_s is not None:
            stats.tbt_p99_ms[round(r.tbt_p99_s * 1000)] += 1
            stats.tbt_violations += r.tbt_violated
        if stats.last_arrival is not None:
            stats.gaps.add(max(0.0, r.arrival_s - stats.last_arrival))
        stats.last_arrival = r.arrival_s

    def _simulate(self, r: LogRecord, stats: TierStats, at: float) -> None:
        prefill = self.predictor.predict(r.prompt_tokens)
        rank, slo = self.rank[r.tier], self.slo[r.tier]
        ttft, blocked, blocker = self.fifo.admit(at, rank, prefill)
        stats.exposures += blocked and blocker > slo
        stats.fifo_violations += ttft > slo
        stats.fifo_ttft_ms[round(ttft * 1000)] += 1
        flow_ttft = None
        for name, engines in self.flow.items():
            if self.rank[name] >= rank:  # the tiers this request outranks or equals
                t, _, _ = engines.admit(at, rank, prefill)
                flow_ttft = t + self.switch_s if name == r.tier else flow_ttft
        assert flow_ttft is not None
        stats.flow_violations += flow_ttft > slo
        stats.flow_ttft_ms[round(flow_ttft * 1000)] += 1

    # ------------------------------------------------------------------------ summary

    def summary(self, kv_bytes_per_token: int) -> dict:
        span = (self.last_arrival or 0.0) - (self.first_arrival or 0.0)
        tiers = {name: self._tier_summary(name, s, span) for name, s in self.stats.items() if s.n}
        return {
            "requests": sum(s.n for s in self.stats.values()),
            "span_s": span,
            "workers": self.workers,
            "predictor": list(self.predictor.coefficients),
            "switch_s": self.switch_s,
            "unknown_tiers": dict(self.unknown_tiers),
            "out_of_order": self.out_of_order,
            "tiers": tiers,
            "recommended": self._recommend(kv_bytes_per_token),
        }

    def _tier_summary(self, name: str, s: TierStats, span: float) -> dict:
        pct = {f"p{q}": q for q in (50, 90, 99)}
        minutes = [self.per_minute.get((m, name), 0) for m in range(int(span // MINUTE_S) + 1)]
        mean_rate = sum(minutes) / len(minutes)
        return {
            "n": s.n,
            "slo_s": self.slo[name],
            "statuses": dict(s.statuses),
            "prompt_tokens": {k: counter_percentile(s.prompt, q) for k, q in pct.items()}
            | {"max": max(s.prompt)},
            "output_tokens": {k: counter_percentile(s.output, q) for k, q in pct.items()}
            | {"max": max(s.output)},
            "rate_per_s": s.n / span if span > 0 else float("nan"),
            # 1 for Poisson arrivals; above 1, burstier.
            "interarrival_cv": s.gaps.std / s.gaps.mean if s.gaps.mean > 0 else float("nan"),
            "peak_to_mean_per_minute": max(minutes) / mean_rate if mean_rate else float("nan"),
            "hol_exposures": s.exposures,
            "violations": {
                "fifo": s.fifo_violations,
                "flowprefill": s.flow_violations,
                **({"observed": s.observed_violations} if s.ttft_ms else {}),
            },
            "ttft_ms": {
                "fifo": {k: counter_percentile(s.fifo_ttft_ms, q) for k, q in pct.items()},
                "flowprefill": {k: counter_percentile(s.flow_ttft_ms, q) for k, q in pct.items()},
                **(
                    {"observed": {k: counter_percentile(s.ttft_ms, q) for k, q in pct.items()}}
                    if s.ttft_ms
                    else {}
                ),
            },
            **(
                {
                    "tbt_observed": {
                        "violations": s.tbt_violations,
                        "requests": s.tbt_p99_ms.total(),
                        "request_p99_ms": {
                            k: counter_percentile(s.tbt_p99_ms, q) for k, q in pct.items()
                        },
                    }
                }
                if s.tbt_p99_ms
                else {}
            ),
        }

    def _recommend(self, kv_bytes_per_token: int) -> dict:
        achievable = {
            name: _round_up(counter_percentile(s.flow_ttft_ms, 99) / 1000)
            for name, s in self.stats.items()
            if s.n
        }
        everything = sum((s.prompt for s in self.stats.values()), Counter())
        p90 = counter_percentile(everything, 90) if everything else 512
        chunk = min(4096, max(512, 1 << max(0, math.ceil(math.log2(max(p90, 1))))))
        top = self.tiers.names[0]
        lower = sum((s.prompt for n, s in self.stats.items() if n != top), Counter())
        p99_lower = counter_percentile(lower, 99) if lower else 0.0
        # A suspended prefill per tier below the top one, each as long as a p99 prompt, + 25%.
        stacked = max(1, len(self.tiers.names) - 1) * self.workers
        cap = int(stacked * p99_lower * kv_bytes_per_token * 1.25)
        return {
            "ttft_slo_s": achievable,
            "chunk_size": chunk,
            "memory_cap_bytes": cap,
            "why": {
                "ttft_slo_s": "p99 of the estimated flowprefill TTFT per tier, rounded up",
                "chunk_size": f"power of two >= p90 prompt ({p90:.0f} tokens), in [512, 4096]: "
                "layer-boundary preemption bounds the wait, so chunks only need to be efficient",
                "memory_cap_bytes": f"{stacked} suspended prefill(s) of the p99 lower-tier prompt "
                f"({p99_lower:.0f} tokens) x {kv_bytes_per_token} KV bytes/token, +25%",
            },
        }


def _round_up(seconds: float) -> float:
    """Up to two significant digits (0.2345 -> 0.24)."""
    if not seconds > 0 or math.isnan(seconds):
        return seconds
    scale = 10 ** (math.floor(math.log10(seconds)) - 1)
    return round(math.ceil(seconds / scale - 1e-9) * scale, 10)
