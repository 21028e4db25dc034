"""`tierflow bench --slo-sweep M,...`: the policies run again with the top tier's SLO changed.

The SLO sensitivity curve (``bench.slo_curves``) judges one run at many SLOs. That is exact for
a policy that never reads a deadline, but not for one that plans by deadlines (flowprefill):
configured with a tighter SLO it preempts sooner. On the workers' batched engine every policy
reads deadlines (packing and decode pauses do), so for each multiple M of the top tier's
isolated TTFT, the run of every policy is repeated with that tier's SLO set to M x isolated.
Each point counts the requests within that SLO; shed or failed requests count as misses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from bench import slo_curves
from tierflow.tiers import TierTable

RunPolicies = Callable[[TierTable, object, str], dict]


def with_slo(tiers: TierTable, name: str, ttft_slo_s: float) -> TierTable:
    return TierTable(replace(t, ttft_slo_s=ttft_slo_s) if t.name == name else t for t in tiers)


def run(cfg, isolated_ms: dict, tiers: TierTable, run_policies: RunPolicies) -> dict | None:
    """``run_policies(tiers, cfg, label)`` runs ``cfg.policies`` on the bench's arrivals and
    returns their summaries. None when there is nothing to sweep."""
    top = next(iter(tiers)).name
    rerun = tuple(cfg.policies)
    if not cfg.slo_multiples or not isolated_ms.get(top) or not rerun:
        return None
    points = []
    for multiple in cfg.slo_multiples:
        slo_ms = multiple * isolated_ms[top]
        summaries = run_policies(
            with_slo(tiers, top, slo_ms / 1000), replace(cfg, policies=rerun), f"SLO {multiple:g}x "
        )
        points.append(
            {
                "multiple": multiple,
                "slo_ms": slo_ms,
                "policies": {name: met(s["tiers"][top], slo_ms) for name, s in summaries.items()},
            }
        )
    return {"tier": top, "rerun": list(rerun), "points": points}


def met(tier_summary: dict, slo_ms: float) -> dict:
    """Requests of the tier within ``slo_ms``, of all of them (shed or failed: misses)."""
    within = slo_curves.attainment(tier_summary["ttft_samples_ms"], tier_summary["n"], slo_ms)
    return {"met": within, "n": tier_summary["n"]}
