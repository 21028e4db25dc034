"""The ``tierflow`` command line: one subcommand per job, each a thin wrapper over a module."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tierflow.logging import configure_logging


def _engine_bench(args: argparse.Namespace) -> int:
    from bench.engine_bench import EngineBenchConfig, main

    overrides = {
        k: v
        for k, v in {
            "model": args.model,
            "device": args.device,
            "prompt_tokens": args.prompt_tokens,
            "chunk_size": args.chunk_size,
        }.items()
        if v is not None
    }
    cfg = EngineBenchConfig.quick(**overrides) if args.quick else EngineBenchConfig(**overrides)
    main(cfg, args.json, args.plot)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from bench.policy_bench import PolicyBenchConfig, main
    from bench.traces import TraceOptions

    trace_opts = TraceOptions(
        start_s=args.trace_start,
        duration_s=args.duration if args.duration is not None else 60.0,
        time_scale=args.trace_time_scale,
        length_scale=args.trace_length_scale,
        critical_share=args.trace_critical_share,
        seed=args.seed,
    )
    overrides = {
        "model": args.model,
        "device": args.device,
        "policies": tuple(args.policies.split(",")) if args.policies else None,
        "chunk_size": args.chunk_size,
        "chunked_chunk_size": args.chunked_chunk_size,
        "workers": args.workers,
        "duration_s": args.duration,
        "seed": args.seed,
        "trace": args.trace,
        "trace_options": trace_opts,
        "tiers_file": args.tiers,
        "predictor_file": args.predictor,
        "sweep_factors": tuple(float(f) for f in args.sweep_factors.split(","))
        if args.sweep_rate
        else None,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    cfg = PolicyBenchConfig.quick(**overrides) if args.quick else PolicyBenchConfig(**overrides)
    main(cfg, args.json, args.plot)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from bench.calibrate import calibrate
    from worker.engine import EngineConfig, PrefillEngine
    from worker.models import load_model

    loaded = load_model(args.model, device=args.device)
    engine = PrefillEngine(loaded.model, EngineConfig(chunk_size=args.chunk_size))
    predictor = calibrate(engine)
    predictor.save(args.out)
    print(f"{predictor!r} -> {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    eb = sub.add_parser(
        "engine-bench",
        help="measure layer time, chunk-size cost, check overhead and preemption latency",
    )
    eb.add_argument("--model", help="preset name, local directory or hub id (default bench-llama)")
    eb.add_argument("--device", help="cuda, cpu, ... (default: cuda when present)")
    eb.add_argument("--prompt-tokens", type=int)
    eb.add_argument("--chunk-size", type=int, help="C for the latency comparison (default 2048)")
    eb.add_argument("--quick", action="store_true", help="smaller prompt and fewer samples")
    eb.add_argument("--json", type=Path, help="write the results here")
    eb.add_argument("--plot", type=Path, help="write a PNG here")
    eb.set_defaults(func=_engine_bench)

    b = sub.add_parser("bench", help="compare scheduling policies on the same arrivals")
    b.add_argument("--model", help="default bench-llama")
    b.add_argument("--device")
    b.add_argument("--policies", help="comma-separated; default all five")
    b.add_argument("--chunk-size", type=int, help="engine chunk for all but chunked (2048)")
    b.add_argument("--chunked-chunk-size", type=int, help="C of the chunked baseline (512)")
    b.add_argument("--workers", type=int, help="engine threads (default 1)")
    b.add_argument("--duration", type=float, help="seconds of arrivals (default 60, quick 15)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--trace", type=Path, help="replay an Azure CSV or Mooncake JSONL trace")
    b.add_argument("--trace-start", type=float, default=0.0, help="window start, seconds")
    b.add_argument(
        "--trace-time-scale",
        type=float,
        default=1.0,
        help="stretch inter-arrival gaps (2 = half the rate)",
    )
    b.add_argument(
        "--trace-length-scale",
        type=float,
        default=1.0,
        help="multiply prompt lengths (then clipped to [8, 4096])",
    )
    b.add_argument(
        "--trace-critical-share",
        type=float,
        default=0.5,
        help="share of prompts <= 128 tokens that are critical",
    )
    b.add_argument("--tiers", type=Path, help="tiers TOML (default config/tiers.toml)")
    b.add_argument("--predictor", type=Path, help="predictor JSON from `tierflow calibrate`")
    b.add_argument("--sweep-rate", action="store_true", help="also find each policy's goodput")
    b.add_argument(
        "--sweep-factors",
        default="0.5,0.75,1,1.5,2,3",
        help="arrival-rate multipliers tried by --sweep-rate",
    )
    b.add_argument("--quick", action="store_true", help="short run for CI smoke use")
    b.add_argument("--json", type=Path)
    b.add_argument("--plot", type=Path)
    b.set_defaults(func=_bench)

    c = sub.add_parser("calibrate", help="fit the prefill-time predictor on this model/device")
    c.add_argument("--model", default="bench-llama")
    c.add_argument("--device")
    c.add_argument("--chunk-size", type=int, default=2048)
    c.add_argument("--out", type=Path, default=Path("out/predictor.json"))
    c.set_defaults(func=_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
