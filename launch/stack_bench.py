"""`tierflow bench --stack`: what the services add to TTFT, beside the in-process numbers.

In one run, on one model:
1. the workload in-process under flowprefill (the engine and scheduler without any I/O);
2. the same workload through the local stack (Kafka + gRPC + a worker process), sent straight to
   the queue service;
3. on the idle stack, paired measurements of short critical requests: each prompt's TTFT
   in-process (the engine alone), through the queue service, and through Envoy + the gateway,
   taken back to back so drift hits all three alike. The differences per prompt give
   ``stack_added_ttft_ms`` (Kafka + gRPC + worker hop) and ``edge_added_ttft_ms``
   (Envoy + ext_authz); a fourth measurement, the same prompt as a streamed OpenAI completion
   through Envoy, gives ``openai_added_ttft_ms`` (the OpenAI service over the gRPC path
   through Envoy).
"""

from __future__ import annotations

import http.client
import json
import random
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from bench.metrics import percentile, summarise
from bench.policy_bench import PolicyBenchConfig, build_workload, run_policy_bench
from bench.report import plot_ttft_cdfs, render_policy_tables, write_json
from bench.workload import prompt_ids
from launch.stack_client import Credentials, replay
from tierflow.client import TierflowClient
from tierflow.tiers import load_tiers
from worker.engine import EngineConfig, PrefillEngine, RunStatus
from worker.preemption import PreemptionChannel
from worker.request import GenerationRequest

PAIRED_SAMPLES = 30


def ttft_ms(client: TierflowClient, prompt: list[int]) -> float:
    start = time.perf_counter()
    for event in client.generate(prompt, max_new_tokens=1, timeout=120):
        if event.WhichOneof("event") == "first_token":
            return (time.perf_counter() - start) * 1000
    raise RuntimeError("no first token")


def _openai_ttft_ms(conn: http.client.HTTPConnection, key: str, model: str, prompt) -> float:
    """Send -> first SSE chunk of a streamed completion of one token (the OpenAI API)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    reply = conn.getresponse()
    ttft = None
    for line in reply:  # read to the end, so that the connection is reused
        if ttft is None and line.startswith(b"data: {"):
            ttft = (time.perf_counter() - start) * 1000
    if reply.status != 200 or ttft is None:
        raise RuntimeError(f"OpenAI completion failed: HTTP {reply.status}")
    return ttft


def _quantiles(samples: list[float]) -> dict:
    return {"p50": percentile(samples, 50), "p99": percentile(samples, 99), "n": len(samples)}


def paired_overheads(loaded, stack_endpoints, chunk_size: int, samples: int, seed: int) -> dict:
    from gateway.demo_keys import DEMO_KEYS

    model = loaded.model
    rng = random.Random(seed)
    engine = PrefillEngine(model, EngineConfig(chunk_size=chunk_size, check="layer"))
    direct = TierflowClient(
        stack_endpoints.queue_service,
        tier="critical",
        credentials=stack_endpoints.operator_credentials(),
    )
    edge = TierflowClient(stack_endpoints.envoy, api_key=DEMO_KEYS["critical"])
    host, port = stack_endpoints.envoy.rsplit(":", 1)
    openai = http.client.HTTPConnection(host, int(port), timeout=120)
    added_stack, added_edge, added_openai = [], [], []
    try:
        for i in range(samples + 2):
            prompt = [rng.randrange(5, model.config.vocab_size) for _ in range(rng.randint(16, 64))]
            task = engine.new_task(GenerationRequest(f"p{i}", tuple(prompt)))
            start = time.perf_counter()
            assert engine.run(task, PreemptionChannel()).status is RunStatus.FINISHED
            in_process = (time.perf_counter() - start) * 1000
            through_qs = ttft_ms(direct, prompt)
            through_edge = ttft_ms(edge, prompt)
            through_openai = _openai_ttft_ms(openai, DEMO_KEYS["critical"], loaded.name, prompt)
            if i >= 2:  # the first two warm up connections and caches
                added_stack.append(through_qs - in_process)
                added_edge.append(through_edge - through_qs)
                added_openai.append(through_openai - through_edge)
    finally:
        direct.close()
        edge.close()
        openai.close()
    return {
        "stack_added_ttft_ms": _quantiles(added_stack),
        "edge_added_ttft_ms": _quantiles(added_edge),
        "openai_added_ttft_ms": _quantiles(added_openai),
    }


def run_stack_bench(cfg: PolicyBenchConfig, console: Console) -> dict:
    from launch.local_stack import LocalStack, StackConfig
    from worker.models import load_model

    loaded = load_model(cfg.model, device=cfg.device)
    in_process = replace(cfg, policies=("flowprefill",), slo_multiples=(), sustained_factors=())
    result = run_policy_bench(in_process, console, loaded)
    tiers = load_tiers(cfg.tiers_file)
    workload = build_workload(cfg).clip_prompts(loaded.model.config.max_position_embeddings)
    stack_cfg = StackConfig(
        model=cfg.model, workers=cfg.workers, chunk_size=cfg.chunk_size,
        tiers_file=cfg.tiers_file or StackConfig.tiers_file, log_dir=Path("out/bench-stack"),
        device=str(loaded.model.device),
    )  # fmt: skip
    with LocalStack(stack_cfg) as stack, Progress(console=console) as progress:
        bar = progress.add_task("flowprefill through the stack", total=len(workload.arrivals))
        run = replay(
            stack.endpoints.queue_service, workload,
            lambda a: prompt_ids(a, loaded.model.config.vocab_size),
            lambda tier: Credentials(tier=tier, channel=stack.endpoints.operator_credentials()),
            on_progress=lambda: progress.advance(bar),
        )  # fmt: skip
        stack_summary = summarise(run, tiers)
        stack_summary["engine"] = {"chunk_size": cfg.chunk_size, "check": "layer"}
        result["policies"]["flowprefill@stack"] = stack_summary
        result.update(
            paired_overheads(loaded, stack.endpoints, cfg.chunk_size, PAIRED_SAMPLES, cfg.seed)
        )  # fmt: skip
    return result


def main(cfg: PolicyBenchConfig, json_path: Path | None, png_path: Path | None) -> dict:
    console = Console()
    result = run_stack_bench(cfg, console)
    render_policy_tables(result, console)
    for key, label in (
        ("stack_added_ttft_ms", "Kafka + gRPC + worker hop"),
        ("edge_added_ttft_ms", "Envoy + gateway (ext_authz)"),
        ("openai_added_ttft_ms", "the OpenAI API (over gRPC through Envoy)"),
    ):
        q = result[key]
        console.print(
            f"TTFT added by {label}: p50 {q['p50']:.1f} ms, p99 {q['p99']:.1f} ms "
            f"({q['n']} paired idle critical requests)"
        )
    write_json(result, json_path, console)
    if png_path:
        plot_ttft_cdfs(result, png_path)
        console.print(f"wrote {png_path}")
    return result
