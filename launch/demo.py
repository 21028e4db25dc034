"""`tierflow demo`: the README's main command. The whole stack on this machine, a real model, and
a mixed-tier workload sent through Envoy with an API key per tier.

1. ``tierflow up`` in-process: Kafka, the queue service, a worker running SmolLM2-135M-Instruct
   on the CPU, the gateway and Envoy, all on loopback.
2. For ``duration_s``, Poisson arrivals of: long batch documents to summarise (thousands of
   tokens), medium standard requests, and short critical questions with real answers.
3. Per tier: TTFT p50/p99 as the client saw it, SLO attainment, preemptions; a few critical
   answers; the JSON and the TTFT-CDF PNG. Then the stack is stopped.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
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
    duration_s: float = 60.0
    seed: int = 0
    out_dir: Path = Path("out")
    tiers_file: Path = REPO / "config" / "demo-tiers.toml"
    workers: int = 1


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
        log_dir=cfg.out_dir / "stack",
    )  # fmt: skip
    console.print(f"starting the stack ({cfg.model}, logs in {stack_cfg.log_dir}) ...")
    with LocalStack(stack_cfg) as stack:
        target = stack.endpoints.envoy
        console.print(
            f"stack up; edge at {target}. Sending {len(workload.arrivals)} requests "
            f"over {cfg.duration_s:.0f} s through Envoy with per-tier API keys."
        )
        with Progress(console=console) as progress:
            bar = progress.add_task("demo workload", total=len(workload.arrivals))
            result = replay(
                target, workload, lambda a: by_id[a.request_id],
                lambda tier: Credentials(api_key=DEMO_KEYS[tier]),
                on_progress=lambda: progress.advance(bar),
            )  # fmt: skip
    summary = summarise(result, tiers)
    report = {
        "model": cfg.model,
        "device": "cpu",
        "workload": workload.name,
        "requests": len(workload.arrivals),
        "through": "envoy + gateway + queue service + kafka + worker",
        "policies": {"flowprefill": summary},
        "isolated_ttft_ms": {},
        "critical_answers": [
            {"question": prompts.questions[rid], "answer": r.text}
            for rid, r in result.records.items()
            if rid in prompts.questions and r.text
        ][:5],
    }
    _print(report, console)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    (cfg.out_dir / "demo.json").write_text(json.dumps(report, indent=2))
    plot_ttft_cdfs(report, cfg.out_dir / "demo.png")
    console.print(f"wrote {cfg.out_dir / 'demo.json'} and {cfg.out_dir / 'demo.png'}")
    return report


def _print(report: dict, console: Console) -> None:
    summary = report["policies"]["flowprefill"]
    table = Table(title=f"tierflow demo: {report['model']} through the edge, {report['workload']}")
    for col in (
        "tier",
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
        table.add_column(col, justify="left" if col == "tier" else "right")
    for tier, t in summary["tiers"].items():
        table.add_row(
            tier, str(t["n"]), str(t["completed"]), str(t["rejected"]), str(t["failed"]),
            f"{t['slo_ms']:.0f}", f"{t['slo_attainment'] * 100:.1f}%",
            f"{t['ttft_ms']['p50']:.0f}", f"{t['ttft_ms']['p99']:.0f}", str(t["preemptions"]),
        )  # fmt: skip
    print_table(console, table)
    for qa in report["critical_answers"]:
        console.print(f"[bold]critical:[/bold] {qa['question']} -> {qa['answer'].strip()!r}")
