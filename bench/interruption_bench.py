"""`tierflow engine-bench --blocks`: interruption points bounded in time, measured.

For each chunk size C (the chunked baseline's 512, the default 2048, and the whole prompt):
- preemption latency: a flag raised from another thread at a uniformly random time, until the
  engine has returned, with stops between row blocks (``check="block"``) and, for comparison,
  at layer boundaries only (``"layer"``). One prefill gives many samples: after each stop the
  prefill resumes at once and the next flag comes after a fresh random delay, so flags land
  uniformly within blocks and layers; the resumed prefill's first-token logits are checked
  against an uninterrupted one (exact resume, every run);
- prefill slowdown from the blocks: pairs of the same prefill with row blocks and unsplit
  (operators whole), their order alternating so drift cancels; the mean ratio with its 95 %
  interval.
The budget is the engine's (``EngineConfig.preempt_budget_ms``) unless given. Ratios inside
one run, as everywhere here: machines drift.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.metrics import mean_interval, percentile
from bench.report import finish, latency_cdf_axis, save_figure
from worker.batch_engine import BatchEngine
from worker.config import BatchConfig, EngineConfig
from worker.engine import RunStatus
from worker.preemption import PreemptionChannel
from worker.request import GenerationRequest

WHOLE = "whole"  # the whole prompt as one chunk


@dataclass(frozen=True)
class InterruptionBenchConfig:
    model: str = "bench-llama"
    prompt_tokens: int = 4096
    chunk_sizes: tuple[int | None, ...] = (512, 2048, None)
    budget_ms: float = EngineConfig.preempt_budget_ms or 25.0
    latency_samples: int = 100  # per C and check
    # Flags come after a random delay of up to this share of the unsplit prefill's time, so a
    # prefill gives several samples.
    max_delay_share: float = 0.1
    slowdown_pairs: int = 10  # per C
    checks: tuple[str, ...] = ("block", "layer")
    seed: int = 0
    device: str | None = None
    smoke: bool = False

    @classmethod
    def quick(cls, **overrides) -> InterruptionBenchConfig:
        base = dict(
            prompt_tokens=1024,
            chunk_sizes=(512, None),
            latency_samples=10,
            slowdown_pairs=2,
            smoke=True,
        )
        return cls(**{**base, **overrides})


def _engine(model, cfg: InterruptionBenchConfig, chunk: int | None, check: str) -> BatchEngine:
    budget = cfg.budget_ms if check == "block" else None
    config = EngineConfig(chunk_size=chunk, check=check, preempt_budget_ms=budget)
    return BatchEngine(model, config, BatchConfig(1, 1, slot_tokens=cfg.prompt_tokens + 2))


def _request(ids: tuple[int, ...]) -> GenerationRequest:
    return GenerationRequest("bench", ids, max_new_tokens=2)


class FirstLogits:
    """An engine listener that keeps the first token's logits."""

    logits: torch.Tensor | None = None

    def on_chunk_done(self, task, tokens_done):
        pass

    def on_layers_done(self, task, chunk, layers_done):
        pass

    def on_first_token(self, task, token_id, logits):
        self.logits = logits.clone()

    def on_token(self, task, token_id):
        pass


def timed_prefill(engine: BatchEngine, ids: tuple[int, ...]) -> tuple[float, torch.Tensor]:
    """Seconds of one uninterrupted prefill, and its first token's logits."""
    task, first = engine.new_task(_request(ids)), FirstLogits()
    start = time.perf_counter()
    outcome = engine.prefill(task, PreemptionChannel(), first)
    seconds = time.perf_counter() - start
    assert outcome.status is RunStatus.PREFILLED
    engine.cancel(task)
    return seconds, first.logits


def _raise_after(channel, delay_s: float, returned: threading.Event, raised_at: list) -> None:
    """Raise the flag after ``delay_s`` unless the run returned first; note when."""
    if not returned.wait(delay_s):
        raised_at.append(time.perf_counter())
        channel.preempt()


def interrupted_prefill(
    engine: BatchEngine, ids, max_delay_s: float, rng: random.Random
) -> tuple[list[float], torch.Tensor]:
    """One prefill stopped again and again: a flag after a random delay, the stop, an
    immediate resume. Returns the latencies (seconds) and the first-token logits; a flag that
    came after the prefill ended had nothing to stop and is no sample."""
    task, first, channel = engine.new_task(_request(ids)), FirstLogits(), PreemptionChannel()
    latencies = []
    while True:
        raised_at: list[float] = []
        returned = threading.Event()
        delay = rng.uniform(0.0, max_delay_s)
        thread = threading.Thread(
            target=_raise_after, args=(channel, delay, returned, raised_at), daemon=True
        )
        thread.start()
        outcome = engine.prefill(task, channel, first)
        returned_at = time.perf_counter()
        returned.set()
        thread.join()
        if outcome.status is RunStatus.PREEMPTED:
            latencies.append(returned_at - raised_at[0])
            continue
        channel.clear()
        engine.cancel(task)
        return latencies, first.logits


