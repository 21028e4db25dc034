"""`tierflow bench --scale`: what the scheduler costs on a GPU fleet, in simulated time.

Each point runs the synthetic mix (``bench.workload.DEFAULT_MIX``'s tiers and prompt shapes,
its rates scaled so that prefills keep the workers ``load`` busy) through ``bench.fleet``: the
real scheduler and dispatcher per queue-service instance, simulated GPU workers
(``GpuTiming``). Per point it reports:

- the decision time per event (p50, p99), measured in wall-clock time on this machine, against
  the mean gap between the events of one instance (simulated time): the share of its time an
  instance spends deciding, that is the share of one core it needs;
- how long events waited for a busy instance (p99): an instance past saturation lets them
  queue;
- the critical tier's TTFT (p50, p99) against the simulated hardware's own bound, the request's
  prefill alone plus one interruption budget, and the share within the tier's SLO.

The default sweep first grows the workers behind one instance, to find where it saturates,
then holds 64 workers at 70 % load and adds instances (as many partitions per tier as
instances, which Kafka needs to give every instance work; with one partition per tier, the
default of ``tierflow up``, the first instance gets every tier and the others none).
Prints a table, writes JSON and a PNG.
"""

from __future__ import annotations

import copy
import gc
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.fleet import Fleet, GpuTiming
from bench.metrics import percentile, wilson_interval
from bench.report import save_figure, write_json
from bench.tables import print_table
from bench.workload import DEFAULT_MIX, synthetic
from queue_service.scheduler import (
    PrefillSample,
    PrefillTimePredictor,
    RequestArrived,
    RequestCancelled,
    Scheduler,
    SchedulerConfig,
    WorkerJoined,
    make_policy,
)
from tierflow.heap import frozen_heap
from tierflow.tiers import TierTable, load_tiers

CRITICAL = "critical"


DEFAULT_WINDOW = SchedulerConfig().plan_window


@dataclass(frozen=True)
class ScalePoint:
    workers: int
    instances: int = 1
    partitions: int = 1  # per tier
    load: float = 0.7  # the workers' prefill busy share the arrivals ask for
    max_live: int = 256
    # The scheduler's planning window (``waiting_index``); None: the full planner, every
    # waiting request ranked on every event (the scheduler before the window).
    plan_window: int | None = DEFAULT_WINDOW


DEFAULT_SWEEP = (
    ScalePoint(workers=4),
    ScalePoint(workers=8),
    ScalePoint(workers=16),
    ScalePoint(workers=32),
    ScalePoint(workers=64),
    ScalePoint(workers=64, max_live=1024),  # decoding requests count as live too
    ScalePoint(workers=64, instances=2, partitions=2),
    ScalePoint(workers=64, instances=4, partitions=4),
    ScalePoint(workers=64, instances=8, partitions=8),
    ScalePoint(workers=64, instances=4, partitions=1),  # the partitions a fleet must not keep
    # The full planner beside the window, on the same arrivals.
    ScalePoint(workers=16, plan_window=None),
    ScalePoint(workers=32, plan_window=None),
    ScalePoint(workers=64, instances=4, partitions=4, plan_window=None),
)

QUICK_SWEEP = (
    ScalePoint(workers=4),
    ScalePoint(workers=8, instances=2, partitions=2),
    ScalePoint(workers=4, plan_window=None),
)
QUICK_LIVES = (64,)


@dataclass(frozen=True)
class ScaleConfig:
    points: tuple[ScalePoint, ...] = DEFAULT_SWEEP
    # The pure scheduler first: one more critical arrival decided with this many live
    # requests (and how many copies of the state to time it on).
    arrival_lives: tuple[int, ...] = (256, 1000, 3000, 10000)
    arrival_samples: int = 200
    full_planner_samples: int = 20  # the full planner takes 50 ms an arrival at 10,000
    duration_s: float = 5.0  # simulated seconds of arrivals per point
    drain_s: float = 2.0  # simulated seconds after the last arrival
    max_new_tokens: int = 128
    seed: int = 0
    wall_limit_s: float = 300.0  # per point, on this machine
    timing: GpuTiming = field(default_factory=GpuTiming)
    policy: str = "flowprefill"


