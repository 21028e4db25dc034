"""How wrong admission's predicted time to first token has been, per judged tier.

Admission (``capacity.judge``) predicts a newcomer's TTFT from the prefill work committed ahead
of it and its own prefill, inflated by a margin. The prefill predictor's own error
(``PredictionErrors``: one prefill's busy time against its prediction) is not that margin's
whole story. A request's TTFT also holds what no prefill prediction counts: the decode steps
the worker runs between prefills and inside them, the requests fair order lets past it
(another key's burst, up to that key's share), packs that take longer than their parts, and a
running prefill of the same tier that it cannot preempt. Measured on the flood (docs/results.md,
"The flood at f9d147c"): admitted critical requests took up to 2.6x the uninflated
prediction at p95, while the prefill margin was 0.12-0.32, so 1 in 20 admitted requests missed.

So the scheduler that owns a judged tier makes admission's prediction itself when a request
arrives (the same ``judge`` over its own load), and compares it with the TTFT the request
gets. The tier's margin is a high quantile of those errors, so that a request admitted at the
edge of the SLO meets it with that probability: admission promises the attainment the issue
asks of it (0.99) by measuring, not by assuming where the time goes. Until enough requests
were measured, the prefill predictor's margin stands alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from queue_service.scheduler.capacity import Verdict
from queue_service.scheduler.prediction_error import PredictionErrors


@dataclass(frozen=True)
class AdmissionPrediction:
    """Admission's TTFT prediction for one request, before the margin: ``switch_s`` plus
    ``work_s`` (the work ahead of it per worker and its own prefill)."""

    switch_s: float
    work_s: float

    @classmethod
    def of(cls, verdict: Verdict) -> AdmissionPrediction:
        return cls(verdict.switch_s, verdict.wait_s + verdict.own_s)


class AdmissionErrors:
    """Per tier, the window of relative errors of the predicted work part of TTFT, and the
    margin (a high quantile of them) that admission inflates predictions by."""

    def __init__(
        self,
        tiers: tuple[str, ...],
        *,
        quantile: float = 0.99,
        window: int = 512,
        min_samples: int = 50,
        max_margin: float = 3.0,
    ) -> None:
        self._errors = {
            tier: PredictionErrors(
                window=window,
                min_samples=min_samples,
                default_margin=0.0,
                quantile=quantile,
                max_margin=max_margin,
            )
            for tier in tiers
        }

    def judged(self, tier: str) -> bool:
        return tier in self._errors

    def observe(self, tier: str, predicted: AdmissionPrediction, ttft_s: float) -> None:
        """A request predicted ``predicted`` at arrival got its first token ``ttft_s`` after."""
        errors = self._errors.get(tier)
        if errors is not None:
            errors.observe(predicted.work_s, max(0.0, ttft_s - predicted.switch_s))

    def margin(self, tier: str) -> float:
        """The tier's margin on admission's predictions (0 until measured, or not judged)."""
        errors = self._errors.get(tier)
        return errors.margin() if errors is not None else 0.0

    def summary(self) -> dict[str, dict[str, float | int]]:
        return {tier: errors.summary() for tier, errors in self._errors.items() if len(errors)}
