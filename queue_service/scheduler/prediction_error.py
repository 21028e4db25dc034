"""How wrong the prefill-time predictor has been, and the safety margin that follows from it;
and how long a preemption takes to act.

Each request that prefilled without a restart yields one out-of-sample error: the prediction
made when it first started against the busy time it really took. Waiting on a prediction is
only safe with a margin as large as the predictor's usual under-estimate, so the margin is a
high quantile of the observed ratio, not a constant: a well-calibrated predictor waits more
(fewer preemptions), a poor one preempts sooner.
"""

from __future__ import annotations

import math

import numpy as np

from queue_service.scheduler.sliding_quantile import SlidingQuantile


class PredictionErrors:
    """A window of relative errors ``actual / predicted - 1`` (> 0: the prefill took longer)."""

    def __init__(
        self,
        *,
        window: int = 512,
        min_samples: int = 20,
        default_margin: float = 0.2,
        quantile: float = 0.95,
        max_margin: float = 1.0,
    ) -> None:
        if window < 1 or min_samples < 1:
            raise ValueError("window and min_samples must be >= 1")
        if not 0 <= default_margin <= max_margin:
            raise ValueError("need 0 <= default_margin <= max_margin")
        if not 0 < quantile < 1:
            raise ValueError("quantile must be in (0, 1)")
        self._errors = SlidingQuantile(window)
        self._margin: float | None = None  # cached until the next observation
        self.min_samples = min_samples
        self.default_margin = default_margin
        self.quantile = quantile
        self.max_margin = max_margin

    def observe(self, predicted_s: float, actual_s: float) -> None:
        if predicted_s > 0 and math.isfinite(actual_s) and actual_s >= 0:
            self._errors.add(actual_s / predicted_s - 1.0)
            self._margin = None

    def __len__(self) -> int:
        return len(self._errors)

    def margin(self) -> float:
        """Relative margin to add to predicted times before trusting them: the ``quantile`` of
        the under-estimates (0 if the predictor over-estimates), clamped to ``max_margin``;
        ``default_margin`` until ``min_samples`` errors are known."""
        if self._margin is None:
            if len(self._errors) < self.min_samples:
                self._margin = self.default_margin
            else:
                high = self._errors.quantile(self.quantile)
                self._margin = min(self.max_margin, max(0.0, high))
        return self._margin

    def summary(self) -> dict[str, float | int]:
        """n, p50 and p95 of |relative error|, and the median signed error (the bias)."""
        if not self._errors:
            return {"n": 0, "abs_p50": math.nan, "abs_p95": math.nan, "bias_p50": math.nan}
        errors = np.fromiter(self._errors, float)
        return {
            "n": len(errors),
            "abs_p50": float(np.quantile(np.abs(errors), 0.5)),
            "abs_p95": float(np.quantile(np.abs(errors), 0.95)),
            "bias_p50": float(np.quantile(errors, 0.5)),
            "margin": self.margin(),
        }


class SwitchTime:
    """Observed preemption latencies (Preempt received -> engine stopped), and their p95: how
    long a preemption takes to act, within a worker's preemption budget. Before the first one,
    the largest budget a worker announced (0 when none did)."""

    def __init__(self, window: int = 64) -> None:
        self._samples = SlidingQuantile(window)
        self._p95: float | None = None  # cached until the next observation
        self._expected = 0.0

    def expect(self, budget_s: float) -> None:
        """A worker stops its prefills within ``budget_s``: the assumption until measured."""
        if math.isfinite(budget_s) and budget_s > self._expected:
            self._expected = budget_s
            self._p95 = None

    def observe(self, latency_s: float) -> None:
        if math.isfinite(latency_s) and latency_s > 0:
            self._samples.add(latency_s)
            self._p95 = None

    def p95(self) -> float:
        if self._p95 is None:
            self._p95 = self._samples.quantile(0.95) if len(self._samples) else self._expected
        return self._p95
