"""The benchmark's tables as printed: every header whole at 80 columns (a file, a pipe or a
narrow terminal), and a run through the services (no in-process predictor) printed at all."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from bench.report import render_policy_tables

HEADERS = (
    "policy", "tier", "done", "rej", "SLO ms", "SLO met", "p50 ms", "p90 ms", "p99 ms",
    "isolated ms", "TBT p50/p99 ms", "TBT met", "engine", "throughput tok/s", "busy",
    "preemptions", "recomputes", "preempt latency p50/p99 ms", "lost", "ran as",
    "speed probe ms", "completed tok/s", "lower tiers tok/s", "output tok/s", "rows/step",
    "packs (requests)", "decode pauses / drops", "predictor |err| p50 / p95 (n)",
    "decide us/event", "progress events",
)  # fmt: skip


def tier(n: int = 4) -> dict:
    return {
        "n": n, "completed": n, "rejected": 0, "slo_ms": 300.0, "slo_attainment": 0.75,
        "ttft_ms": {"p50": 120.0, "p90": 280.0, "p99": 910.0},
        "tbt_ms": {"p50": 40.0, "p99": 90.0}, "tbt_attainment": 1.0,
    }  # fmt: skip


def policy(prediction_error: dict) -> dict:
    return {
        "tiers": {"critical": tier(), "standard": tier(), "batch": tier()},
        "engine": {"chunk_size": 2048, "check": "layer"},
        "throughput_tok_s": 5123.0, "busy_fraction": 0.97, "preemptions": 12, "recomputes": 0,
        "preemption_latency_ms": {"p50": 24.7, "p99": 42.9}, "lost": 0, "run_position": 2,
        "speed_probe_ms": 311.0, "completed_tok_s": 4800.0, "lower_tier_completed_tok_s": 4100.0,
        "output_tok_s": 31.5, "decode": {"mean_rows": 3.2}, "packs": 4, "packed_requests": 11,
        "decode_pauses": 2, "decode_drops": 0, "prediction_error": prediction_error,
        "scheduler": {"decide_us_per_event": 85.0, "progress_events": 1234},
    }  # fmt: skip


def bench_result() -> dict:
    measured = {"n": 40, "abs_p50": 0.08, "abs_p95": 0.31, "bias_p50": 0.01}
    return {
        "model": "bench-llama", "device": "cpu", "workload": "synthetic mix", "requests": 12,
        "isolated_ttft_ms": {"critical": 100.0, "standard": 400.0, "batch": 2500.0},
        "policies": {
            "chunked": policy(measured),
            "flowprefill": policy(measured),
            "flowprefill@stack": policy({}),  # bench --stack: the harness's empty default
        },
    }  # fmt: skip


def printed(result: dict, width: int) -> str:
    console = Console(file=io.StringIO(), width=width)
    render_policy_tables(result, console)
    return console.file.getvalue()


def test_a_stack_run_without_a_predictor_prints_a_dash():
    # The regression: `bench --stack` printed its tables, then KeyError: 'abs_p50'.
    lines = [line for line in printed(bench_result(), 400).splitlines() if "@stack" in line]
    cells = [cell.strip() for cell in lines[-1].split("│")]  # the rates table's row
    assert cells[8] == "-"  # the predictor's column


@pytest.mark.parametrize("width", [80, 200])
def test_every_header_is_whole_at_any_width(width):
    text = printed(bench_result(), width)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text
    for header in HEADERS:
        assert header in text, header
    assert text.count("flowprefill@stack") >= 3  # every row in every part


def test_the_demo_table_keeps_every_header_at_80_columns():
    from launch.demo import _print

    report = {
        "model": "smollm2", "workload": "mixed tiers, 60 s",
        "policies": {"flowprefill": {"tiers": {
            name: {**tier(), "failed": 0, "preemptions": 3} for name in ("critical", "batch")
        }}},
        "critical_answers": [],
    }  # fmt: skip
    console = Console(file=io.StringIO(), width=80)
    _print(report, console)
    text = console.file.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for header in ("tier", "rejected", "failed", "SLO met", "TTFT p50 ms", "TTFT p99 ms",
                   "preemptions"):  # fmt: skip
        assert header in text, header
