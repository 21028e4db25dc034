"""The ``tierflow`` command line: one subcommand per job, each a thin wrapper over a module."""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import replace
from pathlib import Path

from launch.local_stack import StackConfig
from launch.ops_cli import add_ops_commands
from tierflow.logging import configure_logging
from worker.config import BatchConfig, EngineConfig


def _engine_bench(args: argparse.Namespace) -> int:
    if args.batch:
        return _batch_bench(args)
    if args.blocks:
        return _interruption_bench(args)
    if args.threads:
        return _thread_bench(args)
    if args.idle:
        return _idle_bench(args)
    from bench.engine_bench import EngineBenchConfig, main

    given = dict(prompt_tokens=args.prompt_tokens, chunk_size=args.chunk_size)
    return _run_engine_bench(EngineBenchConfig, main, args, **given)


def _idle_bench(args: argparse.Namespace) -> int:
    from bench.idle_bench import IdleBenchConfig, main

    given = dict(prompt_tokens=args.prompt_tokens, rounds=args.repeats)
    return _run_engine_bench(IdleBenchConfig, main, args, **given)


def _given(**options):
    """The options the command line set (None: left to the config's default)."""
    return {k: v for k, v in options.items() if v is not None}


def _run_engine_bench(config_class, main, args: argparse.Namespace, **options) -> int:
    """One engine benchmark: its config from the options given (``--quick``: its quick
    config), then its ``main`` with the JSON and PNG paths."""
    overrides = _given(model=args.model, device=args.device, **options)
    cfg = config_class.quick(**overrides) if args.quick else config_class(**overrides)
    main(cfg, args.json, args.plot)
    return 0


def _interruption_bench(args: argparse.Namespace) -> int:
    from bench.interruption_bench import InterruptionBenchConfig, main

    given = dict(
        prompt_tokens=args.prompt_tokens,
        budget_ms=args.budget_ms,
        latency_samples=args.samples,
        slowdown_pairs=args.repeats,
    )
    return _run_engine_bench(InterruptionBenchConfig, main, args, **given)


def _thread_bench(args: argparse.Namespace) -> int:
    from bench.thread_bench import ThreadBenchConfig, main

    given = dict(prompt_tokens=args.prompt_tokens, rounds=args.repeats)
    return _run_engine_bench(ThreadBenchConfig, main, args, **given)


def _batch_bench(args: argparse.Namespace) -> int:
    from bench.batch_bench import BatchBenchConfig, main

    given = dict(
        prefill_tokens=args.prompt_tokens,
        prefill_chunk=args.chunk_size,
        repeats=args.repeats,
        tbt_sweep_s=args.tbt_sweep,
    )
    # The batch bench draws no figure: its main takes the JSON path only.
    return _run_engine_bench(BatchBenchConfig, lambda cfg, js, _png: main(cfg, js), args, **given)


