"""`tierflow engine-bench`: what layer-boundary preemption costs and what it buys, in one run.

Measured on the machine it runs on, as ratios inside the run (machines here are noisy):
- time per decoder layer for a large chunk (forward hooks around each layer);
- whole-prefill time for several chunk sizes C against the whole-prompt time (the efficiency
  cost of small chunks, the price chunked prefill pays for responsiveness);
- the overhead of the preemption checks: the cost of one check times the checks per prefill,
  over the prefill time, and an end-to-end A/B of check="layer" against check="none", repeated
  in pairs until the 95% interval of the difference is narrower than +-0.5% (or said to be not
  measurable above noise when it is not, after ``ab_max_pairs``);
- preemption latency (flag raised on another thread -> the engine has returned) when checking
  at layer boundaries versus only at chunk boundaries, at the chunked baseline's C=512 and at
  C=2048. The flag is raised at a uniformly random time over the whole prefill, so the
  chunk-boundary tail is a chunk's time; a flag raised during the last chunk of a chunk-only run
  is honoured only when prefill ends: that is the wait a premium request would see, so it counts.
"""

from __future__ import annotations

import queue
import random
import statistics
import threading
import time
import timeit
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.metrics import mean_interval, percentile
from bench.report import finish, latency_cdf_axis, save_figure
from bench.tables import print_table
from worker.batch_engine import BatchEngine
from worker.batch_runner import BatchRunner
from worker.config import BatchConfig
from worker.engine import EngineConfig, PrefillEngine, RunStatus
from worker.preemption import PreemptionChannel
from worker.request import GenerationRequest


@dataclass(frozen=True)
class EngineBenchConfig:
    model: str = "bench-llama"
    prompt_tokens: int = 4096
    chunk_size: int = EngineConfig.chunk_size  # the C of the layer times and the check A/B
    chunk_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    # The Cs of the layer-vs-chunk latency comparison: the chunked baseline's, and a large one.
    latency_chunk_sizes: tuple[int, ...] = (512, 2048)
    repeats: int = 3  # timed prefills per configuration (median is reported)
    latency_samples: int = 20  # per check granularity and C
    # The check A/B: pairs of prefills (layer, none) until the 95% interval of the mean
    # difference is narrower than +-ab_target_pct, at least ab_min_pairs, at most ab_max_pairs.
    ab_target_pct: float = 0.5
    ab_min_pairs: int = 6
    ab_max_pairs: int = 40
    seed: int = 0
    device: str | None = None
    smoke: bool = False  # a quick run: said in the output and the JSON

    @classmethod
    def quick(cls, **overrides) -> EngineBenchConfig:
        base = dict(
            prompt_tokens=2048,
            chunk_size=1024,
            chunk_sizes=(256, 1024),
            latency_chunk_sizes=(1024,),
            repeats=1,
            latency_samples=8,
            ab_min_pairs=2,
            ab_max_pairs=2,
            smoke=True,
        )
        return cls(**{**base, **overrides})


class LayerTimer:
    """Wall time of every decoder-layer call, via forward hooks (synchronising on CUDA)."""

    def __init__(self, layers, device: torch.device) -> None:
        self.times: list[float] = []
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self._start = 0.0
        self._handles = []
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(self._before))
            self._handles.append(layer.register_forward_hook(self._after))

    def _before(self, module, args):
        self._sync()
        self._start = time.perf_counter()

    def _after(self, module, args, output):
        self._sync()
        self.times.append(time.perf_counter() - self._start)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def timed_prefill(engine: PrefillEngine, ids: tuple[int, ...]) -> float:
    task = engine.new_task(GenerationRequest("bench", ids))
    start = time.perf_counter()
    outcome = engine.run(task, PreemptionChannel())
    assert outcome.status is RunStatus.FINISHED
    return time.perf_counter() - start


def preemption_latency(
    engine: PrefillEngine, ids: tuple[int, ...], delay_s: float
) -> tuple[float, RunStatus] | None:
    """Raise the flag from another thread after ``delay_s``; seconds until run() returned.

    None when the prefill ended before the flag was raised: there was nothing to preempt, and
    such a run says nothing about preemption latency."""
    channel = PreemptionChannel()
    task = engine.new_task(GenerationRequest("victim", ids))
    raised_at: list[float] = []
    returned = threading.Event()

    def raise_flag() -> None:
        if not returned.wait(delay_s):  # still running after the delay
            raised_at.append(time.perf_counter())
            channel.preempt()

    thread = threading.Thread(target=raise_flag, daemon=True)
    thread.start()
    outcome = engine.run(task, channel)
    returned_at = time.perf_counter()
    returned.set()
    thread.join()
    if outcome.status is RunStatus.PREEMPTED:
        engine.cancel(task)  # frees the suspended state; resuming is measured elsewhere
    if not raised_at or raised_at[0] > returned_at:
        return None
    return returned_at - raised_at[0], outcome.status


