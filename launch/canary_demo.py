"""`tierflow demo --canary`: a canary rollout end to end on this machine.

1. The local stack with two deployments behind one Envoy: the old one (``chunked`` policy) and
   the canary (``flowprefill``), each with its own worker and tier topics, one request log.
2. ``tierflow canary set --weight 10`` (Envoy's admin runtime): 10% of requests to the canary.
3. The demo's mixed-tier workload through Envoy with the per-tier API keys.
4. ``tierflow compare`` over the request log: per tier and deployment, and the verdict.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from launch.demo import DemoConfig, demo_workload
from launch.local_stack import LocalStack, StackConfig
from launch.stack_client import Credentials, replay
from ops import canary
from ops.compare import Criteria, compare, format_report
from ops.records import LogRecord, iter_kafka
from tierflow.kafka_settings import KafkaSettings
from tierflow.tiers import load_tiers


@dataclass(frozen=True)
class CanaryDemoConfig:
    model: str = DemoConfig.model
    duration_s: float = DemoConfig.duration_s
    seed: int = 0
    out_dir: Path = DemoConfig.out_dir
    tiers_file: Path = DemoConfig.tiers_file
    old_policy: str = "chunked"
    canary_policy: str = "flowprefill"
    canary_percent: int = 10
    criteria: Criteria = field(default_factory=Criteria)


def run_canary_demo(cfg: CanaryDemoConfig) -> dict:
    from gateway.demo_keys import DEMO_KEYS

    console = Console()
    tiers = load_tiers(cfg.tiers_file)
    workload, by_id, _ = demo_workload(cfg.model, cfg.duration_s, cfg.seed)
    stack_cfg = StackConfig(
        model=cfg.model, policy=cfg.old_policy, canary_policy=cfg.canary_policy,
        tiers_file=cfg.tiers_file, log_dir=cfg.out_dir / "stack",
    )  # fmt: skip
    console.print(f"starting old ({cfg.old_policy}) and canary ({cfg.canary_policy}) ...")
    with LocalStack(stack_cfg) as stack:
        e = stack.endpoints
        canary.set_weight(e.envoy_admin, cfg.canary_percent)
        console.print(f"canary weight {cfg.canary_percent}%: {canary.status(e.envoy_admin)}")
        with Progress(console=console) as progress:
            bar = progress.add_task("mixed workload", total=len(workload.arrivals))
            replay(
                e.envoy, workload, lambda a: by_id[a.request_id],
                lambda tier: Credentials(api_key=DEMO_KEYS[tier]),
                on_progress=lambda: progress.advance(bar),
            )  # fmt: skip
        time.sleep(1.0)  # the last request-log records are sent from a thread
        records = [LogRecord.from_proto(m) for m in iter_kafka(KafkaSettings(bootstrap=e.kafka))]
    result = compare(
        records, tiers=list(tiers.names), slos={t.name: t.ttft_slo_s for t in tiers},
        criteria=cfg.criteria,
    )  # fmt: skip
    report = format_report(result)
    # Markdown as written: neither wrapped at the console's width nor read as rich markup.
    console.print(report, markup=False, highlight=False, soft_wrap=True)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    (cfg.out_dir / "canary_compare.md").write_text(report)
    (cfg.out_dir / "canary_compare.json").write_text(json.dumps(result, indent=2, default=str))
    console.print(f"wrote {cfg.out_dir / 'canary_compare.md'} (and .json)")
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=CanaryDemoConfig.duration_s)
    p.add_argument("--weight", type=int, default=CanaryDemoConfig.canary_percent)
    args = p.parse_args()
    run_canary_demo(CanaryDemoConfig(duration_s=args.duration, canary_percent=args.weight))