def _bench(args: argparse.Namespace) -> int:
    if args.scale:
        return _scale_bench(args)
    if args.tls:
        from launch.tls_bench import TlsBenchConfig
        from launch.tls_bench import main as tls_main

        tls_main(TlsBenchConfig(**_given(model=args.model, seed=args.seed)), args.json, args.plot)
        return 0
    from bench.policy_bench import BATCHED_MAX_NEW_TOKENS, PolicyBenchConfig, main
    from bench.traces import TraceOptions

    max_new = args.max_new_tokens or BATCHED_MAX_NEW_TOKENS
    trace_opts = TraceOptions(
        start_s=args.trace_start[0],
        duration_s=args.duration if args.duration is not None else 60.0,
        time_scale=args.trace_time_scale,
        length_scale=args.trace_length_scale,
        critical_share=args.trace_critical_share,
        max_new_tokens=max_new,
        output_scale=args.trace_output_scale,
        seed=args.seed,
    )
    overrides = {
        "model": args.model,
        "device": args.device,
        "policies": _bench_policies(args),
        "chunk_size": args.chunk_size,
        "chunked_chunk_size": args.chunked_chunk_size,
        "workers": args.workers,
        "duration_s": args.duration,
        "seed": args.seed,
        "trace": args.trace,
        "trace_options": trace_opts,
        "tiers_file": args.tiers,
        "predictor_file": args.predictor,
        "kv_slots": args.kv_slots,
        "max_batch_size": args.max_batch_size,
        "max_new_tokens": max_new,
        "slo_multiples": tuple(float(m) for m in args.slo_sweep.split(","))
        if args.slo_sweep
        else None,
        "sustained_factors": tuple(float(f) for f in args.sustained.split(","))
        if args.sustained
        else None,
        "sustained_seeds": tuple(int(x) for x in args.sustained_seeds.split(","))
        if args.sustained_seeds
        else None,
        "sustained_min_critical": args.min_critical,
        "event_log_dir": args.event_log,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    cfg = PolicyBenchConfig.quick(**overrides) if args.quick else PolicyBenchConfig(**overrides)
    if args.flood:
        from bench.flood import FloodConfig
        from bench.flood import main as flood_main

        flood = FloodConfig(seed=args.seed)
        if args.flood_calm:
            flood = replace(flood, calm_requests=args.flood_calm)
        if args.max_new_tokens:
            flood = replace(flood, max_new_tokens=args.max_new_tokens)
        flood_main(flood, cfg, args.json, args.plot)
    elif args.stack:
        from launch.stack_bench import main as stack_main

        stack_main(cfg, args.json, args.plot)
    elif len(args.trace_start) > 1:
        from bench.windows import main as windows_main

        windows_main(cfg, args.trace_start, args.json, args.plot)
    else:
        main(cfg, args.json, args.plot)
    return 0


def _pool(args: argparse.Namespace) -> int:
    from bench.pooled import main

    main(args.runs, args.tier, args.json, args.plot)
    return 0


def _scale_bench(args: argparse.Namespace) -> int:
    from bench.scale import QUICK_LIVES, QUICK_SWEEP, ScaleConfig, main

    cfg = ScaleConfig(seed=args.seed)
    if args.quick:
        cfg = replace(
            cfg, points=QUICK_SWEEP, duration_s=1.0, drain_s=0.5, arrival_lives=QUICK_LIVES
        )
    if args.duration is not None:
        cfg = replace(cfg, duration_s=args.duration)
    main(cfg, args.json, args.plot)
    return 0


def _bench_policies(args: argparse.Namespace) -> tuple[str, ...] | None:
    from queue_service.scheduler.policies import ABLATIONS

    if args.ablations:
        return ("flowprefill", *ABLATIONS)
    return tuple(args.policies.split(",")) if args.policies else None


def _calibrate(args: argparse.Namespace) -> int:
    from bench.calibrate import calibrate_and_report
    from worker.engine import PrefillEngine
    from worker.models import load_model

    loaded = load_model(args.model, device=args.device)
    engine = PrefillEngine(loaded.model, EngineConfig(chunk_size=args.chunk_size))
    predictor, error = calibrate_and_report(engine)
    predictor.save(args.out)
    print(f"{predictor!r} -> {args.out}")
    print(
        f"held-out relative error (n={error['n']}): p50 {error['abs_p50']:.1%}, "
        f"p95 {error['abs_p95']:.1%}, bias {error['bias_p50']:+.1%}"
    )
    return 0


def _up(args: argparse.Namespace) -> int:
    import signal
    import threading

    from launch.local_stack import LocalStack

    cfg = StackConfig(
        model=args.model, workers=args.workers, policy=args.policy, log_dir=args.log_dir,
        edge=not args.no_edge, envoy_port=args.envoy_port, chunk_size=args.chunk_size,
    )  # fmt: skip
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with LocalStack(cfg) as stack:
        # The supervisor gave up on a child: stop everything and say so (exit code 1).
        threading.Thread(
            target=lambda: stack.supervisor.failed.wait() and stop.set(), daemon=True
        ).start()
        e = stack.endpoints
        print(
            f"tierflow is up: edge {e.envoy or '-'} (gRPC + JSON + OpenAI API at "
            f"http://{e.envoy or '-'}/v1), queue service {e.queue_service} (mTLS: "
            f"`--tls-dir {e.tls_dir}` as the operator), kafka {e.kafka} (mTLS: "
            f"`--kafka-tls-dir {e.tls_dir}`); logs in {stack.log_dir}"
        )
        print("Ctrl-C or `tierflow down` stops it.")
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
        if stack.supervisor.failed.is_set():
            print(f"error: {stack.supervisor.failure}; the stack is stopped", file=sys.stderr)
            return 1
    return 0


def _down(args: argparse.Namespace) -> int:
    from launch.local_stack import stop_running_stack

    if stop_running_stack(args.log_dir):
        print("stopped")
        return 0
    print(f"no running stack recorded in {args.log_dir}")
    return 1


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from tierflow.client import TierflowClient
    from tierflow.identity import Identity, Role, TlsFiles

    credentials = (
        None
        if args.tls_dir is None
        else TlsFiles.load(args.tls_dir, Identity(Role.OPERATOR)).channel_credentials()
    )
    client = TierflowClient(
        args.target, api_key=args.api_key, tier=args.tier, credentials=credentials
    )
    with client:
        try:
            for event in client.generate(
                args.prompt, max_new_tokens=args.max_new_tokens,
                temperature=args.temperature, timeout=args.timeout,
            ):  # fmt: skip
                kind = event.WhichOneof("event")
                body = getattr(event, kind)
                if kind == "token":
                    print(body.text, end="", flush=True)
                elif kind == "first_token":
                    print(
                        f"[first token after {body.ttft_ms:.0f} ms] {body.text}", end="", flush=True
                    )
                elif kind == "done":
                    t = body.timings
                    print(
                        f"\n[done: {body.usage.completion_tokens} tokens, queue wait "
                        f"{t.queue_wait_ms:.0f} ms, prefill {t.prefill_ms:.0f} ms, "
                        f"suspended {t.suspended_ms:.0f} ms, preemptions {t.preemptions}]"
                    )
                else:
                    print(f"[{kind}] {str(body).strip().replace(chr(10), ', ')}")
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}")
            return 2
    return 0


