"""`tierflow bench`: every scheduling policy on the same engine and the same arrivals, one run.

Steps: load the model; fit the prefill predictor on it (or load ``--predictor``); measure each
tier's isolated TTFT (its median prompt alone on an idle engine); then replay the workload once
per policy, each policy with the engine configured as it needs (``engine_for_policy``). Prints a
table per policy and tier, writes JSON and a PNG of TTFT CDFs. Optional extra runs: the top
tier's SLO configured at other multiples (``bench.slo_sweep``) and goodput at sustained rates
(``bench.sustained``).

Every policy runs on the workers' one engine (``worker.batch_engine``: one prefill at a time,
the rest decoding in one batch, decode steps slotted into prefills by each tier's TBT target,
packed prefills when the scheduler finds them safe), the same batching for all; requests
produce outputs of up to ``max_new_tokens``, and TBT is reported next to TTFT.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from bench import slo_curves, slo_sweep, sustained
from bench.calibrate import DEFAULT_LENGTHS, calibrate
from bench.event_log import EventLog
from bench.harness import run_policy
from bench.metrics import summarise
from bench.report import (
    mark_smoke,
    plot_ttft_cdfs,
    render_comparison,
    render_policy_tables,
    write_json,
)
from bench.traces import TraceOptions, load_trace_workload
from bench.workload import Workload, prompt_ids, synthetic
from queue_service.scheduler import (
    POLICIES,
    PrefillTimePredictor,
    Scheduler,
    SchedulerConfig,
    make_policy,
)
from queue_service.scheduler.policies import CHUNKED_C
from tierflow.tiers import TierTable, load_tiers
from worker.batch_engine import BatchEngine
from worker.config import BatchConfig
from worker.engine import EngineConfig, PrefillEngine, RunStatus
from worker.preemption import PreemptionChannel
from worker.request import GenerationRequest

# The longest output by default: scaled to what this 2-core CPU decodes in a run
# (bench-llama); synthetic outputs spread below it (bench.workload.output_lengths).
BATCHED_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class PolicyBenchConfig:
    model: str = "bench-llama"
    device: str | None = None
    policies: tuple[str, ...] = tuple(POLICIES)
    chunk_size: int = EngineConfig.chunk_size  # engine chunk of every policy but chunked
    chunked_chunk_size: int = CHUNKED_C  # C of the chunked baseline
    workers: int = 1
    duration_s: float = 60.0
    seed: int = 0
    trace: Path | None = None
    trace_options: TraceOptions = field(default_factory=TraceOptions)
    tiers_file: Path | None = None
    predictor_file: Path | None = None
    # The top tier's TTFT SLO set to each of these multiples of its isolated TTFT, and the
    # policies whose decisions read deadlines run again under it (``bench.slo_sweep``).
    slo_multiples: tuple[float, ...] = ()
    # Goodput at sustained rates (``bench.sustained``): these multiples of the base rate, each
    # a fresh Poisson workload with at least ``sustained_min_critical`` critical requests, per
    # seed of ``sustained_seeds``; a point meets ``sustained_target`` by its intervals.
    sustained_factors: tuple[float, ...] = ()
    sustained_seeds: tuple[int, ...] = (0, 1, 2)
    sustained_min_critical: int = 100
    sustained_target: float = 0.9
    # Each worker's KV slots and decode rows, and the longest synthetic output.
    kv_slots: int = BatchConfig.pool_slots
    max_batch_size: int = BatchConfig.max_batch_size
    max_new_tokens: int = BATCHED_MAX_NEW_TOKENS
    smoke: bool = False  # a quick run: said in the output and the JSON
    # A timeline of every policy run (bench.event_log), one file each here; read by
    # `tierflow misses`.
    event_log_dir: Path | None = None

    @classmethod
    def quick(cls, **overrides) -> PolicyBenchConfig:
        return cls(**{"duration_s": 15.0, "smoke": True, **overrides})


def engine_for_policy(policy_name: str, cfg: PolicyBenchConfig) -> EngineConfig:
    policy = make_policy(policy_name)
    chunk = cfg.chunked_chunk_size if policy.engine_check == "chunk" else cfg.chunk_size
    return EngineConfig(chunk_size=chunk, check=policy.engine_check)


def make_engines(model, policy_name: str, cfg: PolicyBenchConfig, workload: Workload) -> list:
    """``cfg.workers`` engines for the policy, each slot sized for the workload's longest
    request."""
    config = engine_for_policy(policy_name, cfg)
    longest = max(a.prompt_tokens + a.max_new_tokens for a in workload.arrivals)
    batch = BatchConfig(
        min(cfg.max_batch_size, cfg.kv_slots), pool_slots=cfg.kv_slots, slot_tokens=longest
    )
    return [BatchEngine(model, config, batch) for _ in range(cfg.workers)]


def build_workload(cfg: PolicyBenchConfig) -> Workload:
    if cfg.trace is not None:
        return load_trace_workload(cfg.trace, cfg.trace_options)
    return synthetic(
        duration_s=cfg.duration_s,
        seed=cfg.seed,
        max_new_tokens=cfg.max_new_tokens,
        time_scale=cfg.trace_options.time_scale,  # one stretch for traces and the synthetic mix
    )


def isolated_ttft_ms(
    model, workload: Workload, tiers: TierTable, cfg: PolicyBenchConfig, quantile: float = 0.5
) -> dict:
    """Each tier's median-length prompt (or the prompt at ``quantile`` of its lengths) alone
    on an idle engine (median of 3 runs). A prompt's TTFT alone grows with its length, so the
    prompt at the 95th percentile of lengths has the tier's isolated TTFT p95."""
    engine = PrefillEngine(model, EngineConfig(chunk_size=cfg.chunk_size, check="layer"))
    result = {}
    for tier in tiers:
        mine = sorted(
            (a for a in workload.arrivals if a.tier == tier.name), key=lambda a: a.prompt_tokens
        )
        if not mine:
            continue
        median = mine[int(quantile * (len(mine) - 1) + 0.5)]  # the rank nearest `percentile`s
        result[tier.name] = median_run_ms(engine, prompt_ids(median, model.config.vocab_size))
    return result


