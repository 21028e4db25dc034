"""What the small engine benches share: one short prompt timed in a few ways, in rounds.

`tierflow engine-bench --threads` (``bench.thread_bench``: where the engine runs) and
`--idle` (``bench.idle_bench``: what comes before the prompt) each time a lone short prompt in
a few ways, a few samples a way per round, in an order that rotates from round to round so
that the machine's drift cancels. They report each way's times and the ratios of the rounds'
medians between ways, with 95 % intervals over the rounds.
"""

from __future__ import annotations

import queue
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.metrics import mean_interval
from bench.report import save_figure
from worker.batch_runner import BatchRunner
from worker.events import Finished, FirstToken
from worker.request import GenerationRequest


def rotated(ways: tuple[str, ...], round_: int) -> tuple[str, ...]:
    """The ways in round ``round_``'s order: every way in every position over len(ways)."""
    k = round_ % len(ways)
    return ways[k:] + ways[:k]


def first_token_s(runner: BatchRunner, events: queue.Queue, request: GenerationRequest) -> float:
    """Seconds from assigning ``request`` to its first token; waits until it finished."""
    started = time.perf_counter()
    runner.assign(request)
    first = None
    while not isinstance(event := events.get(timeout=60), Finished):
        if isinstance(event, FirstToken):
            first = event.at
    return (first or event.at) - started


def ratio(numerators: list[float], denominators: list[float]) -> dict:
    """The mean of the per-round ratios, with its 95 % interval over the rounds."""
    per_round = [a / b for a, b in zip(numerators, denominators, strict=True)]
    low, high = mean_interval(per_round) if len(per_round) > 1 else (per_round[0],) * 2
    return {"mean": statistics.fmean(per_round), "ci95": [low, high], "n": len(per_round)}


def times_ms(samples: dict[str, list[float]]) -> dict:
    """Each way's samples (ms) with their median and minimum."""
    return {
        way: {"median": statistics.median(v), "min": min(v), "samples": v}
        for way, v in samples.items()
    }


def render(result: dict, console: Console, title: str, way_column: str) -> None:
    table = Table(title=title)
    for col in (way_column, "median ms", "min ms", "n"):
        table.add_column(col, justify="right")
    for way, ms in result["ms"].items():
        table.add_row(way, f"{ms['median']:.1f}", f"{ms['min']:.1f}", str(len(ms["samples"])))
    console.print(table)
    ratios = Table(title="ratios of the rounds' medians (mean, 95 % interval over rounds)")
    for col in ("ratio", "mean", "95% interval", "n"):
        ratios.add_column(col, justify="right")
    for name, r in result["ratios"].items():
        low, high = r["ci95"]
        ratios.add_row(name, f"{r['mean']:.2f}x", f"{low:.2f}-{high:.2f}", str(r["n"]))
    console.print(ratios)


def plot(result: dict, path: Path, xlabel: str, title: str) -> None:
    from bench.report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(result["ms"])
    ax.boxplot(
        [result["ms"][n]["samples"] for n in names], orientation="horizontal", tick_labels=names
    )
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    save_figure(fig, path)
