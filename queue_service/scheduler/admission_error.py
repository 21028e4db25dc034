"""How late admission's predicted time to first token has come true, per judged tier and key.

Admission (``capacity.judge``) predicts a newcomer's TTFT from the prefill work committed ahead
of it and its own prefill, inflated by the prefill predictor's observed error. A request's TTFT
also holds what no prefill prediction counts: the decode steps the worker runs between
prefills and inside them, a running prefill of its own tier that it cannot preempt, the
requests fair order lets past it (another key's burst, up to that key's share), packs, and an
engine whose caches went cold. Measured on the flood (docs/results.md, "The flood at
f9d147c"): the TTFT of admitted critical requests exceeded the prediction by up to 145 ms at
p95, so 1 in 20 of them missed the 0.3 s SLO.

So the scheduler that owns a judged tier makes admission's prediction itself when a request
arrives (the same ``judge`` over its own load) and, at its first token, keeps how much later
it came: ``error = TTFT - predicted TTFT``. Admission adds a high quantile of those errors
(``error_s``) to its predictions, so a request admitted at the edge of the SLO meets it with
about that probability: admission promises the attainment asked of it (0.99) by measuring, not
by assuming where the time goes.

The errors are additive, in seconds, not relative: what they hold (a decode step, a prefill
ahead that could not be stopped, a cold cache) costs about the same before a 30 ms prediction
as before a 200 ms one. As a share of a short prediction they would be 2-4x, and a relative
margin at that level refused even a calm key's lone requests (tried: 24 of 200 at
``--flood``'s "calm alone").

The quantile depends on the key's standing. A key over its share of the tier's rate
(``fairness``) is judged at ``quantile`` (0.99): what is refused is its overflow, and what is
admitted must hold. A key within its share is judged at ``within_share_quantile`` (0.9): to it
a refusal is a sure miss of a request it was entitled to, while one admitted at the edge misses
with about one chance in ten, and most are admitted well inside the edge. Judged at the p99,
which for a key sending a few requests a second is about the worst of its last 200 errors, a
calm key under a flood had 12-23 of 200 requests refused, while every one it had admitted met
the SLO with 67 ms or more to spare (docs/results.md, "One key floods the critical tier").

They are kept per key too, because keys of one tier see different errors: fair order runs a
calm key's requests before the flood's, so the flood's requests wait for the calm key's later
arrivals and the calm key's do not. A key with fewer than ``key_min_samples`` measured requests
is judged on its tier's errors, and the tier on none before ``min_samples``. A key's own few
come first because the tier's errors are the busiest key's: under a flood the tier's error
reached its cap (150 ms) and a calm key judged on it for its first 20 requests had 20 of them
refused (docs/results.md, "One key floods the critical tier"). The error added is at most
``max_share_of_slo`` of the SLO, so that admission never closes a tier to every request: it
keeps admitting the shortest and keeps measuring.
"""

from __future__ import annotations

import numpy as np

from queue_service.scheduler.sliding_quantile import SlidingQuantile
from tierflow.recent import RecentMap


class _Errors:
    """A window of additive errors and its cached quantiles."""

    def __init__(self, window: int) -> None:
        self.samples = SlidingQuantile(window)
        self.cached: dict[float, float] = {}

    def add(self, error_s: float) -> None:
        self.samples.add(error_s)
        self.cached.clear()

    def quantile(self, q: float) -> float:
        if q not in self.cached:
            self.cached[q] = self.samples.quantile(q)
        return self.cached[q]


class AdmissionErrors:
    def __init__(
        self,
        slos: dict[str, float],
        *,
        quantile: float = 0.99,
        within_share_quantile: float = 0.9,
        window: int = 256,
        min_samples: int = 20,
        key_min_samples: int = 5,
        max_share_of_slo: float = 0.5,
        remember_keys: int = 10_000,
    ) -> None:
        """``slos``: the TTFT SLO of each tier that admission judges."""
        if not (0 < quantile < 1 and 0 < within_share_quantile < 1):
            raise ValueError("need quantiles in (0, 1)")
        if window < 1 or min(min_samples, key_min_samples) < 1:
            raise ValueError("need window >= 1 and min_samples >= 1")
        self.slos = dict(slos)
        self.quantile = quantile
        self.within_share_quantile = within_share_quantile
        self.window = window
        self.min_samples = min_samples
        self.key_min_samples = key_min_samples
        self.max_share_of_slo = max_share_of_slo
        self._tiers = {tier: _Errors(window) for tier in self.slos}
        self._keys: RecentMap[tuple[str, str], _Errors] = RecentMap(max(1, remember_keys))

    def judged(self, tier: str) -> bool:
        return tier in self._tiers

    def observe(self, tier: str, key_id: str, predicted_ttft_s: float, ttft_s: float) -> None:
        """A request of ``key_id`` predicted ``predicted_ttft_s`` on arrival (before the error
        admission adds) got its first token ``ttft_s`` after it."""
        if tier not in self._tiers:
            return
        error_s = ttft_s - predicted_ttft_s
        self._tiers[tier].add(error_s)
        key = self._keys.get((tier, key_id))
        if key is None:
            key = self._keys[(tier, key_id)] = _Errors(self.window)
        key.add(error_s)

    def error_s(self, tier: str, key_id: str | None = None, within_share: bool = False) -> float:
        """Seconds admission adds to its predictions for ``key_id`` of ``tier``: a quantile
        of the key's errors, ``within_share_quantile`` for a key within its share of the
        tier (``fairness``), else ``quantile``; the tier's errors at ``quantile`` for a key
        measured too little, or None; 0 before ``min_samples``."""
        errors = self._keys.get((tier, key_id)) if key_id is not None else None
        q = self.within_share_quantile if within_share else self.quantile
        if errors is None or len(errors.samples) < self.key_min_samples:
            errors, q = self._tiers.get(tier), self.quantile
            if errors is None or len(errors.samples) < self.min_samples:
                return 0.0
        cap = self.max_share_of_slo * self.slos[tier]
        return min(cap, max(0.0, errors.quantile(q)))

    def summary(self) -> dict[str, dict[str, float | int]]:
        """Per tier measured: n, p50 and p99 of the errors (ms), and the error added now."""
        out: dict[str, dict[str, float | int]] = {}
        for tier, errors in self._tiers.items():
            if errors.samples:
                samples = np.fromiter(errors.samples, float)
                out[tier] = {
                    "n": len(samples),
                    "p50_ms": float(np.quantile(samples, 0.5)) * 1000,
                    "p99_ms": float(np.quantile(samples, 0.99)) * 1000,
                    "error_ms": self.error_s(tier) * 1000,
                }
        return out