def _soak(args: argparse.Namespace) -> int:
    from launch.soak import SoakConfig, main

    given = {
        "duration_s": args.duration, "rate_per_s": args.rate, "model": args.model,
        "workers": args.workers, "log_dir": args.log_dir,
    }  # fmt: skip
    config = SoakConfig(edge=not args.no_edge, **{k: v for k, v in given.items() if v is not None})
    return main(config, args.json)


def _protoset(args: argparse.Namespace) -> int:
    from launch.protogen import write_descriptor_set

    print(write_descriptor_set(args.out))
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.canary:  # `tierflow canary run`, its time limit from --duration
        from launch.canary_run import CanaryRunConfig, run_canary

        given = {"model": args.model, "time_limit_s": args.duration, "weight": args.canary_weight,
                 "out_dir": args.out / "canary" if args.out else None}  # fmt: skip
        run_canary(CanaryRunConfig(**{k: v for k, v in given.items() if v is not None}))
        return 0
    from launch.demo import DemoConfig, run_demo

    given = {"model": args.model, "duration_s": args.duration, "out_dir": args.out}
    run_demo(DemoConfig(**{k: v for k, v in given.items() if v is not None}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_engine_bench, _add_bench, _add_pool, _add_misses, _add_calibrate):
        add(sub)
    for add in (_add_up, _add_down):
        add(sub)
    _add_generate(sub)
    _add_certs(sub)
    _add_protoset(sub)
    _add_soak(sub)
    _add_demo(sub)
    add_ops_commands(sub)
    for name in SERVICES:  # listed for --help; main() hands their arguments to the service
        sub.add_parser(name, help=f"run the {name} process (its own --help)", add_help=False)
    return parser


def _add_engine_bench(sub) -> None:
    eb = sub.add_parser(
        "engine-bench",
        help="measure layer time, chunk-size cost, check overhead and preemption latency",
    )
    eb.add_argument("--model", help="preset name, local directory or hub id (default bench-llama)")
    eb.add_argument("--device", help="cuda, cpu, ... (default: cuda when present)")
    eb.add_argument("--prompt-tokens", type=int)
    eb.add_argument(
        "--chunk-size",
        type=int,
        help=f"C of the layer times and the check A/B (default {EngineConfig.chunk_size}; "
        "preemption latency is measured at C=512 and C=2048)",
    )
    eb.add_argument("--quick", action="store_true", help="smaller prompt and fewer samples")
    eb.add_argument(
        "--batch",
        action="store_true",
        help="the batched engine instead: decode throughput per batch size, time between "
        "tokens during a long prefill (sequential / per chunk / slotted at layers)",
    )
    eb.add_argument(
        "--blocks",
        action="store_true",
        help="interruption points bounded in time: preemption latency between row blocks vs at "
        "layers, at C=512, 2048 and the whole prompt, and the blocks' prefill slowdown",
    )
    eb.add_argument(
        "--threads",
        action="store_true",
        help="where the engine runs: a short prefill on the main thread and on a second one, "
        "bare and through the runner (why the worker runs its engine on the main thread)",
    )
    eb.add_argument(
        "--idle",
        action="store_true",
        help="a lone short prefill back to back, after idle gaps and after a spinning CPU "
        "(what a request arriving at an idle engine pays on this machine)",
    )
    eb.add_argument(
        "--budget-ms", type=float, help="--blocks: the preemption budget (default: the engine's)"
    )
    eb.add_argument(
        "--samples", type=_positive_int, help="--blocks: latency samples per C and check"
    )
    eb.add_argument(
        "--repeats",
        type=_positive_int,
        help="--batch: prefills per TBT run, each paired with one alone (default: "
        "BatchBenchConfig.repeats in bench/batch_bench.py); --blocks: slowdown pairs per C; "
        "--threads, --idle: rounds (default ThreadBenchConfig.rounds, IdleBenchConfig.rounds); "
        "more narrow the intervals",
    )
    eb.add_argument(
        "--tbt-sweep",
        type=_seconds_list,
        help="--batch: more TBT targets in seconds, comma-separated ('' for none; default: "
        "BatchBenchConfig.tbt_sweep_s)",
    )
    eb.add_argument("--json", type=Path, help="write the results here")
    eb.add_argument("--plot", type=Path, help="write a PNG here")
    eb.set_defaults(func=_engine_bench)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not comma-separated seconds: {text!r}") from exc
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"targets must be > 0 s, got {text!r}")
    return values


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="compare scheduling policies on the same arrivals")
    _add_bench_workload(b)
    _add_bench_modes(b)
    _add_bench_outputs(b)
    b.set_defaults(func=_bench)


