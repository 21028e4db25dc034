"""`tierflow demo`: the README's main command. The whole stack on this machine, a real model, and
a mixed-tier workload sent through Envoy with an API key per tier.

1. ``tierflow up`` in-process: Kafka, two queue services (the old scheduler, ``chunked``, as
   vLLM and SGLang schedule, and tierflow's ``flowprefill``), each with its own worker running
   SmolLM2-135M-Instruct on the CPU, the gateway and Envoy, all on loopback.
2. For ``duration_s``, Poisson arrivals of: long batch documents to summarise (thousands of
   tokens), medium standard requests, and short critical questions with real answers. The same
   arrivals are sent twice through Envoy: first all to the old scheduler, then all to tierflow
   (Envoy's canary weight 0, then 100), so a newcomer sees what the product changes.
3. Per tier and scheduler, side by side: TTFT p50/p99 as the client saw it, SLO attainment,
   preemptions; a few critical answers; the JSON and the TTFT-CDF PNG of both. Then the stack
   is stopped.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.metrics import summarise
from bench.report import plot_ttft_cdfs
from bench.tables import print_table
from bench.workload import Arrival, TierMix, Workload, synthetic
from launch.local_stack import LocalStack, StackConfig
from launch.processes import REPO
from launch.stack_client import Credentials, replay
from ops import canary
from tierflow.builtin_tokenizer import CORPUS_PATH
from tierflow.catalogue import load_model_info
from tierflow.tiers import load_tiers
from tierflow.tokenizer import TextTokenizer

CRITICAL_QUESTIONS = (
    "What is the capital of France?",
    "What is the capital of Italy?",
    "How many days are there in a week?",
    "What is the largest planet in our solar system?",
    "What color is the sky on a clear day?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in degrees Celsius?",
    "What is 12 times 12?",
    "What is the chemical symbol for gold?",
    "Which ocean is the largest?",
)

# SmolLM2 on 2 CPU cores: a 2000-token document takes seconds to prefill; a question ~0.1 s.
DEMO_MIX = (
    TierMix("critical", rate_per_s=0.25, min_tokens=0, max_tokens=0, max_new_tokens=16),
    TierMix("standard", rate_per_s=0.1, min_tokens=250, max_tokens=450, max_new_tokens=12),
    TierMix("batch", rate_per_s=0.1, min_tokens=1500, max_tokens=2500, max_new_tokens=8),
)


@dataclass(frozen=True)
class DemoConfig:
    model: str = StackConfig.model
    duration_s: float = 30.0  # of arrivals, once per scheduler: the demo takes about 3 minutes
    seed: int = 0
    out_dir: Path = Path("out")
    tiers_file: Path = REPO / "config" / "demo-tiers.toml"
    workers: int = 1  # per scheduler
    old_policy: str = "chunked"
    policy: str = "flowprefill"


class DemoPrompts:
    """Real text: chat-formatted questions, and documents cut from the project's own corpus."""

    def __init__(self, tokenizer: TextTokenizer, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        corpus = CORPUS_PATH.read_text()
        self.paragraphs = [p.strip() for p in corpus.split("\n\n") if len(p.strip()) > 200]
        self.questions: dict[str, str] = {}

    def _chat(self, text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def _document(self, tokens: int) -> str:
        parts, length = [], 0
        while length < tokens:
            paragraph = self.rng.choice(self.paragraphs)
            parts.append(paragraph)
            length += len(self.tokenizer.encode(paragraph))
        return "\n\n".join(parts)

    def for_arrival(self, arrival: Arrival) -> list[int]:
        if arrival.tier == "critical":
            question = self.rng.choice(CRITICAL_QUESTIONS)
            self.questions[arrival.request_id] = question
            return self._chat(question)
        if arrival.tier == "standard":
            return self._chat(
                f"{self._document(arrival.prompt_tokens)}\n\nIn one sentence, what is this about?"
            )
        return self._chat(f"Summarise this document:\n\n{self._document(arrival.prompt_tokens)}")


def demo_workload(
    model: str, duration_s: float, seed: int
) -> tuple[Workload, dict[str, list[int]], DemoPrompts]:
    """The demo's mixed arrivals, each one's prompt ids by request id, and the prompt maker
    (its questions). Every prompt is built first (the same prompts whatever the timing),
    within the model's context."""
    prompts = DemoPrompts(load_model_info(model).tokenizer, seed)
    workload = synthetic(DEMO_MIX, duration_s=duration_s, seed=seed)
    by_id = {a.request_id: prompts.for_arrival(a) for a in workload.arrivals}
    workload = Workload(workload.name, tuple(
        Arrival(a.at_s, a.request_id, a.tier, len(by_id[a.request_id]), a.max_new_tokens)
        for a in workload.arrivals
    ))  # fmt: skip
    return workload, by_id, prompts


def run_demo(cfg: DemoConfig) -> dict:
    from gateway.demo_keys import DEMO_KEYS

    console = Console()
    tiers = load_tiers(cfg.tiers_file)
    workload, by_id, prompts = demo_workload(cfg.model, cfg.duration_s, cfg.seed)
    stack_cfg = StackConfig(
        model=cfg.model, workers=cfg.workers, tiers_file=cfg.tiers_file,
        log_dir=cfg.out_dir / "stack", policy=cfg.old_policy, canary_policy=cfg.policy,
    )  # fmt: skip
    console.print(f"starting the stack ({cfg.model}, logs in {stack_cfg.log_dir}) ...")
    results = {}
    with LocalStack(stack_cfg) as stack:
        e = stack.endpoints
        for policy, weight in ((cfg.old_policy, 0), (cfg.policy, 100)):
            canary.set_weight(e.envoy_admin, weight)  # all of it to one scheduler
            console.print(
                f"{policy}: sending {len(workload.arrivals)} requests over "
                f"{cfg.duration_s:.0f} s through Envoy ({e.envoy}) with per-tier API keys."
            )
            results[policy] = _send(e.envoy, _renamed(workload, policy), by_id, DEMO_KEYS, console)
    report = {
        "model": cfg.model,
        "device": "cpu",
        "workload": workload.name,
        "requests": len(workload.arrivals),
        "through": "envoy + gateway + queue service + kafka + worker",
        "policies": {policy: summarise(result, tiers) for policy, result in results.items()},
        "isolated_ttft_ms": {},
        "critical_answers": [
            {"question": prompts.questions[_original_id(rid)], "answer": r.text}
            for rid, r in results[cfg.policy].records.items()
            if _original_id(rid) in prompts.questions and r.text
        ][:5],
    }
    _print(report, console)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    (cfg.out_dir / "demo.json").write_text(json.dumps(report, indent=2))
    plot_ttft_cdfs(report, cfg.out_dir / "demo.png")
    console.print(f"wrote {cfg.out_dir / 'demo.json'} and {cfg.out_dir / 'demo.png'}")
    return report


def _renamed(workload: Workload, policy: str) -> Workload:
    """The same arrivals under ids of their own (``<id>-<policy>``): a request id sent twice
    would be the same request."""
    arrivals = tuple(replace(a, request_id=f"{a.request_id}-{policy}") for a in workload.arrivals)
    return replace(workload, arrivals=arrivals)


def _original_id(request_id: str) -> str:
    return request_id.rsplit("-", 1)[0]


def _send(target: str, workload: Workload, by_id: dict, keys: dict, console: Console):
    with Progress(console=console) as progress:
        bar = progress.add_task("demo workload", total=len(workload.arrivals))
        return replay(
            target, workload, lambda a: by_id[_original_id(a.request_id)],
            lambda tier: Credentials(api_key=keys[tier]),
            on_progress=lambda: progress.advance(bar),
        )  # fmt: skip


def _print(report: dict, console: Console) -> None:
    table = Table(title=f"tierflow demo: {report['model']} through the edge, {report['workload']}")
    for col in (
        "tier",
        "scheduler",
        "n",
        "done",
        "rejected",
        "failed",
        "SLO ms",
        "SLO met",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "preemptions",
    ):
        table.add_column(col, justify="left" if col in ("tier", "scheduler") else "right")
    tiers = next(iter(report["policies"].values()))["tiers"]
    for tier in tiers:
        for policy, summary in report["policies"].items():
            t = summary["tiers"][tier]
            table.add_row(
                tier, policy, str(t["n"]), str(t["completed"]), str(t["rejected"]),
                str(t["failed"]), f"{t['slo_ms']:.0f}", f"{t['slo_attainment'] * 100:.1f}%",
                f"{t['ttft_ms']['p50']:.0f}", f"{t['ttft_ms']['p99']:.0f}", str(t["preemptions"]),
                end_section=policy == list(report["policies"])[-1],
            )  # fmt: skip
    print_table(console, table, keys=2)
    for qa in report["critical_answers"]:
        console.print(f"[bold]critical:[/bold] {qa['question']} -> {qa['answer'].strip()!r}")