def arrival_cost(
    live: int,
    samples: int,
    plan_window: int | None,
    policy: str = "flowprefill",
    seed: int = 0,
    state: tuple[Scheduler, float] | None = None,
) -> tuple[dict, tuple[Scheduler, float]]:
    """The time ``Scheduler.handle`` takes to decide one more critical arrival, with ``live``
    requests of mixed tiers (500-4000-token prompts) waiting behind four batched workers of
    24 KV slots (the limits that shed batch requests raised, so that all stay live): p50 and p99
    over ``samples`` arrivals, each cancelled once decided, handled back to back by one warm
    scheduler as a queue service handles its events. ``state``: a scheduler built by an
    earlier call for the same ``live``, to time with another ``plan_window``."""
    if state is None:
        state = _live_state(live, policy, seed)
    gc_ms = full_collection_ms()  # over the state alone: ``main`` froze the startup heap
    scheduler, now = copy.deepcopy(state)
    scheduler.config = replace(scheduler.config, plan_window=plan_window)
    times = []
    for j in range(samples):
        event = RequestArrived(f"new{j}", "critical", 120, 16, key_id="new")
        started = time.perf_counter()
        scheduler.handle(event, now)
        times.append(time.perf_counter() - started)
        scheduler.handle(RequestCancelled(f"new{j}"), now)
    result = {
        "live": scheduler.live_requests(),
        "plan_window": plan_window,
        "samples": samples,
        "p50_us": percentile(times, 50) * 1e6,
        "p99_us": percentile(times, 99) * 1e6,
        "full_gc_ms": gc_ms,
    }
    return result, state


def full_collection_ms() -> float:
    """How long a full garbage collection takes now, in ms (``tierflow.heap``)."""
    started = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - started) * 1e3


def _live_state(live: int, policy: str, seed: int) -> tuple[Scheduler, float]:
    """A scheduler holding ``live`` requests, and the time of its last arrival."""
    tiers = load_tiers()
    # bench-llama on this CPU, calibrated as a running queue service's predictor is (admission
    # judges the top tier only then, and its bookkeeping is part of every such arrival).
    a, b, c = 1.7e-4, 1.7e-7, 0.075
    predictor = PrefillTimePredictor(a, b, c)
    predictor.fit(PrefillSample(n, 0, a * n + b * n * n + c) for n in range(250, 4001, 250))
    config = SchedulerConfig(max_queued_sheddable=live, max_predicted_wait_s=math.inf)
    scheduler = Scheduler(make_policy(policy), tiers, predictor, config)
    for i in range(4):
        scheduler.handle(WorkerJoined(f"w{i}", kv_slots=24, interruption_s=0.025), 0.0)
    rng = random.Random(seed)
    now = 0.0
    for i in range(live):
        tier = rng.choices(tiers.names, weights=[1, 2, 4][: len(tiers.names)])[0]
        event = RequestArrived(f"r{i}", tier, rng.randint(500, 4000), 64, key_id=f"k{i % 7}")
        scheduler.handle(event, now)
        now += 0.0005
    return scheduler, now


def mix_for_load(timing: GpuTiming, workers: int, load: float):
    """DEFAULT_MIX with its rates scaled so that the predicted prefill work keeps ``workers``
    busy ``load`` of the time."""
    work_per_s = sum(
        m.rate_per_s * statistics.fmean(
            timing.prefill_s(n) for n in range(m.min_tokens, m.max_tokens + 1)
        )
        for m in DEFAULT_MIX
    )  # fmt: skip
    factor = load * workers / work_per_s
    return tuple(replace(m, rate_per_s=m.rate_per_s * factor) for m in DEFAULT_MIX)


def run_point(point: ScalePoint, cfg: ScaleConfig, tiers: TierTable) -> dict:
    mix = mix_for_load(cfg.timing, point.workers, point.load)
    workload = synthetic(
        mix, duration_s=cfg.duration_s, seed=cfg.seed, max_new_tokens=cfg.max_new_tokens
    )
    fleet = Fleet(
        tiers,
        cfg.timing,
        workers=point.workers,
        instances=point.instances,
        partitions=point.partitions,
        policy=cfg.policy,
        max_live=point.max_live,
        seed=cfg.seed,
        plan_window=point.plan_window,
    )
    fleet.submit(list(workload.arrivals))
    finished = fleet.run(cfg.duration_s + cfg.drain_s, cfg.wall_limit_s)
    return summarize(point, fleet, tiers, cfg, finished, len(workload.arrivals))