def median_run_ms(engine: PrefillEngine, ids, runs: int = 3) -> float:
    """The median time, in ms, of ``runs`` runs of one prompt (to its first token) alone."""
    times = []
    for _ in range(runs):
        task = engine.new_task(GenerationRequest("alone", ids))
        start = time.perf_counter()
        assert engine.run(task, PreemptionChannel()).status is RunStatus.FINISHED
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def run_order(policies: tuple[str, ...], seed: int) -> tuple[str, ...]:
    """The policies in the order they run: rotated by the seed. One run replays the arrivals
    once per policy, one after another, for minutes each, and this machine's speed drifts by
    tens of percent over that time; in a fixed order the last policy would always meet the
    drift's end. Over ``len(policies)`` consecutive seeds every policy runs once in every position,
    so pooling those seeds cancels a steady drift."""
    k = seed % len(policies) if policies else 0
    return tuple(policies[k:] + policies[:k])


def speed_probe_ms(model, tokens: int = 256, runs: int = 3, warmup: int = 0) -> float:
    """This machine's speed just before a policy's run: the median of ``runs`` prefills of one
    fixed prompt (256 tokens) alone on a bare engine, in ms, after ``warmup`` unmeasured ones.
    The same work every time, so policies' runs can be compared for the machine they got
    (reported next to each policy; nothing is scaled by it)."""
    engine = PrefillEngine(model, EngineConfig(chunk_size=None, check="none"))
    ids = fixed_prompt(model.config.vocab_size, tokens)
    if warmup:
        median_run_ms(engine, ids, runs=warmup)
    return median_run_ms(engine, ids, runs=runs)


def fixed_prompt(vocab_size: int, tokens: int) -> tuple[int, ...]:
    """The same ``tokens`` prompt ids every time: a probe of speed, not of content."""
    return tuple(3 + (7 * i) % (vocab_size - 3) for i in range(tokens))


def run_all_policies(model, workload, tiers, predictor_json, cfg, progress, label) -> dict:
    """Every policy on ``workload``, in ``run_order``; the summaries in ``cfg.policies``'s
    order, each with its position in the run and the speed probe taken just before it."""
    summaries = {}
    for position, name in enumerate(run_order(tuple(cfg.policies), cfg.seed)):
        bar = progress.add_task(f"{label}{name}", total=len(workload.arrivals))
        engines = make_engines(model, name, cfg, workload)
        scheduler_cfg = SchedulerConfig()
        scheduler = Scheduler(
            make_policy(name),
            tiers,
            PrefillTimePredictor.from_json(predictor_json),  # same start for every policy
            scheduler_cfg,
        )
        probe_ms = speed_probe_ms(model)
        log = _event_log(cfg, label, name)
        try:
            result = run_policy(
                scheduler,
                engines,
                workload,
                vocab_size=model.config.vocab_size,
                on_progress=lambda b=bar: progress.advance(b),
                event_log=log,
            )
        finally:
            if log is not None:
                log.close()
        progress.update(bar, completed=len(workload.arrivals))
        summaries[name] = summarise(result, tiers, scheduler_cfg.starvation_s)
        summaries[name]["engine"] = {
            "chunk_size": engines[0].config.chunk_size,
            "check": engines[0].config.check,
            "kv_slots": cfg.kv_slots,
            "max_batch_size": min(cfg.max_batch_size, cfg.kv_slots),
            "preempt_budget_ms": engines[0].config.preempt_budget_ms,
        }
        summaries[name]["run_position"] = position
        summaries[name]["speed_probe_ms"] = probe_ms
    return {name: summaries[name] for name in cfg.policies}


