"""`tierflow engine-bench --idle`: what an idle gap before it costs a lone short prefill.

The sustained bench sets the top tier's TTFT against its isolated TTFT, measured before the run
with prompts back to back. In a run, a critical request often arrives at an engine that has
been idle for seconds, and on the development machine such requests, with nothing else on the
engine, were the slowest of their tier (docs/results.md, "A lone request after an idle gap").
This bench measures that alone: one short prompt through ``BatchRunner.run`` on the main
thread, as the worker process runs it, assigned from a client thread after

- ``back to back``: no gap (what the isolated TTFT measures);
- ``after N s idle``: N seconds with the engine waiting for a command;
- ``after N s of a spinning CPU``: the client thread spins instead of sleeping (the longest
  gap), so the CPU never sleeps; if this is as slow as the idle gap, what the gap costs is not
  the CPU's wake-up but what the engine's memory lost meanwhile (caches shared with others).

Each round runs every way ``samples`` times in a rotating order; the ratios to back to back are
of the rounds' medians, with their 95 % intervals over the rounds.
"""

from __future__ import annotations

import queue
import random
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from bench import prompt_ways
from bench.report import finish
from worker.batch_engine import BatchEngine
from worker.batch_runner import BatchRunner
from worker.config import WorkerConfig
from worker.request import GenerationRequest

BACK_TO_BACK = "back to back"


@dataclass(frozen=True)
class IdleBenchConfig:
    model: str = "bench-llama"
    device: str | None = None
    prompt_tokens: int = 85  # about the 95th percentile of the critical tier's prompts
    gaps_s: tuple[float, ...] = (1.0, 3.0)
    rounds: int = 4
    samples: int = 5  # per way and round
    seed: int = 0
    smoke: bool = False

    @classmethod
    def quick(cls, **overrides) -> IdleBenchConfig:
        return cls(**{"gaps_s": (0.2,), "rounds": 2, "samples": 2, "smoke": True, **overrides})

    @property
    def waits(self) -> dict[str, tuple[float, bool]]:
        """Each way: (seconds before the measured request, whether the CPU spins meanwhile)."""
        spin = max(self.gaps_s)
        return {
            BACK_TO_BACK: (0.0, False),
            **{f"after {g:g} s idle": (g, False) for g in self.gaps_s},
            f"after {spin:g} s of a spinning CPU": (spin, True),
        }

    @property
    def ways(self) -> tuple[str, ...]:
        return tuple(self.waits)


def _wait(way: str, cfg: IdleBenchConfig) -> None:
    """What the client does before it assigns the measured request."""
    seconds, spin = cfg.waits[way]
    if not spin:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run_idle_bench(cfg: IdleBenchConfig, console: Console) -> dict:
    from worker.models import load_model

    model = load_model(cfg.model, device=cfg.device).model  # on the main thread, as a worker
    rng = random.Random(cfg.seed)
    ids = tuple(rng.randrange(3, model.config.vocab_size) for _ in range(cfg.prompt_tokens))
    worker = WorkerConfig(queue_service="unused", model=cfg.model, device=cfg.device)
    engine = BatchEngine(model, worker.engine_config(), worker.batch_config())  # as a worker's
    events: queue.Queue = queue.Queue()
    runner = BatchRunner(engine, events.put)
    samples: dict[str, list[float]] = {way: [] for way in cfg.ways}
    medians: dict[str, list[float]] = {way: [] for way in cfg.ways}

    def timed(request: GenerationRequest) -> float:
        return prompt_ways.first_token_s(runner, events, request) * 1000

    def client() -> None:
        try:
            for n in range(3):  # warm-up, unmeasured
                timed(GenerationRequest(f"warm{n}", ids, 1))
            for r in range(cfg.rounds):
                for way in prompt_ways.rotated(cfg.ways, r):
                    times = []
                    for s in range(cfg.samples):
                        timed(GenerationRequest(f"pre{r}{s}", ids, 1))
                        _wait(way, cfg)
                        times.append(timed(GenerationRequest(f"{way}{r}{s}", ids, 1)))
                    samples[way].extend(times)
                    medians[way].append(statistics.median(times))
                console.print(f"round {r + 1} of {cfg.rounds}", style="dim")
        finally:
            runner.stop()

    thread = threading.Thread(target=client, name="client")
    thread.start()
    runner.run()
    thread.join()
    return {
        "model": cfg.model,
        "prompt_tokens": cfg.prompt_tokens,
        "threads": torch.get_num_threads(),
        "rounds": cfg.rounds,
        "samples_per_round": cfg.samples,
        "ms": prompt_ways.times_ms(samples),
        "ratios": {
            f"{way} / {BACK_TO_BACK}": prompt_ways.ratio(medians[way], medians[BACK_TO_BACK])
            for way in cfg.ways[1:]
        },
    }


def render(result: dict, console: Console) -> None:
    title = (
        f"{result['model']}: one {result['prompt_tokens']}-token prompt alone, to its first "
        f"token, {result['threads']} torch threads, {result['rounds']} rounds"
    )
    prompt_ways.render(result, console, title, "before it")


def plot(result: dict, path: Path) -> None:
    title = f"{result['model']}, {result['prompt_tokens']}-token prompt after an idle gap"
    prompt_ways.plot(result, path, "ms to the first token (alone on the engine)", title)


def main(cfg: IdleBenchConfig, json_path, png_path) -> dict:
    console = Console()
    result = run_idle_bench(cfg, console)
    return finish(
        result, smoke=cfg.smoke, json_path=json_path, png_path=png_path,
        render=render, plot=plot, console=console,
    )  # fmt: skip
