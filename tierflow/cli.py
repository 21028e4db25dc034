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
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
