"""Replaying real traces as benchmark workloads.

Two shapes are read:
- the Azure LLM inference trace CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens`` with
  timestamps like ``2023-11-16 18:17:03.9799600``;
- JSON lines with ``timestamp`` (milliseconds from the start), ``input_length`` and
  ``output_length`` (the Mooncake FAST'25 traces).

Traces carry neither tiers nor prompt text, and were recorded on GPUs far faster than a CPU, so
``TraceOptions`` says how to map them onto this machine, all deterministic for a seed:
- window: ``start_s`` and ``duration_s`` pick a slice of the trace (seconds from its start);
- time: ``time_scale`` stretches inter-arrival gaps (2.0 = half the arrival rate);
- lengths: ``length_scale`` multiplies prompt lengths, then they are clipped to
  [``min_tokens``, ``max_tokens``]; ``output_scale`` multiplies output lengths, then they are
  clipped to [1, ``max_new_tokens``] (1 by default: prefill only);
- tiers, by the rule "short prompts are interactive": a prompt of at most
  ``critical_max_tokens`` (after scaling) is ``critical`` with probability
  ``critical_share``; one of at most ``standard_max_tokens`` is ``standard``; the rest, and the
  short ones not drawn as critical, are ``batch``. The draw uses a seeded RNG.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bench.workload import Arrival, Workload


@dataclass(frozen=True)
class TraceRecord:
    at_s: float  # seconds from the first record
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TraceOptions:
    start_s: float = 0.0
    duration_s: float = 60.0
    time_scale: float = 1.0
    length_scale: float = 1.0
    min_tokens: int = 8
    max_tokens: int = 4096
    max_new_tokens: int = 1
    output_scale: float = 1.0
    critical_max_tokens: int = 128
    critical_share: float = 0.5
    standard_max_tokens: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        if self.time_scale <= 0 or self.length_scale <= 0 or self.output_scale <= 0:
            raise ValueError("time_scale, length_scale and output_scale must be positive")
        if not 0 <= self.critical_share <= 1:
            raise ValueError("critical_share must be in [0, 1]")


def read_trace(path: Path) -> list[TraceRecord]:
    """Read either supported shape, chosen by content (a CSV header or JSON objects)."""
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    if first.lstrip().startswith("{"):
        return _read_jsonl(path)
    if "ContextTokens" in first:
        return _read_azure_csv(path)
    raise ValueError(
        f"{path}: unknown trace format; expected the Azure CSV header "
        "TIMESTAMP,ContextTokens,GeneratedTokens or JSON lines with timestamp/input_length"
    )


def _read_azure_csv(path: Path) -> list[TraceRecord]:
    rows: list[tuple[datetime, int, int]] = []
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            stamp = row["TIMESTAMP"].strip()
            # Seven fractional digits (100 ns): datetime takes at most six.
            if "." in stamp:
                head, frac = stamp.split(".", 1)
                stamp = f"{head}.{frac[:6]}"
            rows.append(
                (
                    datetime.fromisoformat(stamp),
                    int(row["ContextTokens"]),
                    int(row["GeneratedTokens"]),
                )
            )
    if not rows:
        return []
    t0 = min(r[0] for r in rows)
    records = [TraceRecord((t - t0).total_seconds(), n_in, n_out) for t, n_in, n_out in rows]
    return sorted(records, key=lambda r: r.at_s)


def _read_jsonl(path: Path) -> list[TraceRecord]:
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                records.append(
                    TraceRecord(
                        float(obj["timestamp"]) / 1000.0,
                        int(obj["input_length"]),
                        int(obj["output_length"]),
                    )
                )
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: bad trace record ({exc})") from exc
    if not records:
        return []
    t0 = min(r.at_s for r in records)
    return sorted(
        (TraceRecord(r.at_s - t0, r.input_tokens, r.output_tokens) for r in records),
        key=lambda r: r.at_s,
    )


def assign_tier(tokens: int, opts: TraceOptions, rng: random.Random) -> str:
    if tokens <= opts.critical_max_tokens and rng.random() < opts.critical_share:
        return "critical"
    if tokens <= opts.standard_max_tokens:
        return "standard"
    return "batch"


def trace_workload(records: list[TraceRecord], opts: TraceOptions, name: str) -> Workload:
    rng = random.Random(opts.seed)
    end = opts.start_s + opts.duration_s
    arrivals = []
    for i, rec in enumerate(r for r in records if opts.start_s <= r.at_s < end):
        tokens = round(rec.input_tokens * opts.length_scale)
        tokens = max(opts.min_tokens, min(opts.max_tokens, tokens))
        tier = assign_tier(tokens, opts, rng)
        arrivals.append(
            Arrival(
                at_s=(rec.at_s - opts.start_s) * opts.time_scale,
                request_id=f"{tier[:4]}-{i:05d}",
                tier=tier,
                prompt_tokens=tokens,
                max_new_tokens=max(
                    1, min(opts.max_new_tokens, round(rec.output_tokens * opts.output_scale))
                ),
            )
        )
    return Workload(
        f"{name} [{opts.start_s:g}s, +{opts.duration_s:g}s] x{opts.time_scale:g}", tuple(arrivals)
    )


def load_trace_workload(path: Path, opts: TraceOptions) -> Workload:
    return trace_workload(read_trace(path), opts, Path(path).name)
