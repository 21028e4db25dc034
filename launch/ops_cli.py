"""The operator's commands: ``tierflow audit``, ``tierflow usage``, ``tierflow compare``,
``tierflow canary set|status`` and ``tierflow request-log dump``. Thin wrappers over ``ops``;
``launch.cli`` registers them."""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime
from pathlib import Path

from launch.local_stack import STATE_FILE, StackConfig
from tierflow.kafka_settings import KafkaSettings
from tierflow.tiers import load_tiers

DEFAULT_KV_BYTES_PER_TOKEN = (
    2 * 12 * 2 * 64 * 4
)  # bench-llama: K+V x 12 layers x 2 heads x 64, fp32


def add_ops_commands(sub) -> None:
    _add_audit(sub)
    _add_usage(sub)
    _add_compare(sub)
    _add_canary(sub)
    _add_request_log(sub)
    _add_topic(sub)


# ----------------------------------------------------------------------------- sources


def _add_kafka_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kafka-bootstrap", help="default $TIERFLOW_KAFKA_BOOTSTRAP or :9092")
    p.add_argument(
        "--kafka-tls-dir",
        help="reach Kafka over mTLS as the operator, with the certificates in this directory "
        "(`tierflow up` prints it; default $TIERFLOW_KAFKA_TLS_DIR; unset: plaintext)",
    )


def _kafka_settings(args: argparse.Namespace, **overrides) -> KafkaSettings:
    """The operator's Kafka settings: the environment's, with what the command line gives."""
    from ops.records import operator_kafka_from_env

    given = {"bootstrap": args.kafka_bootstrap, "tls_dir": args.kafka_tls_dir, **overrides}
    return operator_kafka_from_env(**{k: v for k, v in given.items() if v})


def _add_source_options(p: argparse.ArgumentParser) -> None:
    _add_kafka_options(p)
    p.add_argument("--request-log-topic", help="default <prefix>request_log")
    p.add_argument("--since", help="window start: ISO time, or seconds ago (e.g. 3600)")
    p.add_argument("--until", help="window end: ISO time, or seconds ago")
    p.add_argument("--tiers", type=Path, help="tiers TOML (default config/tiers.toml)")