def _event_log(cfg: PolicyBenchConfig, label: str, policy: str) -> EventLog | None:
    """The timeline file of one policy run (``label``: the run's, e.g. "seed 0 x0.25 ")."""
    if cfg.event_log_dir is None:
        return None
    stem = "_".join([*label.split(), policy])
    return EventLog(cfg.event_log_dir / f"{stem}.jsonl")


def run_policy_bench(
    cfg: PolicyBenchConfig,
    console: Console,
    loaded=None,
    predictor: PrefillTimePredictor | None = None,
) -> dict:
    """``loaded``: the model, and ``predictor``, when the caller has them already."""
    from worker.models import load_model

    loaded = loaded or load_model(cfg.model, device=cfg.device)
    model = loaded.model
    tiers = load_tiers(cfg.tiers_file)
    workload = build_workload(cfg).clip_prompts(model.config.max_position_embeddings)
    if not workload.arrivals:
        raise ValueError(f"workload {workload.name!r} has no arrivals")
    with Progress(console=console) as progress:
        if predictor is None:
            predictor = _predictor(model, cfg, progress)
        isolated = isolated_ttft_ms(model, workload, tiers, cfg)

        def run_policies(load: Workload, swept: TierTable, sub: PolicyBenchConfig, label: str):
            return run_all_policies(model, load, swept, predictor.to_json(), sub, progress, label)

        summaries = run_policies(workload, tiers, cfg, "")
        extra = _extra_runs(cfg, workload, tiers, isolated, model, run_policies)
    result = {
        "model": loaded.name,
        "device": str(model.device),
        "workload": workload.name,
        "requests": len(workload.arrivals),
        "arrival_rate_per_s": len(workload.arrivals) / max(workload.duration_s, 1e-9),
        "predictor": dict(zip("abc", predictor.coefficients, strict=True)),
        "policies": summaries,
        "isolated_ttft_ms": isolated,
    }
    result.update({key: value for key, value in extra.items() if value is not None})
    return result


def _predictor(model, cfg: PolicyBenchConfig, progress: Progress) -> PrefillTimePredictor:
    """The calibrated predictor from ``cfg.predictor_file``, or calibrated now."""
    if cfg.predictor_file is not None:
        return PrefillTimePredictor.load(cfg.predictor_file)
    cal = progress.add_task("calibrating the prefill predictor", total=2 * len(DEFAULT_LENGTHS))
    engine = PrefillEngine(model, EngineConfig(chunk_size=cfg.chunk_size))
    return calibrate(engine, on_sample=lambda: progress.advance(cal))


def _extra_runs(cfg: PolicyBenchConfig, workload, tiers, isolated, model, run_policies) -> dict:
    """The runs beyond the main one: the SLO configured at other multiples, sustained rates."""
    context = model.config.max_position_embeddings
    configured = slo_sweep.run(
        cfg, isolated, tiers, lambda swept, sub, label: run_policies(workload, swept, sub, label)
    )
    sustained_result = None
    if cfg.sustained_factors:
        sustained_result = sustained.run(
            cfg.sustained_factors, cfg.sustained_seeds, cfg.sustained_min_critical,
            cfg.sustained_target, cfg.max_new_tokens,
            lambda load, label: run_policies(load.clip_prompts(context), tiers, cfg, label),
            isolated_p95_ms=lambda load: isolated_ttft_ms(
                model, load.clip_prompts(context), tiers, cfg, quantile=0.95
            ),
            budget_ms=EngineConfig.preempt_budget_ms,
        )  # fmt: skip
    return {"slo_configured": configured, "sustained": sustained_result}


def main(cfg: PolicyBenchConfig, json_path: Path | None, png_path: Path | None) -> dict:
    console = Console()
    result = run_policy_bench(cfg, console)
    render_policy_tables(result, console)
    render_comparison(result, console)
    if "sustained" in result:
        sustained.render(result["sustained"], console)
    result["slo_sensitivity"] = slo_curves.slo_sensitivity([result])
    slo_png = png_path.with_name(png_path.stem + "_slo.png") if png_path else None
    slo_curves.report(result["slo_sensitivity"], console, slo_png)
    if cfg.smoke:
        mark_smoke(result, console)
    write_json(result, json_path, console)
    if png_path:
        plot_ttft_cdfs(result, png_path)
        console.print(f"wrote {png_path}")
    if "sustained" in result:
        sustained.write_outputs(result["sustained"], json_path, png_path, console)
    return result