def _add_bench_workload(b) -> None:
    """The model, the policies and the arrivals they are compared on."""
    b.add_argument("--model", help="default bench-llama")
    b.add_argument("--device")
    b.add_argument("--policies", help="comma-separated; default all five")
    b.add_argument(
        "--ablations",
        action="store_true",
        help="flowprefill next to its ablations (flowprefill-chunk, priority-layer, "
        "flowprefill-recompute, flowprefill-layer) on the same arrivals",
    )
    b.add_argument(
        "--chunk-size",
        type=int,
        help=f"engine chunk for all but chunked ({EngineConfig.chunk_size})",
    )
    b.add_argument("--chunked-chunk-size", type=int, help="C of the chunked baseline (512)")
    b.add_argument("--workers", type=int, help="engine threads (default 1)")
    b.add_argument("--duration", type=float, help="seconds of arrivals (default 60, quick 15)")
    b.add_argument("--seed", type=int, default=0)
    _add_trace_options(b)
    b.add_argument("--tiers", type=Path, help="tiers TOML (default config/tiers.toml)")
    b.add_argument("--predictor", type=Path, help="predictor JSON from `tierflow calibrate`")
    b.add_argument("--quick", action="store_true", help="short run for CI smoke use")


def _add_bench_modes(b) -> None:
    """What the run measures, besides the plain side-by-side: each mode its own benchmark."""
    b.add_argument(
        "--batch",
        action="store_true",
        help="accepted for older command lines: every policy runs on batched workers (continuous "
        "decode batching, decode slotted into prefills by TBT target, SLO-aware packed "
        "prefill); requests produce outputs, and TBT is reported per tier",
    )
    b.add_argument(
        "--sustained",
        help="comma-separated multiples of the base rate: goodput at sustained rates, each a "
        "fresh Poisson workload with at least --min-critical critical requests (e.g. 0.5,1,2,3)",
    )
    b.add_argument(
        "--flood", action="store_true",
        help="one critical key floods the tier at 3x its measured capacity beside a calm key, "
        "under the shipped overflow rule, reject, and admission and fairness off (bench.flood)",
    )  # fmt: skip
    b.add_argument(
        "--scale", action="store_true",
        help="the scheduler's cost per decision on a simulated GPU fleet, in simulated time: "
        "4-64 workers behind one instance, then 64 workers over 2-8 instances (bench.scale)",
    )  # fmt: skip
    b.add_argument(
        "--tls", action="store_true",
        help="the TTFT mTLS adds through the whole stack over plaintext, in alternating stack "
        "starts (launch.tls_bench)",
    )  # fmt: skip
    b.add_argument("--flood-calm", type=int, help="the calm key's requests in --flood (200)")
    b.add_argument("--sustained-seeds", help="seeds of --sustained (default 0,1,2)")
    b.add_argument("--min-critical", type=int, help="critical requests per --sustained point (100)")
    b.add_argument(
        "--slo-sweep",
        help="comma-separated multiples of the top tier's isolated TTFT: the policies that plan "
        "by deadlines run again with that tier's SLO set to each (e.g. 1.5,2,3,5)",
    )


