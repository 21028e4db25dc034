"""`tierflow bench --flood`: one critical key floods the tier; does the fast lane hold?

Two critical keys of equal share (weight 1): ``calm`` sends within its share (``calm_share`` of
the critical tier's capacity) and ``flood`` sends ``flood_factor`` times that capacity, beside
standard and batch traffic (the sustained mix at ``others_factor``, and the standard tier's own
short requests at ``chat_share`` of the capacity, so that its check has an n). The critical tier's
capacity is measured, not assumed: lone requests of the tier's mean prompt through the same
harness and workers (``measure_critical_capacity``). Critical prompts are short enough to meet
the SLO alone.

The same arrivals run under four scenarios, flowprefill on the batched default each time, in
an order rotated by the seed:

  calm alone        the flood's arrivals left out (the reference for the calm key)
  flood, downgrade  the shipped rule (config/tiers.toml): overflow served at standard
  flood, reject     the same tiers with critical's overflow = "reject"
  flood, off        no overflow rule and one key for everyone: deadline order inside a tier

Admission is the queue service's own (``CapacityBoard``, via ``bench.harness``); fairness is the
scheduler's (``queue_service/scheduler/fairness.py``). Prints a table with n and 95 % Wilson
intervals, writes JSON and a PNG.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.event_log import EventLog
from bench.harness import RequestRecord, run_policy
from bench.metrics import wilson_interval
from bench.policy_bench import (
    PolicyBenchConfig,
    _predictor,
    make_engines,
    run_order,
    speed_probe_ms,
)
from bench.report import write_json
from bench.workload import DEFAULT_MIX, Arrival, TierMix, Workload, output_lengths, synthetic
from queue_service.scheduler import PrefillTimePredictor, Scheduler, make_policy
from tierflow.tiers import TierTable, load_tiers

SCENARIOS = ("calm alone", "flood, downgrade", "flood, reject", "flood, off")
POLICY = "flowprefill"
STUCK_AFTER_S = 120.0  # nothing happening this long with requests unfinished: they are lost


@dataclass(frozen=True)
class FloodConfig:
    calm_requests: int = 200  # the calm key's requests: the n of its attainment
    calm_share: float = 0.25  # the calm key's rate, as a share of the critical capacity
    flood_factor: float = 3.0  # the flooding key's rate, in critical capacities
    others_factor: float = 0.375  # standard and batch at this multiple of the sustained mix
    # The standard tier's own short requests (the critical mix's prompts, key "chat"), at this
    # share of the critical capacity: the sustained mix sends standard about 4 requests a run,
    # too few for the standard check to say anything.
    chat_share: float = 0.15
    max_new_tokens: int = 16  # outputs up to this (log-normal, bench.workload.output_lengths)
    seed: int = 0


PROBES = 24  # lone critical requests that measure the tier's capacity
PROBE_GAP_S = 0.5  # apart, so that each prefills alone (its decode may overlap the next)


def measure_critical_capacity(model, bench: PolicyBenchConfig, predictor, cfg: FloodConfig) -> dict:
    """Critical requests a second the run's workers serve one at a time, measured as the
    scenarios run them: ``PROBES`` lone requests of the tier's mean prompt through the same
    harness, engine, scheduler and output lengths; the capacity is the workers over their
    median TTFT. Not the bare engine's prefill time: a request through the harness also pays
    its dispatch, its events and its own decode steps slotted in. While the engine ran on a
    second thread, beside the main thread's OpenMP pool (``worker.batch_runner``), a short
    prefill there took about 1.5x the bare engine's, and a calm key sized on the bare engine's
    speed sent twice its intended share. Both are reported.
    """
    critical = DEFAULT_MIX[0]
    tokens = round((critical.min_tokens + critical.max_tokens) / 2)
    bare_ms = speed_probe_ms(model, tokens, runs=9, warmup=2)
    probes = Workload(
        "capacity probes",
        tuple(
            Arrival(i * PROBE_GAP_S, f"probe-{i:02d}", "critical", tokens, cfg.max_new_tokens)
            for i in range(PROBES)
        ),
    )
    scheduler = Scheduler(
        make_policy(POLICY), load_tiers(bench.tiers_file), predictor_copy(predictor)
    )
    engines = make_engines(model, POLICY, bench, probes)
    result = run_policy(scheduler, engines, probes, vocab_size=model.config.vocab_size)
    ttft_s = statistics.median(r.ttft_s for r in result.records.values())
    return {
        "per_s": bench.workers / ttft_s,
        "probe_ttft_ms": ttft_s * 1000,
        "probes": PROBES,
        "prompt_tokens": tokens,
        "bare_prefill_ms": bare_ms,
    }


def predictor_copy(predictor: PrefillTimePredictor) -> PrefillTimePredictor:
    """A fresh copy of the calibrated predictor: each run refits its own."""
    return PrefillTimePredictor.from_json(predictor.to_json())


def flood_workload(cfg: FloodConfig, capacity_per_s: float, with_flood: bool) -> Workload:
    """The calm key until ``calm_requests`` arrived; the flood over the same time; the
    standard tier's short requests (``chat_share``); standard and batch from the sustained mix.
    The calm key's arrivals are the same with or without the flood."""
    critical = DEFAULT_MIX[0]
    calm_rate = cfg.calm_share * capacity_per_s
    duration = cfg.calm_requests / calm_rate
    rng = random.Random(f"flood/{cfg.seed}")
    arrivals = _poisson(rng, critical, calm_rate, duration, "calm", cfg.calm_requests)
    flood = _poisson(rng, critical, cfg.flood_factor * capacity_per_s, duration, "flood")
    arrivals += flood if with_flood else []
    chat = replace(critical, tier="standard")
    arrivals += _poisson(rng, chat, cfg.chat_share * capacity_per_s, duration, "chat")
    others = tuple(replace(m, rate_per_s=m.rate_per_s * cfg.others_factor) for m in DEFAULT_MIX[1:])
    arrivals += synthetic(others, duration_s=duration, seed=cfg.seed).arrivals
    arrivals.sort(key=lambda a: (a.at_s, a.request_id))
    lengths = output_lengths(len(arrivals), cfg.max_new_tokens, cfg.seed)
    arrivals = [replace(a, max_new_tokens=n) for a, n in zip(arrivals, lengths, strict=True)]
    name = f"flood x{cfg.flood_factor:g} of {capacity_per_s:.1f} critical/s, seed {cfg.seed}"
    return Workload(name if with_flood else f"{name}, flood left out", tuple(arrivals))


