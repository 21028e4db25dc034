"""`tierflow soak`: a mixed load through the local stack for a while, watching for what only
time shows: a request lost, or memory that keeps growing.

It starts the stack (``launch.local_stack``), sends requests at ``rate_per_s`` (Poisson
arrivals, tiers mixed, prompts and outputs of varied length) through Envoy with each tier's demo
key (or straight to the queue service with ``edge=False``), and every ``sample_s`` records each
child process's resident memory (psutil) and the suspended bytes the queue service reports
(its ``tierflow_suspended_bytes`` metric). At the end every request sent must have ended, and
none told ``Queued`` may have ended without ``Done`` (lost). Memory is judged on the samples
after a warm-up share (``warmup_share``): the Theil-Sen slope of each series (robust to the
spikes a garbage collection or a long prompt makes) and its 95 % interval; a series "keeps
growing" when even the interval's lower end exceeds the tolerance (``growth_tolerance``:
``abs_mb_per_min`` or ``rel_per_min`` of its median, the larger). Suspended bytes must also be
back to zero once the load has drained.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import psutil
import structlog
from prometheus_client.parser import text_string_to_metric_families
from scipy import stats

from gateway.demo_keys import DEMO_KEYS
from launch.local_stack import LocalStack, StackConfig
from tierflow.client import TierflowClient

log = structlog.get_logger("tierflow.soak")

TIERS = ("critical", "standard", "batch")


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 600.0
    rate_per_s: float = 2.0
    model: str = StackConfig.model
    workers: int = 1
    edge: bool = True
    log_dir: Path = Path("out/soak")
    sample_s: float = 1.0
    warmup_share: float = 0.2  # samples before this share of the run are not judged
    abs_mb_per_min: float = 2.0  # growth tolerated whatever the size...
    rel_per_min: float = 0.01  # ...or this share of the median per minute, the larger
    prompt_tokens: tuple[int, int] = (8, 256)
    max_new_tokens: tuple[int, int] = (1, 16)
    request_timeout_s: float = 300.0
    seed: int = 0


@dataclass
class Trend:
    name: str
    samples: int
    median: float
    slope_per_min: float  # Theil-Sen, in the series' unit per minute
    low_per_min: float  # its 95 % interval
    high_per_min: float
    tolerance_per_min: float
    growing: bool


@dataclass
class SoakResult:
    sent: int
    outcomes: dict[str, int]  # done, or the status that ended it
    lost: list[str]  # told Queued, ended without Done
    unfinished: int  # still streaming when the run ended
    trends: list[Trend]
    suspended_bytes_at_end: float
    series: dict[str, list[tuple[float, float]]] = field(repr=False, default_factory=dict)

    @property
    def passed(self) -> bool:
        return (
            not self.lost
            and self.unfinished == 0
            and not any(t.growing for t in self.trends)
            and self.suspended_bytes_at_end == 0
        )


def trend(name: str, points: list[tuple[float, float]], config: SoakConfig) -> Trend:
    """The robust slope of ``points`` (seconds, value) and whether it keeps growing."""
    t = [p[0] for p in points]
    y = [p[1] for p in points]
    median = float(sorted(y)[len(y) // 2]) if y else 0.0
    if len(points) < 3 or len(set(t)) < 2:
        return Trend(name, len(points), median, 0.0, 0.0, 0.0, 0.0, False)
    slope, _, low, high = stats.theilslopes(y, t, alpha=0.95)
    mb = 1024 * 1024 if "bytes" in name or "rss" in name else 1
    tolerance = max(config.abs_mb_per_min * mb / 60, config.rel_per_min * median / 60)
    return Trend(
        name, len(points), median, slope * 60, low * 60, high * 60, tolerance * 60, low > tolerance
    )


class _Load:
    """Poisson arrivals of mixed requests, each on a pool thread; records how each ended."""

    def __init__(
        self,
        target: str,
        config: SoakConfig,
        *,
        through_edge: bool,
        operator: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.target, self.config, self.through_edge = target, config, through_edge
        self.operator = operator  # direct (not through the edge): the operator's identity
        self.rng = random.Random(config.seed)
        self.pool = ThreadPoolExecutor(64, thread_name_prefix="soak-client")
        self.outcomes: Counter[str] = Counter()
        self.lost: list[str] = []
        self.sent = 0
        self.pending = 0
        self._lock = threading.Lock()

    def run(self, until: float) -> None:
        while (now := time.monotonic()) < until:
            time.sleep(min(self.rng.expovariate(self.config.rate_per_s), max(0.0, until - now)))
            if time.monotonic() >= until:
                return
            tier = self.rng.choice(TIERS)
            prompt = [
                self.rng.randrange(5, 4000)
                for _ in range(self.rng.randint(*self.config.prompt_tokens))
            ]
            new = self.rng.randint(*self.config.max_new_tokens)
            with self._lock:
                self.sent += 1
                self.pending += 1
                request_id = f"soak-{self.sent}"
            self.pool.submit(self._one, tier, request_id, prompt, new)

    def _one(self, tier: str, request_id: str, prompt: list[int], new: int) -> None:
        credentials = (
            {"api_key": DEMO_KEYS[tier]}
            if self.through_edge
            else {"tier": tier, "credentials": self.operator}
        )
        queued, outcome = False, "done"
        try:
            with TierflowClient(self.target, **credentials) as client:
                done = False
                for event in client.generate(
                    prompt, request_id=request_id, max_new_tokens=new,
                    timeout=self.config.request_timeout_s,
                ):  # fmt: skip
                    kind = event.WhichOneof("event")
                    queued = queued or kind == "queued"
                    done = done or kind == "done"
                outcome = "done" if done else "ended without done"
        except grpc.RpcError as exc:
            outcome = exc.code().name
        with self._lock:
            self.outcomes[outcome] += 1
            self.pending -= 1
            if queued and outcome != "done":
                self.lost.append(f"{request_id} ({tier}): {outcome}")

    def drain(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.2)
        self.pool.shutdown(wait=False, cancel_futures=True)
        return self.pending


def _suspended_bytes(metrics_target: str) -> float:
    with urllib.request.urlopen(f"http://{metrics_target}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "tierflow_suspended_bytes":
            return sum(s.value for s in family.samples)
    return 0.0


class _Sampler:
    def __init__(self, stack: LocalStack, started: float) -> None:
        self.stack, self.started = stack, started
        self.series: dict[str, list[tuple[float, float]]] = {}

    def sample(self) -> None:
        now = time.monotonic() - self.started
        for proc in self.stack.processes:
            try:  # the current process of each child (a restarted one has a new pid)
                rss = psutil.Process(proc.proc.pid).memory_info().rss
            except psutil.Error:
                continue
            self.series.setdefault(f"{proc.name} rss", []).append((now, float(rss)))
        qs_metrics = self.stack.endpoints.metrics.get("queue-service")
        if qs_metrics:
            try:
                value = _suspended_bytes(qs_metrics)
            except OSError:
                return
            self.series.setdefault("suspended bytes", []).append((now, value))


def run_soak(config: SoakConfig) -> SoakResult:
    stack_config = StackConfig(
        model=config.model, workers=config.workers, edge=config.edge, log_dir=config.log_dir
    )
    with LocalStack(stack_config) as stack:
        target = stack.endpoints.envoy if config.edge else stack.endpoints.queue_service
        operator = None if config.edge else stack.endpoints.operator_credentials()
        load = _Load(target, config, through_edge=config.edge, operator=operator)
        started = time.monotonic()
        sampler = _Sampler(stack, started)
        until = started + config.duration_s
        sender = threading.Thread(target=load.run, args=(until,), name="soak-load", daemon=True)
        sender.start()
        while time.monotonic() < until:
            sampler.sample()
            time.sleep(config.sample_s)
        sender.join()
        unfinished = load.drain(config.request_timeout_s)
        time.sleep(max(config.sample_s, 1.0))  # the heartbeats carry the final suspended bytes
        sampler.sample()
        suspended_end = sampler.series.get("suspended bytes", [(0, 0.0)])[-1][1]
        if stack.supervisor.restarts:
            load.lost.append(f"{stack.supervisor.restarts} child restart(s) during the soak")
    judged_from = config.duration_s * config.warmup_share
    trends = [
        trend(name, [p for p in points if p[0] >= judged_from], config)
        for name, points in sorted(sampler.series.items())
    ]
    return SoakResult(
        load.sent, dict(load.outcomes), load.lost, unfinished, trends, suspended_end,
        sampler.series,
    )  # fmt: skip


def report(result: SoakResult) -> str:
    lines = [
        f"sent {result.sent}: " + ", ".join(f"{k} {v}" for k, v in sorted(result.outcomes.items())),
        f"lost {len(result.lost)}, unfinished {result.unfinished}, "
        f"suspended bytes at the end {result.suspended_bytes_at_end:.0f}",
        "",
        "| series | samples | median | slope /min (95% interval) | tolerance /min | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for t in result.trends:
        megabytes = "rss" in t.name or "bytes" in t.name
        scale, unit = (1024 * 1024, "MB") if megabytes else (1, "")
        lines.append(
            f"| {t.name} | {t.samples} | {t.median / scale:.1f}{unit} | "
            f"{t.slope_per_min / scale:+.2f} ({t.low_per_min / scale:+.2f}, "
            f"{t.high_per_min / scale:+.2f}){unit} | {t.tolerance_per_min / scale:.2f}{unit} | "
            f"{'GROWING' if t.growing else 'flat'} |"
        )
    lines += [f"lost: {r}" for r in result.lost]
    lines.append("PASS" if result.passed else "FAIL")
    return "\n".join(lines)


def main(config: SoakConfig, json_path: Path | None = None) -> int:
    result = run_soak(config)
    print(report(result))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        document = asdict(result) | {"passed": result.passed, "config": asdict(config)}
        json_path.write_text(json.dumps(document, indent=2, default=str))
    return 0 if result.passed else 1