def summarize(
    point: ScalePoint, fleet: Fleet, tiers: TierTable, cfg: ScaleConfig, finished: bool, n: int
) -> dict:
    span_s = fleet.clock.now or 1e-9
    per_instance = []
    for instance in fleet.instances:
        walls = [d.wall_s for d in instance.decisions]
        per_instance.append(
            {
                "instance": instance.name,
                "events": len(walls),
                "mean_gap_ms": span_s / len(walls) * 1e3 if walls else None,
                "decide_p50_us": percentile(walls, 50) * 1e6,
                "decide_p99_us": percentile(walls, 99) * 1e6,
                "core_share": sum(walls) / span_s,
                "event_wait_p99_ms": percentile([d.waited_s for d in instance.decisions], 99) * 1e3,
                "live_max": max((d.live for d in instance.decisions), default=0),
            }
        )
    critical = [o for o in fleet.outcomes.values() if o.tier == CRITICAL and o.arrival_s < span_s]
    slo_s = tiers[CRITICAL].ttft_slo_s
    ttfts, bounds, within_bound, within_slo = [], [], 0, 0
    for o in critical:
        bound = cfg.timing.prefill_s(o.prompt_tokens) + cfg.timing.interruption_s
        bounds.append(bound)
        if o.first_token_s is None:
            continue
        ttft = o.first_token_s - o.arrival_s
        ttfts.append(ttft)
        within_bound += ttft <= bound + 1e-9
        within_slo += ttft <= slo_s
    busiest = max(per_instance, key=lambda r: r["core_share"])
    return {
        "point": asdict(point),
        "finished": finished,
        "simulated_s": span_s,
        "arrivals": n,
        "arrival_rate_per_s": n / cfg.duration_s,
        "instances": per_instance,
        "busiest": busiest,
        "critical": {
            "n": len(critical),
            "served": len(ttfts),
            "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
            "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
            "bound_p99_ms": percentile(bounds, 99) * 1e3,
            "within_bound": within_bound,
            "within_slo": within_slo,
            "slo_interval": wilson_interval(within_slo, len(critical)),
        },
    }


