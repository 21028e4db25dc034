"""The worker's command line: ``python -m worker.process`` or ``tierflow worker``.

Every default comes from ``WorkerConfig`` (``worker.config``), the single place it is set.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Sequence

import structlog

from tierflow.heap import freeze_startup_heap, time_collections
from tierflow.identity import PLAINTEXT_WARNING, Identity, TlsFiles, add_tls_arguments
from tierflow.logging import configure_logging
from tierflow.metrics import add_metrics_arguments
from worker.config import CHECK_GRANULARITIES, WorkerConfig
from worker.models import ModelLoadError
from worker.process import WorkerProcess

log = structlog.get_logger("worker.process")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m worker.process",
        description="Run one worker: attach to the queue service and serve its commands.",
    )
    _add_connection_arguments(parser)
    _add_engine_arguments(parser)
    _add_batch_arguments(parser)
    parser.add_argument("--deployment", default=WorkerConfig.deployment, help="metrics label")
    add_metrics_arguments(parser)
    add_tls_arguments(parser)
    return parser


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the worker attaches, as whom, and how it keeps the session alive."""
    defaults = WorkerConfig
    parser.add_argument(
        "--queue-service", required=True, help="host:port of the queue service (WorkerControl)"
    )
    parser.add_argument("--worker-id", help="default: <hostname>-<pid>")
    parser.add_argument(
        "--heartbeat-interval", type=float, default=defaults.heartbeat_interval_s, help="seconds"
    )
    parser.add_argument(
        "--reconnect-min", type=float, default=defaults.reconnect_min_s, help="seconds"
    )
    parser.add_argument(
        "--reconnect-max", type=float, default=defaults.reconnect_max_s, help="seconds"
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=defaults.drain_timeout_s,
        help="seconds a SIGTERM waits for held requests to finish before it stops the worker",
    )  # fmt: skip
    parser.add_argument(
        "--health-port", type=int,
        help="serve the gRPC health service for probes (0: a free port; default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--health-host", default=defaults.health_host,
        help="the address health listens on (default loopback; 0.0.0.0 for a kubelet's probes)",
    )  # fmt: skip


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, where it runs, and where a prefill may be stopped."""
    defaults = WorkerConfig
    parser.add_argument("--model", default=defaults.model, help="preset, local directory or hub id")
    parser.add_argument("--device", help="cuda, cuda:1, cpu ... (default: cuda when present)")
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=defaults.chunk_size,
        help="prefill chunk in tokens; 0: whole prompt",
    )
    parser.add_argument(
        "--check",
        choices=CHECK_GRANULARITIES,
        default=defaults.check,
        help="where the engine reads the preemption flag (block: between row blocks that fit "
        "--preempt-budget-ms)",
    )
    parser.add_argument(
        "--preempt-budget-ms",
        type=float,
        default=defaults.preempt_budget_ms,
        help="the longest one row block of a prefill may take; 0: operators run whole",
    )
    parser.add_argument(
        "--progress-interval-ms",
        type=float,
        default=defaults.progress_interval_ms,
        help="report a chunk's layers at most this often; 0: after every layer",
    )
    parser.add_argument(
        "--memory-cap-bytes",
        type=int,
        default=defaults.memory_cap_bytes,
        help="cap on what suspended requests hold together",
    )
    parser.add_argument(
        "--cpus",
        type=_cores,
        help="run on these CPU cores (e.g. 0 or 0,1), one torch thread each (default: all)",
    )


def _add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV pool and the decode batch."""
    defaults = WorkerConfig
    parser.add_argument(
        "--kv-slots",
        type=int,
        default=defaults.kv_slots,
        help=f"KV slots: one prefill at a time while the others decode in one batch "
        f"(default: {defaults.kv_slots}; 1: one request at a time)",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=defaults.max_batch_size,
        help="requests decoding in one step (default: 16, at most --kv-slots)",
    )
    parser.add_argument(
        "--slot-tokens",
        type=int,
        default=defaults.slot_tokens,
        help="prompt + new tokens one request may hold (default: the model's context)",
    )
    parser.add_argument(
        "--preallocate-kv",
        action="store_true",
        help="commit the whole KV pool's memory at start (else, on a CPU, as requests write it)",
    )


def _cores(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        message = f"cores are numbers separated by commas: {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def pin_cpus(cpus: tuple[int, ...] | None) -> None:
    """Run this process on ``cpus`` with one torch thread per core (before the model loads)."""
    if cpus is None:
        return
    import torch

    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    return WorkerConfig(
        queue_service=args.queue_service,
        model=args.model,
        device=args.device,
        chunk_size=args.chunk_size or None,
        check=args.check,
        preempt_budget_ms=args.preempt_budget_ms or None,
        progress_interval_ms=args.progress_interval_ms,
        memory_cap_bytes=args.memory_cap_bytes,
        heartbeat_interval_s=args.heartbeat_interval,
        reconnect_min_s=args.reconnect_min,
        reconnect_max_s=args.reconnect_max,
        drain_timeout_s=args.drain_timeout,
        health_port=args.health_port,
        health_host=args.health_host,
        deployment=args.deployment,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        kv_slots=args.kv_slots,
        max_batch_size=args.max_batch_size,
        slot_tokens=args.slot_tokens,
        preallocate_kv=args.preallocate_kv,
        cpus=args.cpus,
        tls_dir=args.tls_dir,
        **extra,
    )


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging(json=True)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    main_log = log.bind(worker_id=config.worker_id)
    if config.tls_dir is None:
        main_log.warning(PLAINTEXT_WARNING)
    else:
        try:  # a missing certificate is a usage error now, not a reconnect loop later
            TlsFiles.load(config.tls_dir, Identity.worker(config.worker_id))
        except (FileNotFoundError, ValueError) as exc:
            parser.error(str(exc))
    try:
        pin_cpus(config.cpus)
    except OSError as exc:  # a core this machine does not have
        parser.error(f"--cpus {args.cpus}: {exc}")

    # Installed before the (slow) model load, so a SIGTERM then still exits cleanly.
    stop_requested = threading.Event()
    worker: WorkerProcess | None = None

    def on_signal(signum: int, _frame: object) -> None:
        # The first SIGTERM drains (finish what is held, take nothing new); a second signal,
        # or SIGINT (an operator's Ctrl-C), stops at once: what is held reruns elsewhere.
        name = signal.Signals(signum).name
        drain = signum == signal.SIGTERM and not stop_requested.is_set()
        main_log.info("signal received", signal=name, action="drain" if drain else "stop")
        stop_requested.set()
        if worker is not None and drain:
            worker.drain()
        elif worker is not None:
            worker.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        worker = WorkerProcess(config)
    except ModelLoadError as exc:
        main_log.error("cannot load the model", model=config.model, error=str(exc))
        return 1
    if stop_requested.is_set():
        return 0
    # The model and the engine are loaded: no collection walks them while serving.
    main_log.info("startup heap frozen", gc_objects=freeze_startup_heap())  # (tierflow.heap)
    time_collections(worker.metrics.registry, config.deployment)
    return worker.run()