def _poisson(
    rng: random.Random, mix: TierMix, rate: float, duration: float, key: str, count: int = 0
) -> list[Arrival]:
    """Poisson arrivals of ``key`` over ``duration`` (or exactly ``count`` of them)."""
    arrivals, t = [], rng.expovariate(rate)
    while (len(arrivals) < count) if count else (t < duration):
        tokens = rng.randint(mix.min_tokens, mix.max_tokens)
        arrivals.append(Arrival(t, f"{key}-{len(arrivals):05d}", mix.tier, tokens, key_id=key))
        t += rng.expovariate(rate)
    return arrivals


def scenario_setup(
    name: str, tiers: TierTable, workloads: dict
) -> tuple[TierTable, Workload, bool]:
    """(tiers, workload, admission on) of a scenario."""
    critical = tiers["critical"]
    if name == "calm alone":
        return tiers, workloads["calm"], True
    if name == "flood, downgrade":
        return tiers, workloads["flood"], True
    if name == "flood, reject":
        return _with(tiers, replace(critical, overflow="reject")), workloads["flood"], True
    one_key = tuple(replace(a, key_id="") for a in workloads["flood"].arrivals)
    off = _with(tiers, replace(critical, overflow=None))
    return off, Workload(workloads["flood"].name + ", one key", one_key), False


def _with(tiers: TierTable, policy) -> TierTable:
    return TierTable([policy if t.name == policy.name else t for t in tiers])


def rate(records: list[RequestRecord], ok) -> dict:
    """How many of ``records`` pass ``ok``, with the 95 % Wilson interval."""
    n, met = len(records), sum(1 for r in records if ok(r))
    low, high = wilson_interval(met, n)
    return {"met": met, "n": n, "rate": met / n if n else None, "ci95": [low, high]}