def _latencies(model, cfg, ids, chunk, check, unsplit_s, reference, rng) -> dict:
    engine = _engine(model, cfg, chunk, check)
    timed_prefill(engine, ids)  # warm-up: the planner learns the operators' costs
    samples, max_error, prefills = [], 0.0, 0
    while len(samples) < cfg.latency_samples:
        got, logits = interrupted_prefill(engine, ids, unsplit_s * cfg.max_delay_share, rng)
        samples += [s * 1000 for s in got]
        max_error = max(max_error, float((logits - reference).abs().max()))
        prefills += 1
    return {
        "p50_ms": percentile(samples, 50),
        "p99_ms": percentile(samples, 99),
        "max_ms": max(samples),
        "n": len(samples),
        "prefills": prefills,
        "max_abs_logit_error": max_error,
        "samples_ms": samples,
    }


def _slowdown(model, cfg, ids, chunk) -> tuple[dict, float, torch.Tensor]:
    """Pairs of (blocked, unsplit) prefills; the ratio's mean and 95 % interval."""
    blocked, unsplit = _engine(model, cfg, chunk, "block"), _engine(model, cfg, chunk, "layer")
    timed_prefill(blocked, ids)
    _, reference = timed_prefill(unsplit, ids)
    ratios, unsplit_s = [], []
    for i in range(cfg.slowdown_pairs):
        pair = (blocked, unsplit) if i % 2 == 0 else (unsplit, blocked)
        seconds = {id(engine): timed_prefill(engine, ids)[0] for engine in pair}
        ratios.append(seconds[id(blocked)] / seconds[id(unsplit)])
        unsplit_s.append(seconds[id(unsplit)])
    low, high = mean_interval(ratios) if len(ratios) > 1 else (ratios[0], ratios[0])
    result = {
        "mean": statistics.fmean(ratios),
        "ci95": [low, high],
        "pairs": len(ratios),
        "unsplit_ms": statistics.median(unsplit_s) * 1000,
        "ratios": ratios,
    }
    return result, statistics.median(unsplit_s), reference


def run_interruption_bench(cfg: InterruptionBenchConfig, console: Console) -> dict:
    from worker.models import load_model

    loaded = load_model(cfg.model, device=cfg.device)
    model = loaded.model
    rng = random.Random(cfg.seed)
    ids = tuple(rng.randrange(3, model.config.vocab_size) for _ in range(cfg.prompt_tokens))
    by_chunk = {}
    for chunk in cfg.chunk_sizes:
        name = str(chunk or WHOLE)
        console.print(f"C={name}: slowdown pairs, then preemption latency", style="dim")
        slowdown, unsplit_s, reference = _slowdown(model, cfg, ids, chunk)
        latency = {
            check: _latencies(model, cfg, ids, chunk, check, unsplit_s, reference, rng)
            for check in cfg.checks
        }
        by_chunk[name] = {"slowdown": slowdown, "latency": latency}
    return {
        "model": loaded.name,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "layers": len(model.model.layers),
        "prompt_tokens": cfg.prompt_tokens,
        "budget_ms": cfg.budget_ms,
        "threads": torch.get_num_threads(),
        "by_chunk": by_chunk,
    }


def render_table(result: dict, console: Console) -> None:
    budget = result["budget_ms"]
    table = Table(
        title=f"interruption points: {result['model']}, {result['prompt_tokens']}-token prompt, "
        f"budget {budget:g} ms"
    )
    for col in ("C", "stops at", "p50 ms", "p99 ms", "n", "p99/budget", "logit err"):
        table.add_column(col, justify="right")
    for chunk, row in result["by_chunk"].items():
        for check, lat in row["latency"].items():
            table.add_row(
                chunk, check, f"{lat['p50_ms']:.1f}", f"{lat['p99_ms']:.1f}", str(lat["n"]),
                f"{lat['p99_ms'] / budget:.2f}x", f"{lat['max_abs_logit_error']:.1e}",
            )  # fmt: skip
    console.print(table)
    slow = Table(title="prefill time with row blocks / unsplit (pairs, alternating order)")
    for col in ("C", "unsplit ms", "ratio", "95% interval", "pairs"):
        slow.add_column(col, justify="right")
    for chunk, row in result["by_chunk"].items():
        s = row["slowdown"]
        low, high = s["ci95"]
        slow.add_row(
            chunk, f"{s['unsplit_ms']:.0f}", f"{s['mean']:.3f}x", f"{low:.3f}-{high:.3f}",
            str(s["pairs"]),
        )  # fmt: skip
    console.print(slow)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    styles = {"block": "-", "layer": "--"}
    for chunk, row in result["by_chunk"].items():
        for check, lat in row["latency"].items():
            samples = sorted(lat["samples_ms"])
            ys = [(k + 1) / len(samples) for k in range(len(samples))]
            ax.step(samples, ys, where="post", linestyle=styles.get(check, ":"),
                    label=f"C={chunk}, {check}")  # fmt: skip
    ax.axvline(result["budget_ms"], color="gray", linestyle=":", label="budget")
    latency_cdf_axis(ax, f"{result['model']}: stops between row blocks vs at layer boundaries")
    ax.legend(loc="lower right", fontsize="small")
    save_figure(fig, path)


def main(cfg: InterruptionBenchConfig, json_path: Path | None, png_path: Path | None) -> dict:
    console = Console()
    result = run_interruption_bench(cfg, console)
    return finish(
        result, smoke=cfg.smoke, json_path=json_path, png_path=png_path,
        render=render_table, plot=plot, console=console,
    )  # fmt: skip
