"""Admission of a tier against its capacity: may one more request of the tier still meet its
deadline, given the work the tier has already committed?

A tier with an ``overflow`` rule (``config/tiers.toml``) admits a new request only while it
can. The committed work is the predicted prefill time left of the tier's admitted, unfinished
requests, as each instance that schedules part of the tier sees it (``TierLoad``, from
``Scheduler.tier_load``). Admission runs on whichever instance the client reached, so loads
travel between instances (``queue_service/core/capacity_board.py`` says how) and are summed
here.

Every request of a tier has the same SLO, so a newcomer's deadline is the latest of its tier:
deadline-first, it runs after every committed request of the tier and delays none of them. On W
workers a work-conserving schedule starts it at most ``committed / W`` from now, after the wait
for a running lower-tier prefill to stop (``switch_s``). Predictions are inflated by the
predictor's observed under-estimate (``margin``):

    predicted TTFT = switch_s + (1 + margin) * (committed_s / W + own prefill)

A request is admitted at its tier when that is within the tier's SLO. The same rule covers a
request whose own prefill alone exceeds the SLO.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tierflow.tiers import TierPolicy


@dataclass(frozen=True)
class TierLoad:
    """One scheduling instance's committed work of one tier, and what it predicts with."""

    tier: str
    workers: int  # attached workers that run the tier's requests
    committed_s: float  # predicted prefill seconds left of the tier's unfinished requests
    switch_s: float  # how long a running prefill takes to give way (p95 observed)
    margin: float  # the predictor's observed relative under-estimate
    coefficients: tuple[float, float, float]  # the prefill predictor's a, b, c
    calibrated: bool  # the predictor was fitted to measurements, not its fallback


def predict_prefill_s(coefficients: tuple[float, float, float], prompt_tokens: int) -> float:
    """The prefill predictor's model (``predictor.PrefillTimePredictor.predict``) for a whole
    prompt, from its coefficients alone (another instance's)."""
    a, b, c = coefficients
    return a * prompt_tokens + b * prompt_tokens * prompt_tokens + c


@dataclass(frozen=True)
class Verdict:
    tier: str
    admit: bool
    predicted_ttft_s: float
    slo_s: float

    @property
    def retry_after_s(self) -> int:
        """Whole seconds after which the committed work has drained by the excess (>= 1)."""
        return max(1, math.ceil(self.predicted_ttft_s - self.slo_s))

    def reason(self) -> str:
        return (
            f"the {self.tier} tier is at capacity: predicted time to first token "
            f"{self.predicted_ttft_s:.2f} s against its SLO of {self.slo_s:g} s"
        )


def judge(
    tier: TierPolicy,
    loads: Sequence[TierLoad],
    prompt_tokens: int,
    pending_prompts: Sequence[int] = (),
) -> Verdict | None:
    """Whether a request of ``prompt_tokens`` is admitted at ``tier`` on top of ``loads`` and
    of ``pending_prompts`` (the prompt lengths of requests admitted that no load counts yet).
    None when the rule cannot be applied: the tier has none, no worker serves it, or no load
    has a calibrated predictor (the request then stands at its tier)."""
    if tier.overflow is None:
        return None
    workers = sum(load.workers for load in loads)
    calibrated = [load for load in loads if load.calibrated and load.workers > 0]
    if workers == 0 or not calibrated:
        return None

    def prefill_s(tokens: int) -> float:  # the most pessimistic of the measured predictors
        return max(predict_prefill_s(load.coefficients, tokens) for load in calibrated)

    own_s = prefill_s(prompt_tokens)
    margin = max(load.margin for load in calibrated)
    switch_s = max(load.switch_s for load in loads)
    committed_s = sum(load.committed_s for load in loads)
    committed_s += sum(prefill_s(tokens) for tokens in pending_prompts)
    ttft_s = switch_s + (1.0 + margin) * (committed_s / workers + own_s)
    return Verdict(tier.name, ttft_s <= tier.ttft_slo_s, ttft_s, tier.ttft_slo_s)
