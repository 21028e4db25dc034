"""Workloads for the policy benchmark: who arrives when, with how long a prompt, in which tier.

Every policy in one run replays the same ``Workload`` (the same arrivals, the same prompts), so
their numbers differ only by the policy. The synthetic mix is the shape that hurts
non-preemptive serving: long low-tier documents and short high-tier queries arriving as Poisson
processes, one per tier.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Arrival:
    at_s: float  # seconds after the start of the run
    request_id: str
    tier: str
    prompt_tokens: int
    max_new_tokens: int = 1
    key_id: str = ""  # the API key that sends it (`tierflow bench --flood`); "" for one key


@dataclass(frozen=True)
class Workload:
    name: str
    arrivals: tuple[Arrival, ...]

    @property
    def duration_s(self) -> float:
        return self.arrivals[-1].at_s if self.arrivals else 0.0

    def clip_prompts(self, max_tokens: int) -> Workload:
        """Prompts no longer than ``max_tokens`` (a model's context minus its new tokens)."""
        arrivals = tuple(
            replace(a, prompt_tokens=min(a.prompt_tokens, max_tokens - a.max_new_tokens))
            for a in self.arrivals
        )
        return Workload(self.name, arrivals)

    def tiers(self) -> list[str]:
        return sorted({a.tier for a in self.arrivals})


@dataclass(frozen=True)
class TierMix:
    """Poisson arrivals of one tier with prompt lengths uniform in [min_tokens, max_tokens]."""

    tier: str
    rate_per_s: float
    min_tokens: int
    max_tokens: int
    max_new_tokens: int = 1


# Sized for the bench-llama preset on a 2-core CPU (a 4096-token prefill takes ~2-2.5 s): the mix
# keeps the engine at least ~70% busy, mostly with batch documents; critical queries are short
# and rare enough that two rarely overlap, so what a critical request waits for is the
# batch/standard work in front of it.
DEFAULT_MIX = (
    TierMix("critical", rate_per_s=0.5, min_tokens=16, max_tokens=96),
    TierMix("standard", rate_per_s=0.25, min_tokens=256, max_tokens=768),
    TierMix("batch", rate_per_s=0.42, min_tokens=2560, max_tokens=4096),
)


# Output lengths when decode is part of the benchmark: log-normal (most answers short, a long
# tail), median a quarter of the longest, clipped to [1, max_new_tokens]. Answers to LLM
# requests look like this (the Azure traces' GeneratedTokens: a median of tens of tokens, a tail
# of hundreds); the longest is scaled to what this machine decodes in a run.
OUTPUT_SIGMA = 0.8


def output_lengths(count: int, max_new_tokens: int, seed: int) -> list[int]:
    """``count`` output lengths in [1, ``max_new_tokens``], from an RNG of their own: the
    arrivals and prompts of a seed are the same whatever the output lengths."""
    if max_new_tokens <= 1:
        return [1] * count
    rng = random.Random(f"{seed}/outputs")
    median = max_new_tokens / 4
    return [
        max(1, min(max_new_tokens, round(rng.lognormvariate(math.log(median), OUTPUT_SIGMA))))
        for _ in range(count)
    ]


def synthetic(
    mix: tuple[TierMix, ...] = DEFAULT_MIX,
    *,
    duration_s: float = 60.0,
    seed: int = 0,
    max_new_tokens: int = 1,
    time_scale: float = 1.0,
) -> Workload:
    """Poisson arrivals per tier; ``max_new_tokens`` > 1: outputs of ``output_lengths``
    (else each tier mix's own ``max_new_tokens``). ``time_scale`` stretches the gaps (2: the
    same requests at half the rate), so that a slower machine can be given the same load
    relative to what it serves."""
    if not time_scale > 0:
        raise ValueError(f"time_scale must be positive, got {time_scale!r}")
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    for tier_mix in mix:
        t = rng.expovariate(tier_mix.rate_per_s) if tier_mix.rate_per_s > 0 else duration_s
        while t < duration_s:
            tokens = rng.randint(tier_mix.min_tokens, tier_mix.max_tokens)
            arrivals.append(Arrival(t, "", tier_mix.tier, tokens, tier_mix.max_new_tokens))
            t += rng.expovariate(tier_mix.rate_per_s)
    arrivals.sort(key=lambda a: a.at_s)
    if max_new_tokens > 1:
        lengths = output_lengths(len(arrivals), max_new_tokens, seed)
        arrivals = [replace(a, max_new_tokens=n) for a, n in zip(arrivals, lengths, strict=True)]
    numbered = tuple(
        replace(a, request_id=f"{a.tier[:4]}-{i:04d}", at_s=a.at_s * time_scale)
        for i, a in enumerate(arrivals)
    )
    outputs = f", outputs <= {max_new_tokens}" if max_new_tokens > 1 else ""
    scaled = f" x{time_scale:g}" if time_scale != 1.0 else ""
    return Workload(f"synthetic {duration_s:g}s{scaled} seed {seed}{outputs}", numbered)


def prompt_ids(arrival: Arrival, vocab_size: int, seed: int = 0) -> tuple[int, ...]:
    """Deterministic synthetic prompt tokens for an arrival (traces carry lengths, not text)."""
    rng = random.Random(f"{seed}/{arrival.request_id}")
    return tuple(rng.randrange(3, vocab_size) for _ in range(arrival.prompt_tokens))
