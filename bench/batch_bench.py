"""`tierflow engine-bench --batch`: what the batched engine buys, in one run.

- decode throughput of the engine's batched step at B = 1, 4, 16, 32, next to ``raw_tok_s``:
  a plain batched ``transformers`` decode loop (``DynamicCache``) of the same model, prompts
  and B, with no engine around it, the practical limit of this machine;
- the time between tokens (TBT) of 8 decoding requests while one long prefill runs: decode
  waits for the whole prefill (``sequential``), gets one step per chunk of C=512 (``chunk``,
  the chunked-prefill way), or gets a step slotted in at a layer boundary whenever a row would
  otherwise miss its TBT target (``layer``, ``worker.decode_slotting``);
- what that costs the prefill: its time with decode slotted in over its time alone.

All ratios are taken inside one run (machines here are noisy and shared).
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import DynamicCache

from bench.engine_bench import LayerTimer
from bench.metrics import percentile
from bench.report import write_json
from worker.batch_engine import BatchEngine
from worker.config import BatchConfig, EngineConfig
from worker.decode_slotting import DecodeSlotter
from worker.preemption import PreemptionChannel
from worker.request import GenerationRequest

DECODE_BATCHES = (1, 4, 16, 32)


@dataclass(frozen=True)
class BatchBenchConfig:
    model: str = "bench-llama"
    context_tokens: int = 512  # prompt of every decoding request
    decode_steps: int = 32  # timed steps per batch size
    prefill_tokens: int = 4096  # the long prefill the decoders wait on
    prefill_chunk: int = 2048  # its C with layer slotting (and alone)
    chunk_baseline: int = 512  # C of the one-step-per-chunk baseline
    decoders: int = 8
    # The TBT target the layer slotter aims at, in units of (largest layer + one decode step):
    # a step is slotted in only when waiting one more layer would miss it.
    tbt_target_factor: float = 1.5
    repeats: int = 3  # prefills per TBT mode (samples pooled; prefill times: median)
    seed: int = 0
    device: str | None = None

    @classmethod
    def quick(cls, **overrides) -> BatchBenchConfig:
        base = dict(
            context_tokens=256, decode_steps=12, prefill_tokens=2048, prefill_chunk=1024, repeats=1
        )
        return cls(**{**base, **overrides})


def _ids(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, vocab) for _ in range(n))


def _decoding(engine: BatchEngine, prompts, new_tokens: int) -> list:
    """Prefill and join one request per prompt; they decode until stopped."""
    channel, tasks = PreemptionChannel(), []
    for i, ids in enumerate(prompts):
        req = GenerationRequest(f"d{i}", ids, max_new_tokens=new_tokens, stop_at_eos=False)
        task = engine.new_task(req)
        engine.prefill(task, channel)
        engine.join(task)
        tasks.append(task)
    return tasks


def _drain(engine: BatchEngine, tasks) -> None:
    for task in tasks:
        if task.state is not None:
            engine.cancel(task)


def engine_tok_s(engine: BatchEngine, prompts, steps: int) -> tuple[float, float]:
    """Tokens per second of the batched step, and the median step time."""
    tasks = _decoding(engine, prompts, steps + 2)
    engine.decode_step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.decode_step()
        times.append(time.perf_counter() - start)
    _drain(engine, tasks)
    return len(prompts) * steps / sum(times), statistics.median(times)


@torch.inference_mode()
def raw_tok_s(model, prompts, steps: int) -> float:
    """A plain batched transformers greedy loop over the same prompts (equal lengths)."""
    ids = torch.tensor(prompts, device=model.device)
    cache = DynamicCache(config=model.config)
    logits = model(ids, cache=cache, use_cache=True).logits[:, -1]
    token = logits.argmax(-1, keepdim=True)
    token = model(token, cache=cache, use_cache=True).logits[:, -1].argmax(-1)[:, None]
    start = time.perf_counter()
    for _ in range(steps):
        token = model(token, cache=cache, use_cache=True).logits[:, -1].argmax(-1)
        token = token[:, None]
    return len(prompts) * steps / (time.perf_counter() - start)


def decode_throughput(model, cfg: BatchBenchConfig, rng: random.Random) -> tuple[dict, float]:
    vocab = model.config.vocab_size
    engine = BatchEngine(
        model,
        EngineConfig(chunk_size=None),
        BatchConfig(
            max_batch_size=max(DECODE_BATCHES),
            pool_slots=max(DECODE_BATCHES),
            slot_tokens=cfg.context_tokens + cfg.decode_steps + 4,
        ),
    )
    results, step_ms_at_decoders = {}, 0.0
    for b in DECODE_BATCHES:
        prompts = [_ids(rng, cfg.context_tokens, vocab) for _ in range(b)]
        tok_s, _ = engine_tok_s(engine, prompts, cfg.decode_steps)
        results[str(b)] = {"tok_s": tok_s, "raw_tok_s": raw_tok_s(model, prompts, cfg.decode_steps)}
    prompts = [_ids(rng, cfg.context_tokens, vocab) for _ in range(cfg.decoders)]
    _, step_s = engine_tok_s(engine, prompts, cfg.decode_steps)
    step_ms_at_decoders = step_s * 1000
    return results, step_ms_at_decoders


class _StepPerChunk:
    """The chunked-prefill baseline: one decode step at every chunk end."""

    def __init__(self, slotter: DecodeSlotter) -> None:
        self.slotter = slotter

    def on_chunk_done(self, task, tokens_done) -> None:
        self.slotter.step()

    def on_layers_done(self, task, chunk, layers_done) -> None:
        pass

    def on_first_token(self, task, token_id, logits) -> None:
        pass

    def on_token(self, task, token_id) -> None:
        pass


def _prefill_engine(model, cfg: BatchBenchConfig, chunk: int, check: str) -> BatchEngine:
    return BatchEngine(
        model,
        EngineConfig(chunk_size=chunk, check=check),
        BatchConfig(
            max_batch_size=cfg.decoders,
            pool_slots=cfg.decoders + 1,
            slot_tokens=max(cfg.prefill_tokens + 1, cfg.context_tokens + 1024),
        ),
    )


def tbt_run(engine: BatchEngine, mode: str, long_ids, decoder_prompts, target_s: float):
    """One long prefill with ``decoder_prompts`` decoding (none: the prefill alone). Returns
    the decoders' token intervals that overlap the prefill, and the prefill's wall time."""
    token_times: dict[str, list[float]] = {}

    def on_step(result) -> None:
        now = time.perf_counter()
        for task in result.tasks:
            token_times.setdefault(task.request_id, []).append(now)

    slotter = DecodeSlotter(engine, lambda task: target_s, on_step)
    tasks = _decoding(engine, decoder_prompts, 1000)
    for task in tasks:
        slotter.joined(task)
    for _ in range(2 if tasks else 0):
        slotter.step()
    long = engine.new_task(GenerationRequest("long", long_ids))
    listener = _StepPerChunk(slotter) if mode == "chunk" else None
    between = slotter if mode == "layer" else None
    if between is not None:
        slotter.prefill_started()
    start = time.perf_counter()
    if listener is not None:
        engine.prefill(long, PreemptionChannel(), listener, between_layers=between)
    else:
        engine.prefill(long, PreemptionChannel(), between_layers=between)
    end = time.perf_counter()
    for _ in range(2 if tasks else 0):
        slotter.step()
    _drain(engine, tasks)
    intervals = [
        b - a
        for times in token_times.values()
        for a, b in itertools.pairwise(times)
        if b > start and a < end
    ]
    return intervals, end - start


def tbt_during_prefill(model, cfg: BatchBenchConfig, rng, target_s: float) -> tuple[dict, dict]:
    vocab = model.config.vocab_size
    long_ids = _ids(rng, cfg.prefill_tokens, vocab)
    decoders = [_ids(rng, cfg.context_tokens, vocab) for _ in range(cfg.decoders)]
    engines = {
        "sequential": _prefill_engine(model, cfg, cfg.prefill_chunk, "layer"),
        "chunk": _prefill_engine(model, cfg, cfg.chunk_baseline, "chunk"),
        "layer": _prefill_engine(model, cfg, cfg.prefill_chunk, "layer"),
    }
    intervals: dict[str, list[float]] = {mode: [] for mode in engines}
    with_decode: dict[str, list[float]] = {mode: [] for mode in engines}
    alone: dict[str, list[float]] = {mode: [] for mode in engines}
    for _ in range(cfg.repeats):  # interleaved, so that drift hits every mode alike
        for mode, engine in engines.items():
            samples, seconds = tbt_run(engine, mode, long_ids, decoders, target_s)
            intervals[mode] += samples
            with_decode[mode].append(seconds)
            alone[mode].append(tbt_run(engine, mode, long_ids, [], target_s)[1])
    tbt = {
        mode: {"p50": percentile(s, 50) * 1000, "p99": percentile(s, 99) * 1000}
        for mode, s in intervals.items()
    }
    slowdown = {
        mode: statistics.median(with_decode[mode]) / statistics.median(alone[mode])
        for mode in ("chunk", "layer")
    }
    return tbt, slowdown


def max_layer_ms(model, cfg: BatchBenchConfig, rng) -> float:
    engine = _prefill_engine(model, cfg, cfg.prefill_chunk, "layer")
    ids = _ids(rng, cfg.prefill_tokens, model.config.vocab_size)
    timer = LayerTimer(engine.layers, engine.device)
    try:
        engine.prefill(engine.new_task(GenerationRequest("layers", ids)), PreemptionChannel())
    finally:
        timer.remove()
    return max(timer.times) * 1000


def run_batch_bench(cfg: BatchBenchConfig) -> dict:
    from worker.models import load_model

    loaded = load_model(cfg.model, device=cfg.device)
    model = loaded.model
    rng = random.Random(cfg.seed)
    decode, step_ms = decode_throughput(model, cfg, rng)
    layer_ms = max_layer_ms(model, cfg, rng)
    target_s = cfg.tbt_target_factor * (layer_ms + step_ms) / 1000
    tbt, slowdown = tbt_during_prefill(model, cfg, rng, target_s)
    return {
        "model": loaded.name,
        "max_layer_ms": layer_ms,
        "decode_step_ms": step_ms,
        "decode": decode,
        "tbt_during_prefill_ms": tbt,
        "prefill_slowdown": slowdown,
    }


def render_table(result: dict, console: Console) -> None:
    head = Table(title=f"engine-bench --batch: {result['model']}")
    head.add_column("")
    head.add_column("value", justify="right")
    head.add_row("largest layer", f"{result['max_layer_ms']:.1f} ms")
    head.add_row("decode step (the TBT decoders)", f"{result['decode_step_ms']:.1f} ms")
    for mode, ratio in result["prefill_slowdown"].items():
        head.add_row(f"prefill slowdown, decode slotted ({mode})", f"{ratio:.3f}x")
    console.print(head)
    decode = Table(title="decode throughput (tokens/s)")
    for column in ("B", "engine", "raw transformers", "engine / raw", "engine / B=1"):
        decode.add_column(column, justify="right")
    one = result["decode"]["1"]["tok_s"]
    for b, row in result["decode"].items():
        decode.add_row(
            b, f"{row['tok_s']:.0f}", f"{row['raw_tok_s']:.0f}",
            f"{row['tok_s'] / row['raw_tok_s']:.2f}x", f"{row['tok_s'] / one:.2f}x",
        )  # fmt: skip
    console.print(decode)
    tbt = Table(title="time between tokens of the decoders during a long prefill (ms)")
    for column in ("decode during prefill", "p50", "p99"):
        tbt.add_column(column, justify="right")
    for mode, row in result["tbt_during_prefill_ms"].items():
        tbt.add_row(mode, f"{row['p50']:.0f}", f"{row['p99']:.0f}")
    console.print(tbt)


def main(cfg: BatchBenchConfig, json_path: Path | None) -> dict:
    console = Console()
    with console.status(f"engine-bench --batch {cfg.model}"):
        result = run_batch_bench(cfg)
    render_table(result, console)
    write_json(result, json_path, console)
    return result
