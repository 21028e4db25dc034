"""`tierflow engine-bench --threads`: what the engine's thread costs a short prefill.

torch's OpenMP runtime (libgomp) keeps a pool of threads for every thread that runs parallel
ops, for as long as that thread lives. A worker builds its engine on the main thread, which
runs some parallel ops and so makes the main thread's pool; an engine that then runs on a
second thread makes a second pool, and with more OpenMP threads than cores libgomp stops
spin-waiting between parallel regions. This bench measures what that costs, each way in a
fresh process of its own that loads the model and builds the engine on its main thread as the
worker process does (``WorkerConfig``'s defaults):

- ``bare, main thread``: ``BatchEngine.prefill`` called on the main thread;
- ``bare, second thread``: the same call on a second thread;
- ``runner, main thread``: a lone request's time to its first token through ``BatchRunner.run``
  on the main thread, assigned from a client thread (what the worker process does);
- ``runner, own thread``: the same through ``BatchRunner.start``.

Its first version built an engine with one slot of the prompt's length, which runs no parallel
op on the main thread, and found no difference (docs/results.md).

A round runs each way once (a process, ``samples`` prompts after one warm-up), in an order
that rotates from round to round so drift cancels; the ratios are of the rounds' medians,
with their 95 % intervals over the rounds.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console

from bench import prompt_ways
from bench.report import finish
from worker.batch_engine import BatchEngine
from worker.batch_runner import BatchRunner
from worker.config import WorkerConfig
from worker.preemption import PreemptionChannel
from worker.request import GenerationRequest

WAYS = ("bare, main thread", "bare, second thread", "runner, main thread", "runner, own thread")
RATIOS = {  # name: (numerator, denominator)
    "bare: second / main thread": ("bare, second thread", "bare, main thread"),
    "runner: own / main thread": ("runner, own thread", "runner, main thread"),
    "runner on main / bare on main": ("runner, main thread", "bare, main thread"),
}


@dataclass(frozen=True)
class ThreadBenchConfig:
    model: str = "bench-llama"
    device: str | None = None
    prompt_tokens: int = 85  # about the 95th percentile of the critical tier's prompts
    rounds: int = 5
    samples: int = 10  # per way and round
    seed: int = 0
    smoke: bool = False

    @classmethod
    def quick(cls, **overrides) -> ThreadBenchConfig:
        return cls(**{"rounds": 2, "samples": 3, "smoke": True, **overrides})


# ---------------------------------------------------------------- one way, in its own process


def measure_way(cfg: ThreadBenchConfig, way: str) -> list[float]:
    """``cfg.samples`` times in ms of one way, after one warm-up, in this process."""
    from worker.models import load_model

    model = load_model(cfg.model, device=cfg.device).model  # on the main thread, as a worker
    rng = random.Random(cfg.seed)
    ids = tuple(rng.randrange(3, model.config.vocab_size) for _ in range(cfg.prompt_tokens))
    worker = WorkerConfig(queue_service="unused", model=cfg.model, device=cfg.device)
    engine = BatchEngine(model, worker.engine_config(), worker.batch_config())  # as a worker's
    requests = (GenerationRequest(f"r{i}", ids, max_new_tokens=1) for i in range(cfg.samples + 1))
    match way:
        case "bare, main thread":
            times = [_bare(engine, r) for r in requests]
        case "bare, second thread":
            times = _on_second_thread(lambda: [_bare(engine, r) for r in requests])
        case "runner, main thread":
            times = _through_run(engine, requests)
        case "runner, own thread":
            events: queue.Queue = queue.Queue()
            runner = BatchRunner(engine, events.put).start()
            times = [prompt_ways.first_token_s(runner, events, r) for r in requests]
            runner.stop()
        case _:
            raise ValueError(way)
    return [t * 1000 for t in times[1:]]


def _bare(engine: BatchEngine, request: GenerationRequest) -> float:
    task = engine.new_task(request)
    started = time.perf_counter()
    engine.prefill(task, PreemptionChannel())
    elapsed = time.perf_counter() - started
    engine.cancel(task)
    return elapsed


def _on_second_thread(fn):
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), name="second")
    thread.start()
    thread.join()
    return out[0]


def _through_run(engine: BatchEngine, requests) -> list[float]:
    events: queue.Queue = queue.Queue()
    runner = BatchRunner(engine, events.put)
    times: list[float] = []

    def client() -> None:
        times.extend(prompt_ways.first_token_s(runner, events, r) for r in requests)
        runner.stop()

    thread = threading.Thread(target=client, name="client")
    thread.start()
    runner.run()
    thread.join()
    return times


# ---------------------------------------------------------------- the rounds


def run_thread_bench(cfg: ThreadBenchConfig, console: Console) -> dict:
    medians: dict[str, list[float]] = {way: [] for way in WAYS}
    samples: dict[str, list[float]] = {way: [] for way in WAYS}
    for r in range(cfg.rounds):
        for way in prompt_ways.rotated(WAYS, r):
            times = _in_a_process(cfg, way)
            samples[way].extend(times)
            medians[way].append(statistics.median(times))
        console.print(f"round {r + 1} of {cfg.rounds}", style="dim")
    return {
        "model": cfg.model,
        "prompt_tokens": cfg.prompt_tokens,
        "threads": torch.get_num_threads(),
        "rounds": cfg.rounds,
        "samples_per_round": cfg.samples,
        "ms": prompt_ways.times_ms(samples),
        "ratios": {
            name: prompt_ways.ratio(medians[a], medians[b]) for name, (a, b) in RATIOS.items()
        },
    }


def _in_a_process(cfg: ThreadBenchConfig, way: str) -> list[float]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.thread_bench", json.dumps(asdict(cfg)), way],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def render(result: dict, console: Console) -> None:
    title = (
        f"{result['model']}: one {result['prompt_tokens']}-token prompt, "
        f"{result['threads']} torch threads, {result['rounds']} rounds"
    )
    prompt_ways.render(result, console, title, "way (a fresh process each round)")


def plot(result: dict, path: Path) -> None:
    title = f"{result['model']}, {result['prompt_tokens']}-token prompt: where the engine runs"
    prompt_ways.plot(result, path, "ms (bare: the prefill; runner: to the first token)", title)


def main(cfg: ThreadBenchConfig, json_path: Path | None, png_path: Path | None) -> dict:
    console = Console()
    result = run_thread_bench(cfg, console)
    return finish(
        result, smoke=cfg.smoke, json_path=json_path, png_path=png_path,
        render=render, plot=plot, console=console,
    )  # fmt: skip


if __name__ == "__main__":  # one way in this process: ``_in_a_process``
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a ThreadBenchConfig as JSON")
    parser.add_argument("way", choices=WAYS)
    args = parser.parse_args()
    print(json.dumps(measure_way(ThreadBenchConfig(**json.loads(args.config)), args.way)))
