"""`tierflow canary run` (and `tierflow demo --canary`): a canary rollout on this machine, measured
until it reaches a verdict.

1. **The stack.** The old scheduler (``chunked``) and the new (``flowprefill``) behind one
   Envoy, each with workers in proportion to its share of the traffic (``--weight 50`` with two
   workers: one a side), each worker on a core of its own with one torch thread; a real
   Prometheus scrapes every service. Envoy's runtime sets the split (``ops.canary``).
2. **Capacity, measured with both sides up.** A backlog of the workload's own requests goes to
   both sides at once; each side's prompt tokens served per second while it drains is its
   capacity. The same backlog then goes to the old side alone, the other idle: the difference
   is what sharing the machine's cores (and Kafka, Envoy and the services with them) costs.
3. **The workload.** The demo's tier mix (``launch.demo``), its rate scaled so that the prompt
   tokens offered are ``--load`` (default 70%) of the capacity of both sides together. Arrivals
   continue until each side has admitted ``--min-n`` top-tier requests, or ``--time-limit``
   passes; the run then waits for the requests in flight.
4. **The verdict.** ``tierflow compare`` (``ops.compare``) over the request log of the traffic
   phase, with the workers per side and their busy fraction from Prometheus. The counts per
   side of the client, the request log and Prometheus are set side by side: they must agree.
"""

from __future__ import annotations

import json
import shlex
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from rich.console import Console

from bench.workload import Workload
from launch.demo import DemoConfig, demo_workload
from launch.local_stack import CANARY, PRIMARY, Endpoints, LocalStack, StackConfig
from launch.prometheus import PrometheusApi, PrometheusServer, scrape_config
from launch.stack_client import Credentials, StackRecord, replay
from ops import canary
from ops.compare import Criteria, compare, format_report
from ops.records import LogRecord, iter_kafka
from tierflow.tiers import load_tiers

SIDES = (PRIMARY, CANARY)


@dataclass(frozen=True)
class CanaryRunConfig:
    model: str = DemoConfig.model
    tiers_file: Path = DemoConfig.tiers_file
    old_policy: str = "chunked"
    new_policy: str = "flowprefill"
    weight: int = 50  # the canary's percent of requests (and of the workers)
    workers: int = 2  # both sides together
    load: float = 0.7  # offered prompt tokens over the capacity measured
    min_n: int = 100  # top-tier requests a side
    time_limit_s: float = 900.0  # of arrivals
    probe_requests: int = 24  # the capacity backlog, per probe
    seed: int = 0
    out_dir: Path = Path("out/canary")
    criteria: Criteria = field(default_factory=Criteria)

    def __post_init__(self) -> None:
        self.split()
        if not 0 < self.load <= 1:
            raise ValueError(f"load is a share of the capacity in (0, 1], got {self.load}")
        if self.min_n < 1 or self.time_limit_s <= 0 or self.probe_requests < 2:
            raise ValueError("min_n >= 1, time_limit_s > 0 and probe_requests >= 2, please")

    def split(self) -> dict[str, int]:
        """Workers per side, in proportion to the traffic weight (at least one a side)."""
        if not 0 < self.weight < 100:
            raise ValueError(f"a canary needs 0 < weight < 100, got {self.weight}")
        if self.workers < 2:
            raise ValueError(f"two sides need at least 2 workers, got {self.workers}")
        new = min(self.workers - 1, max(1, round(self.workers * self.weight / 100)))
        return {PRIMARY: self.workers - new, CANARY: new}

    def command(self) -> str:
        """The command line that runs this configuration."""
        return shlex.join([
            "tierflow", "canary", "run", "--model", self.model, "--tiers", _shown(self.tiers_file),
            "--weight", str(self.weight), "--workers", str(self.workers),
            "--load", f"{self.load:g}", "--min-n", str(self.min_n),
            "--time-limit", f"{self.time_limit_s:g}", "--seed", str(self.seed),
            "--out", str(self.out_dir),
        ])  # fmt: skip

    def stack_config(self) -> StackConfig:
        """The stack it runs on: both schedulers, the workers split, each on a core."""
        split = self.split()
        return StackConfig(
            model=self.model, policy=self.old_policy, canary_policy=self.new_policy,
            workers=split[PRIMARY], canary_workers=split[CANARY], pin_workers=True,
            tiers_file=self.tiers_file, log_dir=self.out_dir / "stack",
        )  # fmt: skip