def summarise_flood(records: dict[str, RequestRecord], tiers: TierTable) -> dict:
    """Per group of the issue: the calm key at critical, the admitted critical requests, the
    flood's fate, the standard tier's own requests and the downgraded ones apart, batch."""
    slo = {t.name: t.ttft_slo_s for t in tiers}

    def in_slo(tier: str):
        return lambda r: r.served_tier == tier and r.ttft_s is not None and r.ttft_s <= slo[tier]

    every = list(records.values())
    # By id: "flood, off" sends both keys' requests as one key.
    by_key = {
        k: [r for r in every if r.arrival.request_id.startswith(f"{k}-")] for k in ("calm", "flood")
    }
    critical = [r for r in every if r.arrival.tier == "critical"]
    admitted = [r for r in critical if r.served_tier == "critical"]
    downgraded = [r for r in critical if r.served_tier not in (None, "critical")]
    lost = [r for r in every if r.rejected is None and (r.done_at is None or r.failed)]
    return {
        "calm at critical": rate(by_key["calm"], in_slo("critical")),
        "admitted critical": rate(admitted, in_slo("critical")),
        "flood admitted": rate(by_key["flood"], lambda r: r.served_tier == "critical"),
        "downgraded": rate(downgraded, in_slo("standard")),
        "rejected": sum(r.served_tier is None for r in critical),
        "lost": len(lost),
        "standard own": rate(
            [r for r in every if r.arrival.tier == "standard"], in_slo("standard")
        ),
        "batch": rate([r for r in every if r.arrival.tier == "batch"], in_slo("batch")),
        "critical ttft p95 ms": _p95_ms(admitted),
    }


def _p95_ms(records: list[RequestRecord]) -> float | None:
    ttfts = sorted(r.ttft_s * 1000 for r in records if r.ttft_s is not None)
    if len(ttfts) < 2:
        return ttfts[0] if ttfts else None
    return statistics.quantiles(ttfts, n=20)[-1]


def checks(scenarios: dict) -> dict:
    """The issue's numbers against this run (True: met; a group without requests is not)."""
    on, alone, reject = (scenarios[s] for s in ("flood, downgrade", "calm alone", "flood, reject"))

    def share(group: dict) -> float:
        return group["rate"] if group["n"] else math.nan

    calm = on["calm at critical"]
    # What downgrading costs the standard tier's own requests, against rejecting: one-sided. A
    # reject run can be the worse one for them (the flood's admitted requests filled the
    # critical tier's spare capacity, and critical goes first: docs/results.md).
    lost_points = share(reject["standard own"]) - share(on["standard own"])
    return {
        "calm key >= 0.99 over >= 200": calm["n"] >= 200 and share(calm) >= 0.99,
        "calm key no worse than alone": calm["met"] >= alone["calm at critical"]["met"],
        "admitted critical >= 0.99": share(on["admitted critical"]) >= 0.99,
        "none lost": all(s["lost"] == 0 for s in scenarios.values()),
        "standard no more than 5 points below reject run": lost_points <= 0.05,
    }