def _add_bench_outputs(b) -> None:
    """The workers' batching, the outputs, and where the results go."""
    b.add_argument("--kv-slots", type=int, help=f"KV slots per worker ({BatchConfig.pool_slots})")
    b.add_argument(
        "--max-batch-size",
        type=int,
        help=f"decode rows per step ({BatchConfig.max_batch_size}; 1: one request at a time)",
    )
    b.add_argument(
        "--max-new-tokens",
        type=int,
        help="longest output (synthetic: log-normal spread below it; traces: clip); default 128",
    )
    b.add_argument(
        "--stack", action="store_true",
        help="also run the workload through the local services and report the TTFT they add",
    )  # fmt: skip
    b.add_argument(
        "--event-log", type=Path, metavar="DIR",
        help="write each policy run's timeline here, one JSONL file a run (`tierflow misses`)",
    )  # fmt: skip
    b.add_argument("--json", type=Path)
    b.add_argument("--plot", type=Path)


def _add_trace_options(b: argparse.ArgumentParser) -> None:
    b.add_argument("--trace", type=Path, help="replay an Azure CSV or Mooncake JSONL trace")
    b.add_argument(
        "--trace-start",
        type=lambda text: tuple(float(x) for x in text.split(",")),
        default=(0.0,),
        help="window start in seconds; several, comma-separated: each window, then all together",
    )
    b.add_argument(
        "--time-scale",
        "--trace-time-scale",
        dest="trace_time_scale",
        type=float,
        default=1.0,
        help="stretch inter-arrival gaps of the trace or the synthetic mix (2 = half the rate)",
    )
    b.add_argument(
        "--trace-length-scale",
        type=float,
        default=1.0,
        help="multiply prompt lengths (then clipped to [8, 4096])",
    )
    b.add_argument(
        "--trace-output-scale",
        type=float,
        default=1.0,
        help="multiply output lengths (then clipped to [1, --max-new-tokens])",
    )
    b.add_argument(
        "--trace-critical-share",
        type=float,
        default=0.5,
        help="share of prompts <= 128 tokens that are critical",
    )


def _add_pool(sub) -> None:
    s = sub.add_parser(
        "pool",
        help="`tierflow bench` JSONs (seeds, trace windows) pooled: a tier's TTFT attainment "
        "against its SLO (1.2x-20x isolated TTFT) per policy, the lower tiers' throughput "
        "against fifo with a 95%% interval, and their sustained-rate points side by side",
    )
    s.add_argument("runs", type=Path, nargs="+", help="`tierflow bench --json` files")
    s.add_argument("--tier", default="critical")
    s.add_argument("--json", type=Path, help="write the pooled results here")
    s.add_argument("--plot", type=Path, help="write a PNG here")
    s.set_defaults(func=_pool)


def _add_misses(sub) -> None:
    m = sub.add_parser(
        "misses",
        help="what each request of a tier that missed its TTFT SLO waited for, from a "
        "`tierflow bench --event-log` timeline",
    )
    m.add_argument("log", type=Path, help="one JSONL file of `tierflow bench --event-log`")
    m.add_argument("--tier", default="critical")
    m.add_argument("--tiers", type=Path, help="the tiers file of the run (its SLO; default ours)")
    m.set_defaults(func=_misses)


def _misses(args: argparse.Namespace) -> int:
    from rich.console import Console

    from bench.misses import report
    from tierflow.tiers import load_tiers

    tiers = load_tiers(args.tiers)
    if args.tier not in tiers:
        raise SystemExit(f"unknown tier {args.tier!r}; known: {', '.join(tiers.names)}")
    report(args.log, args.tier, tiers[args.tier].ttft_slo_s, Console())
    return 0