def _when(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return time.time() - float(text)
    except ValueError:
        return datetime.fromisoformat(text).timestamp()


def _settings(args: argparse.Namespace) -> KafkaSettings:
    return _kafka_settings(args, request_log=args.request_log_topic)


def _records(args: argparse.Namespace, source: str, progress=None):
    from bench.traces import TraceOptions
    from ops.records import read_source

    opts = TraceOptions(
        length_scale=getattr(args, "trace_length_scale", 1.0),
        critical_share=getattr(args, "trace_critical_share", 0.5),
    )
    return read_source(
        source, settings=_settings(args), since_s=_when(args.since), until_s=_when(args.until),
        trace_options=opts, progress=progress,
    )  # fmt: skip


# ------------------------------------------------------------------------------- usage


def _usage(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ops.records import is_request_log_dump
    from ops.usage import render, usage_rows, write_csv, write_json

    if args.source != "kafka" and not is_request_log_dump(Path(args.source)):
        raise SystemExit(f"{args.source}: not a request-log dump (tierflow request-log dump)")
    rows = usage_rows(_records(args, args.source))
    render(rows, Console())
    window = {"source": args.source, "since": args.since, "until": args.until}
    csv_path = write_csv(rows, args.out.with_suffix(".csv"))
    json_path = write_json(rows, args.out.with_suffix(".json"), window=window)
    print(f"wrote {csv_path} and {json_path}")
    return 0


def _add_usage(sub) -> None:
    u = sub.add_parser(
        "usage", help="per key and served tier: requests, tokens, SLO met, downgraded, refused"
    )
    u.add_argument("source", nargs="?", default="kafka", help="'kafka' (default) or a dump")
    _add_source_options(u)
    u.add_argument(
        "--out", type=Path, default=Path("out/usage"), help="writes OUT.csv and OUT.json"
    )
    u.set_defaults(func=_usage)


# ------------------------------------------------------------------------------- audit


def _audit(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from ops.audit import Audit
    from ops.audit_report import write_report
    from queue_service.scheduler.predictor import PrefillTimePredictor

    predictor = (
        PrefillTimePredictor.load(args.predictor) if args.predictor else PrefillTimePredictor()
    )
    audit = Audit(load_tiers(args.tiers), predictor, workers=args.workers, switch_s=args.switch_s)
    columns = ["{task.description}", BarColumn(), "{task.percentage:>3.0f}%"]
    if args.source != "kafka":
        columns += [DownloadColumn(), TimeRemainingColumn()]
    with Progress(*columns) as bar:
        task = bar.add_task(f"reading {args.source}", total=None)
        audit.add_all(
            _records(args, args.source, lambda d, t: bar.update(task, completed=d, total=t))
        )
    summary = audit.summary(args.kv_bytes_per_token)
    paths = write_report(audit, summary, args.out, f"tierflow audit: {args.source}")
    print(paths["markdown"].read_text().split("![")[0])
    print(f"wrote {', '.join(str(p) for p in paths.values())} and the PNGs in {args.out}")
    return 0


def _add_audit(sub) -> None:
    a = sub.add_parser(
        "audit", help="per-tier lengths, arrivals, head-of-line blocking: is tierflow worth it?"
    )
    a.add_argument("source", help="'kafka' (the request log), a request-log dump or a trace")
    _add_source_options(a)
    a.add_argument("--predictor", type=Path, help="from `tierflow calibrate` (default: built-in)")
    a.add_argument("--workers", type=int, default=1, help="engines in the FIFO simulation")
    a.add_argument("--switch-s", type=float, default=0.05, help="preemption time, seconds")
    a.add_argument(
        "--kv-bytes-per-token", type=int, default=DEFAULT_KV_BYTES_PER_TOKEN,
        help="suspended state per prompt token (default bench-llama fp32)",
    )  # fmt: skip
    a.add_argument("--trace-length-scale", type=float, default=1.0)
    a.add_argument("--trace-critical-share", type=float, default=0.5)
    a.add_argument("--out", type=Path, default=Path("out/audit"))
    a.set_defaults(func=_audit)


# ----------------------------------------------------------------------------- compare


def run_compare(args: argparse.Namespace) -> dict:
    from ops.compare import Criteria, compare, format_report, worker_counts

    tiers = load_tiers(args.tiers)
    criteria = Criteria(
        min_violation_reduction=args.min_violation_reduction,
        max_lower_tier_loss=args.max_lower_tier_loss,
        min_n=args.min_n,
        max_load_gap=args.max_load_gap,
    )
    records = list(_records(args, args.source))
    workers = _worker_counts(args.workers or [])
    busy = None
    if args.prometheus and records:  # the workers' busy time over the records' window
        from launch.prometheus import PrometheusApi

        since = min(r.arrival_s for r in records)
        until = max(r.finished_s or r.arrival_s for r in records)
        counts = worker_counts(records, (args.old, args.new), workers)
        busy = PrometheusApi(args.prometheus).busy_fractions(since, until, counts)
    result = compare(
        records, tiers=list(tiers.names), slos={t.name: t.ttft_slo_s for t in tiers},
        old=args.old, new=args.new, criteria=criteria, workers=workers, busy=busy,
    )  # fmt: skip
    report = format_report(result)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str))
    return result


def _worker_counts(given: list[str]) -> dict[str, int]:
    counts = {}
    for item in given:
        deployment, _, n = item.partition("=")
        if not deployment or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--workers {item!r}: expected DEPLOYMENT=N with N >= 1")
        counts[deployment] = int(n)
    return counts


def _compare(args: argparse.Namespace) -> int:
    from ops.compare import FAIL

    return 1 if run_compare(args)["verdict"] == FAIL else 0


def add_compare_options(c: argparse.ArgumentParser) -> None:
    from ops.compare import Criteria

    c.add_argument("--old", default="primary", help="deployment label of the current version")
    c.add_argument("--new", default="canary", help="deployment label of the canary")
    c.add_argument(
        "--min-violation-reduction", type=float, default=Criteria.min_violation_reduction
    )
    c.add_argument("--max-lower-tier-loss", type=float, default=Criteria.max_lower_tier_loss)
    c.add_argument("--min-n", type=int, default=Criteria.min_n, help="top-tier requests/side")
    c.add_argument(
        "--max-load-gap", type=float, default=Criteria.max_load_gap,
        help="the sides' load per worker may differ by this share, or no verdict",
    )  # fmt: skip
    c.add_argument(
        "--workers", action="append", metavar="DEPLOYMENT=N",
        help="workers of a deployment (default: those its records name); repeatable",
    )  # fmt: skip
    c.add_argument(
        "--prometheus", metavar="URL",
        help="a Prometheus that scraped the workers (http://host:9090): each side's busy fraction",
    )  # fmt: skip


def _add_compare(sub) -> None:
    c = sub.add_parser("compare", help="old vs canary from the request log, with a verdict")
    c.add_argument("source", nargs="?", default="kafka", help="'kafka' (default) or a dump")
    _add_source_options(c)
    add_compare_options(c)
    c.add_argument("--out", type=Path, help="write the Markdown report (and .json) here")
    c.set_defaults(func=_compare)


# ------------------------------------------------------------------------------ canary


def _admin(args: argparse.Namespace) -> str:
    if args.admin:
        return args.admin
    state = Path(args.log_dir) / STATE_FILE  # a running `tierflow up`
    if state.exists():
        return json.loads(state.read_text())["envoy_admin"]
    return "127.0.0.1:9901"


def _canary(args: argparse.Namespace) -> int:
    from ops import canary

    admin = _admin(args)
    if args.action == "set":
        canary.set_weight(admin, args.weight)
    print(json.dumps(canary.status(admin), indent=2))
    return 0


def _canary_run(args: argparse.Namespace) -> int:
    from launch.canary_run import CanaryRunConfig, run_canary
    from ops.compare import FAIL

    try:
        config = canary_run_config(args, CanaryRunConfig)
    except ValueError as exc:
        raise SystemExit(f"tierflow canary run: {exc}") from None
    report = run_canary(config)
    return 1 if report["compare"]["verdict"] == FAIL else 0


def canary_run_config(args: argparse.Namespace, config_type):
    """The run's config from ``add_canary_run_options``' flags (what is not given: defaults)."""
    from ops.compare import Criteria

    given = {
        "model": args.model, "tiers_file": args.tiers, "weight": args.weight,
        "workers": args.workers, "load": args.load, "min_n": args.min_n,
        "time_limit_s": args.time_limit, "seed": args.seed, "out_dir": args.out,
    }  # fmt: skip
    criteria = Criteria(
        min_violation_reduction=args.min_violation_reduction,
        max_lower_tier_loss=args.max_lower_tier_loss,
        max_load_gap=args.max_load_gap,
    )
    return config_type(criteria=criteria, **{k: v for k, v in given.items() if v is not None})


def add_canary_run_options(r: argparse.ArgumentParser) -> None:
    """No defaults here: what is not given, CanaryRunConfig decides."""
    from ops.compare import Criteria

    r.add_argument("--model", help="default smollm2")
    r.add_argument("--tiers", type=Path, help="default config/demo-tiers.toml")
    r.add_argument("--weight", type=int, help="percent of requests and workers to the canary (50)")
    r.add_argument("--workers", type=int, help="workers of both sides together (2)")
    r.add_argument("--load", type=float, help="offered share of the capacity measured (0.7)")
    r.add_argument("--min-n", type=int, help="top-tier requests a side (100)")
    r.add_argument("--time-limit", type=float, help="seconds of arrivals at most (900)")
    r.add_argument("--seed", type=int)
    r.add_argument("--out", type=Path, help="default out/canary")
    r.add_argument(
        "--min-violation-reduction", type=float, default=Criteria.min_violation_reduction
    )
    r.add_argument("--max-lower-tier-loss", type=float, default=Criteria.max_lower_tier_loss)
    r.add_argument(
        "--max-load-gap", type=float, default=Criteria.max_load_gap,
        help="the sides' load per worker may differ by this share, or no verdict",
    )  # fmt: skip


def _add_canary(sub) -> None:
    c = sub.add_parser("canary", help="a canary rollout: set or read Envoy's split, or run one")
    actions = c.add_subparsers(dest="action", required=True)
    for action, text in (
        ("set", "set the canary's percent (run time)"),
        ("status", "the split in force and the requests each side got"),
    ):
        a = actions.add_parser(action, help=text)
        if action == "set":
            a.add_argument("--weight", type=int, required=True, help="percent to the canary")
        a.add_argument("--admin", help="Envoy admin host:port (default: the running stack's)")
        a.add_argument("--log-dir", type=Path, default=StackConfig.log_dir)
        a.set_defaults(func=_canary)
    r = actions.add_parser(
        "run", help="old vs new scheduler on this machine, sized to its capacity, to a verdict"
    )
    add_canary_run_options(r)
    r.set_defaults(func=_canary_run)


# ------------------------------------------------------------------------- request log


def _request_log(args: argparse.Namespace) -> int:
    from ops.records import dump_kafka

    n = dump_kafka(_settings(args), args.out, since_s=_when(args.since), until_s=_when(args.until))
    print(f"wrote {n} records to {args.out}")
    return 0


def _add_request_log(sub) -> None:
    r = sub.add_parser("request-log", help="dump the request log's window as JSON lines")
    r.add_argument("action", choices=["dump"])
    _add_source_options(r)
    r.add_argument("--out", type=Path, default=Path("out/request_log.jsonl"))
    r.set_defaults(func=_request_log)


# ------------------------------------------------------------------------------- topics


def _topic(args: argparse.Namespace) -> int:
    from ops.topics import read_topic

    settings = _kafka_settings(args)
    for record in read_topic(
        settings, args.topic, from_end=args.from_end, limit=args.max, follow=args.follow
    ):
        print(json.dumps(record), flush=True)
    return 0


def _add_topic(sub) -> None:
    t = sub.add_parser("topic", help="read a Kafka topic's records as JSON lines")
    t.add_argument("action", choices=["read"])
    t.add_argument(
        "topic",
        help="e.g. tierflow.request_log; a tier topic (tierflow.priority_critical) only from a "
        "plaintext broker: a secured one lets the operator read the request log alone",
    )
    _add_kafka_options(t)
    t.add_argument("--max", type=int, help="stop after this many records")
    t.add_argument("--follow", action="store_true", help="keep waiting for new records")
    t.add_argument("--from-end", action="store_true", help="only records written from now on")
    t.set_defaults(func=_topic)