def run(cfg: FloodConfig, bench: PolicyBenchConfig, console: Console) -> dict:
    from worker.models import load_model

    loaded = load_model(bench.model, device=bench.device)
    model = loaded.model
    tiers = load_tiers(bench.tiers_file)
    with Progress(console=console) as progress:
        predictor = _predictor(model, bench, progress)
        measured = measure_critical_capacity(model, bench, predictor, cfg)
        capacity = measured["per_s"]
        workloads = {
            "calm": flood_workload(cfg, capacity, with_flood=False),
            "flood": flood_workload(cfg, capacity, with_flood=True),
        }
        results = {}
        for name in run_order(SCENARIOS, cfg.seed):
            scenario_tiers, workload, admission = scenario_setup(name, tiers, workloads)
            bar = progress.add_task(name, total=len(workload.arrivals))
            scheduler = Scheduler(
                make_policy(POLICY),
                scenario_tiers,
                predictor_copy(predictor),
            )
            log = _event_log(bench, name)
            try:
                result = run_policy(
                    scheduler,
                    make_engines(model, POLICY, bench, workload),
                    workload,
                    vocab_size=model.config.vocab_size,
                    on_progress=lambda b=bar: progress.advance(b),
                    admission=admission,
                    max_idle_s=STUCK_AFTER_S,
                    stop_when_idle=True,  # a request that never finishes is reported lost
                    event_log=log,
                )
            finally:
                if log is not None:
                    log.close()
            results[name] = summarise_flood(result.records, scenario_tiers)
            results[name]["stuck"] = result.stuck
            results[name]["cpu_steal"] = result.cpu_steal
            results[name]["makespan_s"] = result.makespan_s
            results[name]["admission_error"] = result.admission_errors
    return {
        "model": loaded.name,
        "policy": POLICY,
        "config": dataclasses.asdict(cfg),
        "workers": bench.workers,
        "critical_capacity_per_s": capacity,
        "capacity_measurement": measured,
        "requests": {k: len(w.arrivals) for k, w in workloads.items()},
        "run_order": list(run_order(SCENARIOS, cfg.seed)),
        "scenarios": {name: results[name] for name in SCENARIOS},
        "checks": checks(results),
    }


def _event_log(bench: PolicyBenchConfig, scenario: str) -> EventLog | None:
    """The timeline of one scenario (``--event-log DIR``), admission's verdicts included."""
    if bench.event_log_dir is None:
        return None
    return EventLog(bench.event_log_dir / f"{scenario.replace(', ', '_').replace(' ', '_')}.jsonl")


def render(result: dict, console: Console) -> None:
    table = Table(
        title=f"flood: {result['config']['flood_factor']:g}x the critical capacity "
        f"({result['critical_capacity_per_s']:.1f}/s, {result['workers']} worker(s)); "
        "met / n (95 % interval)"
    )
    groups = ("calm at critical", "admitted critical", "flood admitted", "downgraded",
              "standard own", "batch")  # fmt: skip
    table.add_column("scenario")
    for group in groups:
        table.add_column(group, justify="right")
    table.add_column("rejected", justify="right")
    table.add_column("lost", justify="right")
    for name, s in result["scenarios"].items():
        table.add_row(name, *(_cell(s[g]) for g in groups), str(s["rejected"]), str(s["lost"]))
    console.print(table)
    probe = result["capacity_measurement"]
    console.print(
        f"  capacity: {probe['probes']} lone requests of {probe['prompt_tokens']} tokens, median "
        f"TTFT {probe['probe_ttft_ms']:.0f} ms (the bare engine's prefill: "
        f"{probe['bare_prefill_ms']:.0f} ms)"
    )
    for check, ok in result["checks"].items():
        console.print(f"  {'met' if ok else 'MISSED'}: {check}")


def _cell(r: dict) -> str:
    if not r["n"]:
        return "-"
    low, high = r["ci95"]
    return f"{r['met']}/{r['n']} ({low:.3f}-{high:.3f})"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = ("calm at critical", "admitted critical", "standard own", "downgraded")
    names = list(result["scenarios"])
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        cells = [result["scenarios"][name][g] for g in groups]
        rates = [c["rate"] or 0.0 for c in cells]
        errs = [
            [r - (c["ci95"][0] if c["n"] else r) for r, c in zip(rates, cells, strict=True)],
            [(c["ci95"][1] if c["n"] else r) - r for r, c in zip(rates, cells, strict=True)],
        ]
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, rates, width, yerr=errs, capsize=3, label=name)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups)
    ax.set_ylabel("within the SLO of the tier served (95 % Wilson)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax.set_title(
        f"{result['model']}: one key floods critical at {result['config']['flood_factor']:g}x"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(
    cfg: FloodConfig, bench: PolicyBenchConfig, json_path: Path | None, png_path: Path | None
) -> dict:
    console = Console()
    result = run(cfg, bench, console)
    render(result, console)
    write_json(result, json_path, console)
    if png_path is not None:
        plot(result, png_path)
        console.print(f"wrote {png_path}")
    return result
