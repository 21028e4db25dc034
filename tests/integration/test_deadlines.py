"""Critical deadlines through the services, behind a long batch prompt in large chunks.

The bound under test is the one layer-boundary preemption promises: a critical request's TTFT
stays within its isolated TTFT plus two layer times (one for the preemption to act, one of
slack for the service path), whatever the chunk size. The layer time is measured on this
machine first; the isolated TTFT through the same stack, before the batch request starts. The
scheduler gets the same SLO, so it must decide when to wait and when to preempt (predictions,
wake-ups and per-layer progress all play), not just preempt everything.

Two things preemption does not govern are taken as this run measured them, because CI shares
two cores with Kafka's JVM and the services and one stall shows in every time: a critical
request's own prefill (``Done.timings.prefill_ms``: a 24-token prefill took anywhere from 0.3 to
1.1 s on a box with busy neighbours) is its own compute, so each TTFT is compared without it
(its wait: admission to first token, less its own prefill); and the layer time is scaled by how
much slower the batch prefill ran here than alone (its ``prefill_ms`` over the fixture's).
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.integration.test_services import ids, kinds, stack  # noqa: F401 (fixture)
from tierflow.client import TierflowClient
from worker.engine import EngineConfig, PrefillEngine
from worker.models import load_model
from worker.preemption import PreemptionChannel
from worker.request import GenerationRequest

CHUNK = 2048
BATCH_TOKENS = 4000
CRITICAL_TOKENS = 24
MAX_SLOWDOWN = 3.0  # the most the bound's layer time is scaled by this run's own slowdown


class LayerClock:
    """Engine listener: the wall time between consecutive per-layer progress reports."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.layer_s: list[float] = []

    def on_layers_done(self, task, chunk, layers_done):
        now = time.perf_counter()
        self.layer_s.append(now - self.last)
        self.last = now

    def on_chunk_done(self, task, tokens_done):
        self.last = time.perf_counter()

    def on_first_token(self, task, token_id, logits):
        self.last = time.perf_counter()

    def on_token(self, task, token_id):
        pass


@pytest.fixture(scope="module")
def engine_times() -> dict[str, float]:
    """The layer time of a C=2048 chunk, the isolated critical prefill and the batch prompt's
    whole prefill, in seconds."""
    model = load_model("bench-llama", device="cpu", dtype=torch.float32).model
    engine = PrefillEngine(model, EngineConfig(chunk_size=CHUNK))
    clock = LayerClock()
    for _ in range(2):  # the first run warms up
        task = engine.new_task(GenerationRequest("long", tuple(ids(BATCH_TOKENS, seed=1))))
        start = time.perf_counter()
        engine.run(task, PreemptionChannel(), clock)
        batch_prefill_s = time.perf_counter() - start
    iso = []
    for i in range(3):
        task = engine.new_task(GenerationRequest("c", tuple(ids(CRITICAL_TOKENS, seed=10 + i))))
        start = time.perf_counter()
        engine.run(task, PreemptionChannel())
        iso.append(time.perf_counter() - start)
    # A layer time is the p90 over two prefills: robust to one stall of a shared CI core.
    layer_s = statistics.quantiles(clock.layer_s, n=10)[-1]
    return {
        "layer_s": layer_s,
        "isolated_s": statistics.median(iso),
        "batch_prefill_s": batch_prefill_s,
    }


@pytest.fixture
def tiers_file(tmp_path: Path, engine_times) -> Path:
    # The scheduler's target is the bound itself (engine-side isolated TTFT + 2 layers).
    slo = engine_times["isolated_s"] + 2 * engine_times["layer_s"]
    path = tmp_path / "tiers.toml"
    path.write_text(
        f"[tiers.critical]\nrank = 0\nttft_slo_s = {slo:.4f}\n"
        "[tiers.standard]\nrank = 1\nttft_slo_s = 10.0\n"
        "[tiers.batch]\nrank = 2\nttft_slo_s = 600.0\nsheddable = true\n"
    )
    return path


def critical_wait_s(target: str, seed: int) -> float:
    """A critical request's wait through the stack: TTFT (from admission, as the service
    measures it) less its own prefill on the worker."""
    with TierflowClient(target, tier="critical") as client:
        events = list(client.generate(ids(CRITICAL_TOKENS, seed=seed), timeout=60))
    assert kinds(events)[-1] == "done", kinds(events)
    first = next(e.first_token for e in events if e.WhichOneof("event") == "first_token")
    return (first.ttft_ms - events[-1].done.timings.prefill_ms) / 1000


def test_every_critical_request_meets_isolated_ttft_plus_two_layers(stack, engine_times):  # noqa: F811
    _, target = stack.queue_service("bench-llama")
    stack.worker(target, "w1", "bench-llama", chunk_size=CHUNK)
    isolated = statistics.median(critical_wait_s(target, seed=100 + i) for i in range(3))

    batch_events: list = []

    def run_batch() -> None:
        with TierflowClient(target, tier="batch") as client:
            batch_events.extend(client.generate(ids(BATCH_TOKENS, seed=1), timeout=300))

    batch = threading.Thread(target=run_batch)
    batch.start()
    time.sleep(0.5)  # the batch prefill is under way: its first chunk alone takes ~1 s
    waits = []
    for i in range(5):  # a stream of critical arrivals across the batch prefill
        waits.append(critical_wait_s(target, seed=200 + i))
        time.sleep(0.2)
    batch.join(timeout=300)

    assert kinds(batch_events)[-1] == "done", kinds(batch_events)
    timings = batch_events[-1].done.timings
    assert timings.preemptions >= 1  # it gave way at least once
    # Capped at 3x: uncapped, a run slow enough (or a batch prefill stretched by something
    # else) widens the bound until a scheduler that preempts late passes too.
    slowdown = min(
        MAX_SLOWDOWN, max(1.0, timings.prefill_ms / 1000 / engine_times["batch_prefill_s"])
    )
    bound = isolated + 2 * engine_times["layer_s"] * slowdown
    print(f"critical waits {[round(w, 3) for w in waits]} s, bound {bound:.3f} s", end=" ")
    print(f"(isolated {isolated:.3f} s, layers {slowdown:.2f}x slower than alone)")
    late = [round(w, 3) for w in waits if w > bound]
    assert not late, f"critical waits {waits} against {bound:.3f} s (isolated {isolated:.3f})"