def per_check_seconds() -> float:
    """Cost of the exact expression the layer loop evaluates at a boundary."""
    channel = PreemptionChannel()
    n = 2_000_000
    loop = timeit.timeit("channel.signal is not None", globals={"channel": channel}, number=n)
    empty = timeit.timeit("pass", number=n)
    return max(loop - empty, 0.0) / n


def per_progress_report_seconds(model, ids: tuple[int, ...]) -> float:
    """Cost, on the engine thread, of one per-layer progress report: the runner's own
    listener building the event and putting it on a queue, as in the services and the bench."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    engine = BatchEngine(model, batch=BatchConfig(max_batch_size=1, pool_slots=1))
    runner = BatchRunner(engine, events.put)  # not started: only its listener is timed
    task = engine.new_task(GenerationRequest("progress", ids))
    n = 50_000
    start = time.perf_counter()
    for _ in range(n):
        runner.listener.on_layers_done(task, 0, 1)
    return (time.perf_counter() - start) / n


def run_engine_bench(cfg: EngineBenchConfig, console: Console | None = None) -> dict:
    from worker.models import load_model

    console = console or Console()
    loaded = load_model(cfg.model, device=cfg.device)
    model = loaded.model
    rng = random.Random(cfg.seed)
    ids = tuple(rng.randrange(3, model.config.vocab_size) for _ in range(cfg.prompt_tokens))
    sizes = _measured_chunk_sizes(cfg)
    engine_for = {
        (c, check): PrefillEngine(model, EngineConfig(chunk_size=c, check=check))
        for c in (*sizes, cfg.chunk_size, None)
        for check in ("layer", "chunk", "none")
    }
    n_prefills = 1 + (len(sizes) + 1) * cfg.repeats + 2 * cfg.ab_min_pairs
    n_latency = 2 * len(cfg.latency_chunk_sizes) * cfg.latency_samples
    with Progress(console=console, transient=True) as progress:
        bar = progress.add_task(f"engine-bench {loaded.name}", total=n_prefills + n_latency)

        def advance() -> None:
            progress.advance(bar)

        timed_prefill(engine_for[(None, "layer")], ids[:256])  # warm-up: allocations, kernels
        layer_times = _layer_times(engine_for[(cfg.chunk_size, "layer")], ids)
        advance()
        whole_time, prefill_s = _prefill_times(engine_for, cfg, ids, advance)
        overhead = _check_overhead(engine_for, cfg, ids, len(model.model.layers), advance)
        report_s = per_progress_report_seconds(model, ids)
        latency = {
            str(c): {
                check: _preemption_latencies(
                    engine_for[(c, check)], cfg, ids, prefill_s[c], rng, advance
                )
                for check in ("layer", "chunk")
            }
            for c in cfg.latency_chunk_sizes
        }
    return {
        "model": loaded.name,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "layers": len(model.model.layers),
        "prompt_tokens": cfg.prompt_tokens,
        "chunk_size": cfg.chunk_size,
        "layer_time_ms": {
            "mean": statistics.fmean(layer_times) * 1000,
            "max": max(layer_times) * 1000,
            "n": len(layer_times),
        },
        "whole_prompt_prefill_ms": whole_time * 1000,
        "chunk_cost": {str(c): prefill_s[c] / whole_time for c in cfg.chunk_sizes},
        "check_overhead_pct": overhead["overhead"] * 100,
        "check_overhead_ab": overhead["ab"],
        "check_cost_ns": overhead["check_cost_s"] * 1e9,
        "checks_per_prefill": overhead["checks_per_prefill"],
        # One report per layer (progress_every_layers=1): its cost against the mean layer.
        "progress_report_us": report_s * 1e6,
        "progress_report_pct_of_layer": report_s / statistics.fmean(layer_times) * 100,
        # Per C, then per check granularity.
        "preemption_latency_ms": latency,
    }


def _measured_chunk_sizes(cfg: EngineBenchConfig) -> tuple[int, ...]:
    return tuple(sorted({*cfg.chunk_sizes, *cfg.latency_chunk_sizes}))


def _layer_times(engine: PrefillEngine, ids: tuple[int, ...]) -> list[float]:
    """Wall time of every decoder-layer call during one whole prefill."""
    timer = LayerTimer(engine.layers, engine.device)
    try:
        timed_prefill(engine, ids)
    finally:
        timer.remove()
    return timer.times


def _prefill_times(engine_for, cfg: EngineBenchConfig, ids, advance) -> tuple[float, dict]:
    """Whole-prompt prefill time, and each chunk size's prefill time (medians).
    Configurations are interleaved so that drift hits all of them alike."""
    times: dict[int | None, list[float]] = {c: [] for c in (*_measured_chunk_sizes(cfg), None)}
    for _ in range(cfg.repeats):
        for c in times:
            times[c].append(timed_prefill(engine_for[(c, "layer")], ids))
            advance()
    medians = {c: statistics.median(t) for c, t in times.items()}
    return medians.pop(None), medians


def _check_overhead(engine_for, cfg: EngineBenchConfig, ids, n_layers: int, advance) -> dict:
    """The preemption check's cost: estimated (checks x cost of one), and an end-to-end A/B
    of layer checks against none at the benchmark chunk size."""
    ab = check_ab(
        engine_for[(cfg.chunk_size, "layer")], engine_for[(cfg.chunk_size, "none")], ids, cfg,
        advance,
    )  # fmt: skip
    checks_per_prefill = -(-cfg.prompt_tokens // cfg.chunk_size) * n_layers
    check_cost_s = per_check_seconds()
    return {
        "ab": ab,
        "checks_per_prefill": checks_per_prefill,
        "check_cost_s": check_cost_s,
        "overhead": checks_per_prefill * check_cost_s / ab["prefill_none_ms"] * 1000,
    }


def check_ab(checked: PrefillEngine, unchecked: PrefillEngine, ids, cfg, advance) -> dict:
    """Pairs of prefills, checked and unchecked (their order alternating, so that drift within
    a pair cancels over pairs), until the 95% interval of the mean relative difference is
    narrower than +-``ab_target_pct`` or ``ab_max_pairs`` were run."""
    diffs, unchecked_s = [], []
    while len(diffs) < cfg.ab_max_pairs:
        pair = (checked, unchecked) if len(diffs) % 2 == 0 else (unchecked, checked)
        times = {id(engine): timed_prefill(engine, ids) for engine in pair}
        diffs.append(times[id(checked)] / times[id(unchecked)] - 1)
        unchecked_s.append(times[id(unchecked)])
        advance()
        if len(diffs) >= max(cfg.ab_min_pairs, 2) and _within_target(diffs, cfg.ab_target_pct):
            break
    low, high = mean_interval(diffs)
    measurable = _within_target(diffs, cfg.ab_target_pct)
    return {
        "mean_pct": statistics.fmean(diffs) * 100,
        "ci95_pct": [low * 100, high * 100],
        "pairs": len(diffs),
        "target_half_width_pct": cfg.ab_target_pct,
        # False: after ab_max_pairs the interval is still wider than the target; the overhead
        # is not measurable above this machine's noise.
        "measurable": measurable,
        "prefill_none_ms": statistics.median(unchecked_s) * 1000,
    }


def _within_target(diffs: list[float], target_pct: float) -> bool:
    """The 95% interval of the mean difference is narrower than +-``target_pct``."""
    low, high = mean_interval(diffs)
    return (high - low) / 2 * 100 < target_pct


def _preemption_latencies(
    engine: PrefillEngine, cfg: EngineBenchConfig, ids, prefill_s: float, rng, advance
) -> dict:
    samples, finished = [], 0
    while len(samples) < cfg.latency_samples:
        # Uniform over the whole prefill: a flag can land anywhere in a layer or chunk, the
        # last chunk included. Runs that ended before the flag was raised are drawn again.
        delay = rng.uniform(0.0, 1.0) * prefill_s
        measured = preemption_latency(engine, ids, delay)
        if measured is None:
            continue
        seconds, status = measured
        samples.append(seconds * 1000)
        finished += status is RunStatus.FINISHED
        advance()
    return {
        "p50": percentile(samples, 50),
        "p99": percentile(samples, 99),
        "n": len(samples),
        "ran_to_completion": finished,
        "samples_ms": samples,
    }


def render_table(result: dict, console: Console) -> None:
    lt = result["layer_time_ms"]
    head = Table(title=f"engine-bench: {result['model']} on {result['device']} ({result['dtype']})")
    head.add_column("measure")
    head.add_column("value", justify="right")
    head.add_row("layers", str(result["layers"]))
    head.add_row("prompt tokens", str(result["prompt_tokens"]))
    head.add_row(
        f"layer time, C={result['chunk_size']} (mean / max)",
        f"{lt['mean']:.1f} / {lt['max']:.1f} ms",
    )
    head.add_row("whole-prompt prefill", f"{result['whole_prompt_prefill_ms']:.0f} ms")
    for c, ratio in result["chunk_cost"].items():
        head.add_row(f"prefill time, C={c} / whole prompt", f"{ratio:.3f}x")
    head.add_row(
        "check overhead (cost x checks / prefill)",
        f"{result['check_overhead_pct']:.5f} % ({result['check_cost_ns']:.0f} ns x "
        f"{result['checks_per_prefill']})",
    )
    head.add_row("check overhead, end-to-end A/B layer vs none", ab_verdict(result))
    head.add_row(
        "per-layer progress report (cost / share of a layer)",
        f"{result['progress_report_us']:.1f} us / {result['progress_report_pct_of_layer']:.4f} %",
    )
    print_table(console, head)

    table = Table(title="preemption latency (flag at a uniformly random time -> engine returned)")
    for col in ("C", "checked at", "p50 ms", "p99 ms", "n", "ran to the end", "p99 / max layer"):
        table.add_column(col, justify="right")
    for c, by_check in result["preemption_latency_ms"].items():
        for check, row in by_check.items():
            table.add_row(
                c, check + " boundaries", f"{row['p50']:.1f}", f"{row['p99']:.1f}",
                str(row["n"]), str(row["ran_to_completion"]), f"{row['p99'] / lt['max']:.2f}x",
            )  # fmt: skip
    print_table(console, table)
    for c, lat in result["preemption_latency_ms"].items():
        console.print(
            f"C={c}: layer-boundary preemption is {lat['chunk']['p50'] / lat['layer']['p50']:.1f}x "
            f"faster at p50 and {lat['chunk']['p99'] / lat['layer']['p99']:.1f}x at p99 than "
            "chunk-boundary-only preemption"
        )


def ab_verdict(result: dict) -> str:
    ab = result["check_overhead_ab"]
    low, high = ab["ci95_pct"]
    interval = f"95% CI {low:+.2f}..{high:+.2f} %, {ab['pairs']} pairs"
    if not ab["measurable"]:
        return f"not measurable above noise ({interval})"
    return f"{ab['mean_pct']:+.2f} % ({interval})"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    sizes = list(result["chunk_cost"])
    positions = range(len(sizes))  # chunk sizes as categories, not as a numeric axis
    left.bar(positions, [result["chunk_cost"][s] for s in sizes], color="tab:blue")
    left.set_xticks(list(positions), sizes)
    left.axhline(1.0, color="gray", linestyle="--", label="whole prompt")
    left.set_xlabel("chunk size C (tokens)")
    left.set_ylabel("prefill time / whole-prompt time")
    left.set_title("efficiency cost of small chunks")
    left.legend()
    styles = {"layer": "tab:green", "chunk": "tab:red"}
    for i, (c, by_check) in enumerate(result["preemption_latency_ms"].items()):
        for check, row in by_check.items():
            samples = sorted(row["samples_ms"])
            ys = [(k + 1) / len(samples) for k in range(len(samples))]
            right.step(
                samples, ys, where="post", color=styles[check], linestyle=("-", "--", ":")[i % 3],
                label=f"C={c}, checked at {check} boundaries",
            )  # fmt: skip
    right.axvline(
        result["layer_time_ms"]["max"], color="gray", linestyle=":", label="largest layer time"
    )
    latency_cdf_axis(right, "preemption latency, flag at a random time")
    right.legend(loc="lower right")
    fig.suptitle(f"{result['model']} on {result['device']}, {result['prompt_tokens']}-token prompt")
    save_figure(fig, path)


def main(cfg: EngineBenchConfig, json_path: Path | None, png_path: Path | None) -> dict:
    console = Console()
    result = run_engine_bench(cfg, console)
    return finish(
        result, smoke=cfg.smoke, json_path=json_path, png_path=png_path,
        render=render_table, plot=plot, console=console,
    )  # fmt: skip