def _add_calibrate(sub) -> None:
    c = sub.add_parser("calibrate", help="fit the prefill-time predictor on this model/device")
    c.add_argument("--model", default="bench-llama")
    c.add_argument("--device")
    c.add_argument("--chunk-size", type=int, default=EngineConfig.chunk_size)
    c.add_argument("--out", type=Path, default=Path("out/predictor.json"))
    c.set_defaults(func=_calibrate)


def _add_up(sub) -> None:
    up = sub.add_parser(
        "up", help="start Kafka, queue service, workers, gateway, OpenAI API and Envoy"
    )
    up.add_argument("--model", default=StackConfig.model)
    up.add_argument("--workers", type=int, default=StackConfig.workers)
    up.add_argument("--policy", default=StackConfig.policy)
    up.add_argument("--chunk-size", type=int, default=StackConfig.chunk_size)
    # A fixed port, unlike the stack's default (a free one): what `generate` dials by default.
    up.add_argument("--envoy-port", type=int, default=8080)
    up.add_argument("--no-edge", action="store_true", help="queue service only, no Envoy")
    up.add_argument("--log-dir", type=Path, default=StackConfig.log_dir)
    up.set_defaults(func=_up)


def _add_down(sub) -> None:
    down = sub.add_parser("down", help="stop the stack that `tierflow up` started")
    down.add_argument("--log-dir", type=Path, default=StackConfig.log_dir)
    down.set_defaults(func=_down)


def _add_certs(sub) -> None:
    from launch import certs

    c = sub.add_parser(
        "certs", help="create the local CA and the services' identities for mTLS (once)"
    )
    certs.add_arguments(c)
    c.set_defaults(func=certs.run)


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="send one request and stream its events")
    g.add_argument("prompt")
    g.add_argument("--target", default="127.0.0.1:8080", help="Envoy (or a queue service)")
    g.add_argument("--api-key", help="through the edge: the key decides the tier")
    g.add_argument("--tier", help="direct to a queue service (trusted header)")
    g.add_argument(
        "--tls-dir", type=Path,
        help="direct to a queue service over mTLS, as the operator (`tierflow certs`)",
    )  # fmt: skip
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--timeout", type=float, default=300.0)
    g.set_defaults(func=_generate)


def _add_soak(sub) -> None:
    s = sub.add_parser(
        "soak",
        help="mixed load through the stack for a while; fails on a lost request or memory "
        "that keeps growing",
    )
    # No defaults here: what is not given, SoakConfig decides.
    s.add_argument("--duration", type=float, help="seconds of load (default 600)")
    s.add_argument("--rate", type=float, help="requests per second, Poisson (default 2)")
    s.add_argument("--model", help="default: the stack's (smollm2)")
    s.add_argument("--workers", type=int)
    s.add_argument("--no-edge", action="store_true", help="straight to the queue service")
    s.add_argument("--log-dir", type=Path, help="default out/soak")
    s.add_argument("--json", type=Path, help="write the samples and the verdict here")
    s.set_defaults(func=_soak)


def _add_protoset(sub) -> None:
    p = sub.add_parser(
        "protoset",
        help="write the API's descriptor set, imports included (grpcurl -protoset, Envoy)",
    )
    p.add_argument("--out", type=Path, default=Path("out/tierflow.pb"))
    p.set_defaults(func=_protoset)


def _add_demo(sub) -> None:
    d = sub.add_parser("demo", help="the stack + a mixed-tier workload through Envoy (main job)")
    # No defaults here: what is not given, DemoConfig decides.
    d.add_argument("--model", help="default: the stack's (smollm2)")
    d.add_argument("--duration", type=float, help="seconds of arrivals (default 60)")
    d.add_argument("--out", type=Path, help="default out/")
    d.add_argument(
        "--canary", action="store_true",
        help="a canary rollout to a verdict (`tierflow canary run`: chunked vs flowprefill, "
        "--duration its time limit)",
    )  # fmt: skip
    d.add_argument("--canary-weight", type=int, help="percent to the canary (default 50)")
    d.set_defaults(func=_demo)


# The service processes parse their own arguments.
SERVICES = {
    "queue-service": "queue_service.server",
    "worker": "worker.cli",
    "gateway": "gateway.server",
    "openai-api": "openai_api.server",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICES:
        import importlib

        return importlib.import_module(SERVICES[argv[0]]).main(argv[1:])
    configure_logging()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
