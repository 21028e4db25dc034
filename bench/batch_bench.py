"""`tierflow engine-bench --batch`: what the batched engine buys, in one run.

- decode throughput of the engine's batched step at B = 1, 4, 16, 32, next to ``raw_tok_s``:
  a plain batched ``transformers`` decode loop (``DynamicCache``) of the same model, prompts
  and B, with no engine around it, the practical limit of this machine;
- the time between tokens (TBT) of 8 decoding requests while one long prefill runs: decode
  waits for the whole prefill (``sequential``), gets one step per chunk of C=512 (``chunk``,
  the chunked-prefill way), or gets a step slotted in at a layer boundary (or between a
  layer's attention and MLP halves) whenever a row would otherwise miss its TBT target
  (``layer``, ``worker.decode_slotting``). The target is the tightest tier's ``tbt_slo_s``
  (config/tiers.toml), not a number derived from the engine's layer time;
- what that costs the prefill: its time with decode slotted in over its time alone, also for
  a sweep of TBT targets (``layer_sweep``): the slotter trades TBT against prefill time, and
  the sweep shows the whole trade-off next to the chunked baseline's one point.

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
from bench.metrics import mean_interval, percentile
from bench.report import mark_smoke, write_json
from bench.tables import print_table
from worker.batch_engine import BatchEngine
from worker.config import BatchConfig, EngineConfig
from worker.decode_slotting import DecodeSlotter
from worker.preemption import PreemptionChannel
from worker.request import GenerationRequest

DECODE_BATCHES = (1, 4, 16, 32)
# The slowdown's split (``_run_summary``), per mode in the JSON's ``steps_in_prefill``.
_SPLIT = ("steps_per_prefill", "step_ms", "steps_share", "rest", "rest_ci95")


@dataclass(frozen=True)
class BatchBenchConfig:
    model: str = "bench-llama"
    context_tokens: int = 512  # prompt of every decoding request
    decode_steps: int = 32  # timed steps per batch size
    prefill_tokens: int = 4096  # the long prefill the decoders wait on
    prefill_chunk: int = 2048  # its C with layer slotting (and alone)
    chunk_baseline: int = 512  # C of the one-step-per-chunk baseline
    decoders: int = 8
    # The TBT target the slotter aims at (a step is slotted in only when waiting one more
    # operator would miss it). None: the tightest tier's ``tbt_slo_s`` in config/tiers.toml, a
    # product number that does not come from the engine's layer time.
    tbt_target_s: float | None = None
    # Slotted at layer boundaries and between the attention and MLP halves ("half"), or at layer
    # boundaries only ("layer").
    slot_check: str = "half"
    # More targets, each a point on the slotter's trade-off: TBT against prefill slowdown.
    tbt_sweep_s: tuple[float, ...] = (0.3, 0.5, 0.7, 1.0)
    # Prefills per TBT mode: TBT samples pooled; the slowdown is the mean of the paired ratios
    # (each prefill with decoders over the same run's prefill alone just before it), with its
    # 95% t interval, as this machine's noise moves single prefill times by 10-25%.
    repeats: int = 6
    seed: int = 0
    device: str | None = None
    smoke: bool = False  # a quick run: said in the output and the JSON

    @classmethod
    def quick(cls, **overrides) -> BatchBenchConfig:
        base = dict(
            context_tokens=256,
            decode_steps=12,
            prefill_tokens=2048,
            prefill_chunk=1024,
            repeats=2,
            tbt_sweep_s=(0.5,),
            smoke=True,
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


@dataclass(frozen=True)
class PrefillRun:
    """One long prefill of ``tbt_run``: the decoders' token intervals that overlap it, its wall
    time, and the decode steps that ran inside it (their count and summed time)."""

    intervals: list[float]
    seconds: float
    steps: int
    step_seconds: float


def tbt_run(engine: BatchEngine, slotter: DecodeSlotter, mode: str, long_ids, decoder_prompts):
    """One long prefill with ``decoder_prompts`` decoding (none: the prefill alone), as a
    ``PrefillRun``. ``slotter`` lives as long as its engine, as a worker's does
    (``worker.batch_runner``): what it learnt of the operator and step times in earlier
    prefills carries over."""
    token_times: dict[str, list[float]] = {}
    inside: list[float] = []  # the steps run while the prefill runs, their seconds
    prefill_running = False

    def on_step(result) -> None:
        now = time.perf_counter()
        for task in result.tasks:
            token_times.setdefault(task.request_id, []).append(now)
        if prefill_running:
            inside.append(result.seconds)

    slotter.on_step = on_step
    tasks = _decoding(engine, decoder_prompts, 1000)
    for task in tasks:
        slotter.joined(task)
    for _ in range(2 if tasks else 0):
        slotter.step()
    long = engine.new_task(GenerationRequest("long", long_ids))
    listener = _StepPerChunk(slotter) if mode == "chunk" else None
    between = slotter if mode == "layer" else None
    if between is not None:
        slotter.prefill_started(float("inf"))  # the long prefill has no TBT target of its own
    prefill_running = True
    start = time.perf_counter()
    if listener is not None:
        engine.prefill(long, PreemptionChannel(), listener, between_layers=between)
    else:
        engine.prefill(long, PreemptionChannel(), between_layers=between)
    end = time.perf_counter()
    prefill_running = False
    for _ in range(2 if tasks else 0):
        slotter.step()
    _drain(engine, tasks)
    for task in tasks:
        slotter.forget(task)
    intervals = [
        b - a
        for times in token_times.values()
        for a, b in itertools.pairwise(times)
        if b > start and a < end
    ]
    return PrefillRun(intervals, end - start, len(inside), sum(inside))


def tbt_during_prefill(model, cfg: BatchBenchConfig, rng, target_s: float) -> dict[str, dict]:
    """Per run (the three modes, then ``layer@<target>`` for each swept target): the decoders'
    TBT p50 / p99 in ms and the prefill's slowdown (with decode / alone: the mean of the paired
    ratios and its 95% interval). Each run keeps one slotter over its prefills; the prefill
    alone goes first, so the slotter has seen the operators once before decoders wait on it (a
    worker's slotter has seen many)."""
    vocab = model.config.vocab_size
    long_ids = _ids(rng, cfg.prefill_tokens, vocab)
    decoders = [_ids(rng, cfg.context_tokens, vocab) for _ in range(cfg.decoders)]
    slotted = _prefill_engine(model, cfg, cfg.prefill_chunk, cfg.slot_check)
    runs = {
        "sequential": (_prefill_engine(model, cfg, cfg.prefill_chunk, "layer"), "sequential"),
        "chunk": (_prefill_engine(model, cfg, cfg.chunk_baseline, "chunk"), "chunk"),
        "layer": (slotted, "layer"),
    }
    targets = {name: target_s for name in runs}
    for swept in cfg.tbt_sweep_s:
        runs[f"layer@{swept:g}"] = (slotted, "layer")
        targets[f"layer@{swept:g}"] = swept
    slotters = {
        name: DecodeSlotter(engine, lambda task, t=targets[name]: t)
        for name, (engine, _) in runs.items()
    }
    pairs: dict[str, list[tuple[float, PrefillRun]]] = {name: [] for name in runs}
    for _ in range(cfg.repeats):  # interleaved, so that drift hits every run alike
        for name, (engine, mode) in runs.items():
            alone = tbt_run(engine, slotters[name], mode, long_ids, []).seconds
            pairs[name].append((alone, tbt_run(engine, slotters[name], mode, long_ids, decoders)))
    return {name: _run_summary(p) for name, p in pairs.items()}


def _run_summary(pairs: list[tuple[float, PrefillRun]]) -> dict:
    """TBT percentiles, and the slowdown (the mean of the paired ratios) split into what the
    steps inside the prefill took themselves (``steps_share``: their time over the prefill's
    time alone) and the rest (``rest``, per pair: slowdown - 1 - share, with its interval:
    what the steps cost the prefill's own operators, and noise)."""
    ratios = [run.seconds / alone for alone, run in pairs]
    shares = [run.step_seconds / alone for alone, run in pairs]
    rests = [ratio - 1 - share for ratio, share in zip(ratios, shares, strict=True)]
    samples = [s for _, run in pairs for s in run.intervals]
    steps = sum(run.steps for _, run in pairs)
    return {
        "p50": percentile(samples, 50) * 1000,
        "p99": percentile(samples, 99) * 1000,
        "slowdown": statistics.fmean(ratios),
        "slowdown_ci95": list(mean_interval(ratios)) if len(ratios) > 1 else None,
        "slowdown_pairs": ratios,  # kept, so that runs can be pooled exactly
        "steps_per_prefill": steps / len(pairs),
        "step_ms": sum(run.step_seconds for _, run in pairs) / steps * 1000 if steps else 0.0,
        "steps_share": statistics.fmean(shares),
        "rest": statistics.fmean(rests),
        "rest_ci95": list(mean_interval(rests)) if len(rests) > 1 else None,
        "prefills": len(ratios),
        "samples": len(samples),
    }


def tightest_tbt_target_s() -> float:
    from tierflow.tiers import load_tiers

    targets = [t.tbt_slo_s for t in load_tiers() if t.tbt_slo_s is not None]
    if not targets:
        raise ValueError("no tier in config/tiers.toml has a tbt_slo_s; pass tbt_target_s")
    return min(targets)


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
    target_s = cfg.tbt_target_s if cfg.tbt_target_s is not None else tightest_tbt_target_s()
    runs = tbt_during_prefill(model, cfg, rng, target_s)
    modes = ("sequential", "chunk", "layer")
    return {
        "model": loaded.name,
        "max_layer_ms": layer_ms,
        "decode_step_ms": step_ms,
        "decode": decode,
        "tbt_target_ms": target_s * 1000,
        "slot_check": cfg.slot_check,
        "tbt_during_prefill_ms": {
            m: {k: runs[m][k] for k in ("p50", "p99", "samples")} for m in modes
        },
        "prefill_slowdown": {m: runs[m]["slowdown"] for m in ("chunk", "layer")},
        "prefill_slowdown_ci95": {m: runs[m]["slowdown_ci95"] for m in ("chunk", "layer")},
        "prefill_slowdown_pairs": {m: runs[m]["slowdown_pairs"] for m in ("chunk", "layer")},
        "steps_in_prefill": {m: {k: runs[m][k] for k in _SPLIT} for m in ("chunk", "layer")},
        "prefills_per_run": cfg.repeats,
        "layer_sweep": [
            {"target_ms": target * 1000, **runs[f"layer@{target:g}"]} for target in cfg.tbt_sweep_s
        ],
    }


def render_table(result: dict, console: Console) -> None:
    head = Table(title=f"engine-bench --batch: {result['model']}")
    head.add_column("")
    head.add_column("value", justify="right")
    head.add_row("largest layer", f"{result['max_layer_ms']:.1f} ms")
    head.add_row("decode step (the TBT decoders)", f"{result['decode_step_ms']:.1f} ms")
    for mode, ratio in result["prefill_slowdown"].items():
        ci = _interval(result["prefill_slowdown_ci95"][mode])
        head.add_row(f"prefill slowdown, decode slotted ({mode})", f"{ratio:.3f}x {ci}")
    print_table(console, head)
    decode = Table(title="decode throughput (tokens/s)")
    for column in ("B", "engine", "raw transformers", "engine / raw", "engine / B=1"):
        decode.add_column(column, justify="right")
    one = result["decode"]["1"]["tok_s"]
    for b, row in result["decode"].items():
        decode.add_row(
            b, f"{row['tok_s']:.0f}", f"{row['raw_tok_s']:.0f}",
            f"{row['tok_s'] / row['raw_tok_s']:.2f}x", f"{row['tok_s'] / one:.2f}x",
        )  # fmt: skip
    print_table(console, decode)
    tbt = Table(title="time between tokens of the decoders during a long prefill (ms)")
    for column in ("decode during prefill", "n", "p50", "p99"):
        tbt.add_column(column, justify="right")
    for mode, row in result["tbt_during_prefill_ms"].items():
        tbt.add_row(mode, str(row.get("samples", "-")), f"{row['p50']:.0f}", f"{row['p99']:.0f}")
    print_table(console, tbt)
    sweep = Table(title="the slotter's trade-off: TBT target against prefill slowdown")
    for column in ("run", "TBT target ms", "TBT p50 ms", "TBT p99 ms", "steps",
                   "step ms", "steps' time", "rest", "slowdown", "95% interval"):  # fmt: skip
        sweep.add_column(column, justify="right")
    steps = result["steps_in_prefill"]
    chunk = {**result["tbt_during_prefill_ms"]["chunk"], **steps["chunk"], "target_ms": None,
             "slowdown": result["prefill_slowdown"]["chunk"],
             "slowdown_ci95": result["prefill_slowdown_ci95"]["chunk"]}  # fmt: skip
    points = [
        {"target_ms": result["tbt_target_ms"], **result["tbt_during_prefill_ms"]["layer"],
         **steps["layer"], "slowdown": result["prefill_slowdown"]["layer"],
         "slowdown_ci95": result["prefill_slowdown_ci95"]["layer"]},
        *result["layer_sweep"],
    ]  # fmt: skip
    sweep.add_row("chunk (one step per chunk)", *_sweep_cells(chunk))
    for point in sorted(points, key=lambda p: p["target_ms"]):
        sweep.add_row(f"slotted ({result['slot_check']})", *_sweep_cells(point))
    print_table(console, sweep)
    console.print(
        "steps: decode steps inside one prefill; steps' time: their summed time over the "
        "prefill's time alone; rest: slowdown - 1 - steps' time (what the steps cost the "
        "prefill's own operators, and noise), with its 95% interval"
    )


def _sweep_cells(point: dict) -> list[str]:
    target = "-" if point["target_ms"] is None else f"{point['target_ms']:.0f}"
    return [
        target, f"{point['p50']:.0f}", f"{point['p99']:.0f}",
        f"{point['steps_per_prefill']:.1f}", f"{point['step_ms']:.1f}",
        f"{point['steps_share']:.3f}", f"{point['rest']:+.3f} {_interval(point['rest_ci95'])}",
        f"{point['slowdown']:.3f}x",
        _interval(point["slowdown_ci95"]),
    ]  # fmt: skip


def _interval(ci: list[float] | None) -> str:
    return f"({ci[0]:.3f}-{ci[1]:.3f})" if ci else "(one prefill)"


def main(cfg: BatchBenchConfig, json_path: Path | None) -> dict:
    console = Console()
    with console.status(f"engine-bench --batch {cfg.model}"):
        result = run_batch_bench(cfg)
    render_table(result, console)
    if cfg.smoke:
        mark_smoke(result, console)
    write_json(result, json_path, console)
    return result