def render(results: list[dict], cfg: ScaleConfig, console: Console) -> None:
    table = Table(
        title=(
            f"Scheduler cost on a simulated fleet ({cfg.policy}, {cfg.timing.name}, "
            f"{cfg.duration_s:g} s of arrivals a point, seed {cfg.seed})"
        )
    )
    for column in (
        "workers", "inst", "parts", "max live", "req/s", "events/s (busiest)", "decide p50/p99 us",
        "gap ms", "core", "window", "event wait p99 ms", "live max", "crit TTFT p50/p99 ms",
        "bound p99 ms", "crit within bound", "crit within SLO (n, 95% CI)",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for r in results:
        p, b, c = r["point"], r["busiest"], r["critical"]
        lo, hi = c["slo_interval"]
        cut = "" if r["finished"] else " (cut)"
        table.add_row(
            str(p["workers"]),
            str(p["instances"]),
            str(p["partitions"]),
            str(p["max_live"]),
            f"{r['arrival_rate_per_s']:.0f}",
            f"{b['events'] / r['simulated_s']:.0f}",
            f"{b['decide_p50_us']:.0f}/{b['decide_p99_us']:.0f}",
            f"{b['mean_gap_ms']:.2f}" if b["mean_gap_ms"] else "-",
            f"{b['core_share']:.0%}{cut}",
            _window_label(p["plan_window"]).replace(" (full planner)", ""),
            f"{b['event_wait_p99_ms']:.1f}",
            str(b["live_max"]),
            f"{c['ttft_p50_ms']:.0f}/{c['ttft_p99_ms']:.0f}",
            f"{c['bound_p99_ms']:.0f}",
            f"{c['within_bound']}/{c['n']}",
            f"{c['within_slo']}/{c['n']} ({lo:.2f}-{hi:.2f})",
        )
    print_table(console, table, keys=3)
    console.print(
        "core: the busiest instance's decision time over the simulated time, the share of one "
        "core of this machine it needs (at 100 % it cannot keep up and events queue). "
        "Bound: the request's own prefill plus one interruption budget "
        f"({cfg.timing.interruption_s * 1e3:g} ms) on the simulated GPU."
    )


def render_arrivals(arrivals: list[dict], cfg: ScaleConfig, console: Console) -> None:
    table = Table(title=f"The pure scheduler ({cfg.policy}): one more critical arrival")
    columns = ("live requests", "window", "n", "p50 us", "p99 us", "p50 vs full planner")
    for column in (*columns, "full GC ms"):
        table.add_column(column, justify="right")
    full = {a["live"]: a for a in arrivals if a["plan_window"] is None}
    for a in arrivals:
        reference = full.get(a["live"])
        ratio = f"{a['p50_us'] / reference['p50_us']:.3f}x" if reference else "-"
        table.add_row(
            str(a["live"]),
            _window_label(a["plan_window"]),
            str(a["samples"]),
            f"{a['p50_us']:.0f}",
            f"{a['p99_us']:.0f}",
            ratio,
            f"{a['full_gc_ms']:.1f}",
        )
    print_table(console, table)
    console.print(
        "full GC: one full garbage collection over the scheduler's state, the process's startup "
        "heap frozen as a queue service's is (tierflow.heap); the fleet below runs with the "
        "collector off (bench.fleet)."
    )


def _window_label(plan_window: int | None) -> str:
    return "all (full planner)" if plan_window is None else str(plan_window)


def plot(results: list[dict], path: Path) -> None:
    from bench.report import pyplot

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    default_live = ScalePoint.max_live
    single = [
        r
        for r in results
        if r["point"]["instances"] == 1
        and r["point"]["max_live"] == default_live
        and r["point"]["plan_window"] == DEFAULT_WINDOW
    ]
    xs = [r["point"]["workers"] for r in single]
    left.plot(xs, [r["busiest"]["core_share"] for r in single], "o-", label="window")
    full = [
        r for r in results if r["point"]["instances"] == 1 and r["point"]["plan_window"] is None
    ]
    left.plot(
        [r["point"]["workers"] for r in full],
        [r["busiest"]["core_share"] for r in full],
        "s--",
        label="full planner",
    )
    left.legend()
    left.axhline(1.0, color="grey", linestyle=":")
    left.set_xscale("log", base=2)
    left.set_xlabel("workers behind one instance")
    left.set_ylabel("share of one core spent deciding")
    left.set_title("One instance: where it saturates")
    multi = [r for r in results if r["point"]["workers"] == 64]
    labels = [
        f"{r['point']['instances']}i/{r['point']['partitions']}p/{r['point']['max_live']}"
        + ("/full" if r["point"]["plan_window"] is None else "")
        for r in multi
    ]
    right.bar(labels, [r["busiest"]["core_share"] for r in multi], color="tab:blue")
    right.axhline(1.0, color="grey", linestyle=":")
    right.set_ylabel("busiest instance's core share")
    right.set_title("64 workers at 70 %: instances / partitions per tier / max_live")
    right.tick_params(axis="x", labelrotation=45)
    save_figure(fig, path)


def main(cfg: ScaleConfig, json_path: Path | None, plot_path: Path | None) -> list[dict]:
    console = Console()
    tiers = load_tiers()
    with frozen_heap():  # as a queue service does once started: collections see its state
        arrivals = []
        for live in cfg.arrival_lives:
            windowed, state = arrival_cost(
                live, cfg.arrival_samples, DEFAULT_WINDOW, cfg.policy, cfg.seed
            )
            full, _ = arrival_cost(
                live, cfg.full_planner_samples, None, cfg.policy, cfg.seed, state=state
            )
            arrivals += [windowed, full]
    render_arrivals(arrivals, cfg, console)
    results = []
    for point in cfg.points:
        console.print(f"point {asdict(point)}")
        results.append(run_point(point, cfg, tiers))
    render(results, cfg, console)
    result = {"kind": "scale", "config": asdict(cfg), "arrival_cost": arrivals, "points": results}
    write_json(result, json_path, console)
    if plot_path is not None:
        plot(results, plot_path)
        console.print(f"wrote {plot_path}")
    return results