def _shown(path: Path) -> str:
    """A path as a command line in this checkout would give it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def run_canary(cfg: CanaryRunConfig, console: Console | None = None) -> dict:
    """Starts the stack and a Prometheus, measures, stops them; prints and writes the report."""
    console = console or Console()
    stack_cfg = cfg.stack_config()
    console.print(
        f"starting {cfg.old_policy} ({stack_cfg.workers} worker) and {cfg.new_policy} "
        f"({stack_cfg.canary_workers} worker), a core each, logs in {stack_cfg.log_dir} ..."
    )
    with LocalStack(stack_cfg) as stack:
        e = stack.endpoints
        prometheus = PrometheusServer(
            scrape_config(e.metrics, e.envoy_admin), cfg.out_dir / "prometheus"
        )
        try:
            report = measure_canary(cfg, e, prometheus, console)
        finally:
            prometheus.stop()
    write_report(cfg, report, console)
    return report


def measure_canary(
    cfg: CanaryRunConfig, e: Endpoints, prometheus: PrometheusApi, console: Console
) -> dict:
    """Probe, traffic and verdict on a running stack (``cfg.stack_config()``'s) that
    ``prometheus`` scrapes."""
    tiers = load_tiers(cfg.tiers_file)
    split = cfg.split()
    probe = _probe_capacity(cfg, e, split, console)
    capacity = sum(probe["both"][side] * split[side] for side in SIDES)
    workload, by_id = _sized_workload(cfg, capacity * cfg.load)
    console.print(
        f"capacity with both sides up: {capacity:.0f} prompt tokens/s; offering "
        f"{cfg.load:.0%} of it until each side has {cfg.min_n} {tiers.names[0]} requests "
        f"(at most {cfg.time_limit_s:.0f} s)"
    )
    canary.set_weight(e.envoy_admin, cfg.weight)
    before = _snapshot(prometheus, time.time())
    started = time.time()
    sent = _traffic(cfg, e, workload, by_id, tiers.names[0])
    ended = time.time()
    time.sleep(1.0)  # the last request-log records are sent from a thread
    after = _snapshot(prometheus, time.time())
    records = [LogRecord.from_proto(m) for m in iter_kafka(e.operator_kafka(), since_s=started)]
    busy = prometheus.busy_fractions(before.at, after.at, split)
    result = compare(
        records, tiers=list(tiers.names), slos={t.name: t.ttft_slo_s for t in tiers},
        criteria=replace(cfg.criteria, min_n=cfg.min_n), workers=split, busy=busy,
    )  # fmt: skip
    return {
        "command": cfg.command(),
        "config": asdict(cfg) | {"out_dir": str(cfg.out_dir), "tiers_file": str(cfg.tiers_file)},
        "probe": probe,
        "offered_prompt_tokens_per_s": capacity * cfg.load,
        "arrivals_s": ended - started,
        "counts": _counts(sent, records, after.done - before.done),
        "compare": result,
    }


def _probe_capacity(cfg: CanaryRunConfig, e, split, console: Console) -> dict:
    """Prompt tokens per second per worker while a backlog drains: both sides, then the old
    side alone (the canary idle)."""
    workload, by_id = _sized_workload(cfg, rate=None, seed=cfg.seed + 1)
    backlog = Workload(
        "capacity probe", tuple(replace(a, at_s=0.0) for a in workload.arrivals)
    )  # fmt: skip
    measured: dict = {"tries": {}}
    for name, weight in (("both", cfg.weight), ("alone", 0)):
        canary.set_weight(e.envoy_admin, weight)
        sides = SIDES if weight else (PRIMARY,)
        measured[name], measured["tries"][name] = _probe(
            e, backlog, by_id, split, name, sides, console
        )
    alone, both = measured["alone"][PRIMARY], measured["both"][PRIMARY]
    measured["sharing_cost"] = 1 - both / alone if alone else float("nan")
    return measured


PROBE_TRIES = 4


def _probe(e, backlog: Workload, by_id, split, name: str, sides, console: Console):
    """(drain rate per side, tries): the backlog sent again while a side served none of it.
    Envoy splits at random, so a short backlog at 50 % leaves a side without a request once in
    2**(n-1) probes; a failed request is shown, never counted."""
    for tries in range(1, PROBE_TRIES + 1):
        console.print(f"capacity probe ({name}): {len(backlog.arrivals)} requests at once")
        result = _send(e, backlog, by_id, name)
        rates = _drain_rate(result.records.values(), split)
        missing = [side for side in sides if side not in rates]
        if not missing:
            return rates, tries
        console.print(
            f"capacity probe ({name}): nothing done on {', '.join(missing)}; what each "
            f"request came to: {dict(_outcomes(result.records.values()))}"
        )
    raise RuntimeError(
        f"capacity probe ({name}): {', '.join(missing)} served none of {PROBE_TRIES} backlogs"
    )


def _outcomes(records) -> Counter:
    """(side, done / rejected / failed and why) of each request, counted."""
    return Counter(
        (r.deployment or "no side", "done" if r.done_at is not None else r.failed or r.rejected)
        for r in records
    )


def _drain_rate(records, split) -> dict[str, float]:
    """Per side: prompt tokens done per second per worker, from the first send to its last
    request's end."""
    out = {}
    for side in SIDES:
        mine = [r for r in records if r.deployment == side and r.done_at is not None]
        if not mine:
            continue
        span = max(r.done_at for r in mine) - min(r.arrived_at for r in mine)
        out[side] = sum(r.arrival.prompt_tokens for r in mine) / span / split[side]
    return out


def _sized_workload(
    cfg: CanaryRunConfig, rate: float | None, seed: int | None = None
) -> tuple[Workload, dict]:
    """The demo mix over the time limit, its arrivals compressed (or stretched) so that it
    offers ``rate`` prompt tokens per second; None: the first ``probe_requests`` as they are."""
    seed = cfg.seed if seed is None else seed
    if rate is None:
        workload, by_id, _ = demo_workload(cfg.model, 120.0, seed)
        return Workload(workload.name, workload.arrivals[: cfg.probe_requests]), by_id
    base = 600.0
    workload, by_id, _ = demo_workload(cfg.model, base, seed)
    offered = sum(a.prompt_tokens for a in workload.arrivals) / base
    factor = rate / offered  # > 1: more often than the demo mix
    need = cfg.time_limit_s * factor
    if need > base:  # more arrivals than one base window holds
        workload, by_id, _ = demo_workload(cfg.model, need, seed)
    arrivals = tuple(
        replace(a, at_s=a.at_s / factor)
        for a in workload.arrivals
        if a.at_s / factor < cfg.time_limit_s
    )  # fmt: skip
    return Workload(f"{workload.name} x{factor:.2f}", arrivals), by_id


def _send(e, workload: Workload, by_id: dict, name: str, stop=lambda sent: False):
    from gateway.demo_keys import DEMO_KEYS

    return replay(
        e.envoy, workload, lambda a: by_id[a.request_id],
        lambda tier: Credentials(api_key=DEMO_KEYS[tier]), policy=name, stop=stop,
    )  # fmt: skip


def _traffic(cfg: CanaryRunConfig, e, workload: Workload, by_id: dict, top: str) -> list:
    """Sends until each side has admitted ``min_n`` top-tier requests; the records sent."""

    def enough(sent: dict[str, StackRecord]) -> bool:
        admitted = Counter(r.deployment for r in sent.values() if r.arrival.tier == top)
        return all(admitted[side] >= cfg.min_n for side in SIDES)

    return list(_send(e, workload, by_id, "canary run", stop=enough).records.values())


@dataclass(frozen=True)
class _Snapshot:
    """What Prometheus holds at ``at`` (Unix time), every target scraped after it."""

    at: float
    done: Counter  # (deployment, tier) -> requests done


def _snapshot(prometheus: PrometheusApi, after: float) -> _Snapshot:
    """The latest samples, every target scraped after ``after``: what the services had counted
    by then."""
    prometheus.scraped_after(after)
    done = Counter()
    expr = 'sum by (deployment, tier) (tierflow_requests_total{status="done"})'
    at = time.time()
    for r in prometheus.query(expr, at_s=at):
        done[(r["metric"]["deployment"], r["metric"]["tier"])] = round(float(r["value"][1]))
    return _Snapshot(at, done)


def _counts(sent: list, records: list[LogRecord], metrics: Counter) -> dict:
    """Requests done per side and tier, as the client, the request log and Prometheus
    (``tierflow_requests_total``'s increase over the traffic phase) each counted them."""
    client = Counter(
        (r.deployment, r.arrival.tier) for r in sent if r.done_at is not None and not r.failed
    )
    log = Counter((r.deployment, r.tier) for r in records if r.status == "done")
    keys = sorted(set(client) | set(log) | {k for k, v in metrics.items() if v})
    return {
        f"{side}/{tier}": {"client": client[(side, tier)], "request_log": log[(side, tier)],
                           "prometheus": metrics[(side, tier)]}
        for side, tier in keys
    }  # fmt: skip


def _resent(probe: dict) -> str:
    tries = {name: n for name, n in probe["tries"].items() if n > 1}
    return f" Backlogs sent again (a side served none): {tries}." if tries else ""


def format_run(report: dict) -> str:
    """Markdown: how the run was set up and what it measured, then the compare report."""
    cfg, probe = report["config"], report["probe"]
    both = ", ".join(f"{s} {v:.0f}" for s, v in probe["both"].items())
    lines = [
        f"`{report['command']}`",
        "",
        f"- {cfg['old_policy']} (primary) against {cfg['new_policy']} (canary), "
        f"{cfg['weight']}% of requests and of the {cfg['workers']} workers to the canary, each "
        f"worker on a core of its own. On one small machine a 50/50 split with one worker a "
        f"side is the honest setting: a 10% canary would get a tenth of a worker.",
        f"- Capacity with both sides up (prompt tokens/s per worker while a backlog of "
        f"{cfg['probe_requests']} requests drains): {both}. The old side alone: "
        f"{probe['alone'].get('primary', float('nan')):.0f}; sharing the machine cost "
        f"{probe['sharing_cost']:.0%}.{_resent(probe)}",
        f"- Offered {report['offered_prompt_tokens_per_s']:.0f} prompt tokens/s "
        f"({cfg['load']:.0%} of both sides' capacity) for {report['arrivals_s']:.0f} s.",
        "",
        "| side/tier done | client | request log | Prometheus |",
        "|---|---|---|---|",
    ]
    for key, c in report["counts"].items():
        lines.append(f"| {key} | {c['client']} | {c['request_log']} | {c['prometheus']} |")
    return "\n".join(lines) + "\n\n" + format_report(report["compare"])


def write_report(cfg: CanaryRunConfig, report: dict, console: Console) -> None:
    text = format_run(report)
    # Markdown as written: neither wrapped at the console's width nor read as rich markup.
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    (cfg.out_dir / "canary_report.md").write_text(text)
    (cfg.out_dir / "canary_report.json").write_text(json.dumps(report, indent=2, default=str))
    console.print(f"wrote {cfg.out_dir / 'canary_report.md'} (and .json)")
