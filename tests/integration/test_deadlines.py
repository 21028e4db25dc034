"""Critical deadlines through the services, behind a long batch prompt in large chunks.

The bound under test is the one time-bounded interruption points promise: a critical request
waits at most two preemption budgets plus one decode step longer than it waits alone (one budget
for the running prefill to reach its next row block, one of slack for the service path, and a
decode step that may be under way), whatever the chunk size and however long a layer is. The
budget is the worker's default (``EngineConfig.preempt_budget_ms``); the decode step is measured
on this machine first, and the isolated wait through the same stack, before the batch request
starts. The scheduler gets the same SLO, so it must decide when to wait and when to preempt
(predictions, wake-ups and progress all play), not just preempt everything. A worker that stops
at layer boundaries instead fails it (waits of 0.12-0.23 s against a bound of 0.19 s, once).

Three things preemption does not govern are taken as this run measured them, because CI shares
two cores with Kafka's JVM and the services and one stall shows in every time: a critical
request's own prefill (``Done.timings.prefill_ms``: a 24-token prefill took anywhere from 0.3 to
1.1 s on a box with busy neighbours) is its own compute, so each TTFT is compared without it
(its wait: admission to first token, less its own prefill); the Kafka write before it is
queued (once 125 ms on CI, where the isolated requests' took a few), so its wait counts from
its ``Queued`` (on the client's clock, from the call; the scheduler cannot see a request before
that); and the budget and step are scaled
by how much slower the batch prefill ran here than alone (its ``prefill_ms`` over the
fixture's), at most ``MAX_SLOWDOWN`` times: uncapped, a slow enough run would widen the bound
until a late preemption passed too.
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
from worker.batch_engine import BatchEngine
from worker.config import BatchConfig, EngineConfig
from worker.models import load_model
from worker.preemption import PreemptionChannel
from worker.request import GenerationRequest

CHUNK = 2048
BATCH_TOKENS = 4000
CRITICAL_TOKENS = 24
MAX_SLOWDOWN = 3.0  # the most the bound's budget and step are scaled by this run's slowdown
BUDGET_S = EngineConfig.preempt_budget_ms / 1000  # the worker's default


@pytest.fixture(scope="module")
def engine_times() -> dict[str, float]:
    """On the worker's own engine (its defaults): the isolated critical prefill, the batch
    prompt's whole prefill and a decode step of one row, in seconds."""
    model = load_model("bench-llama", device="cpu", dtype=torch.float32).model
    engine = BatchEngine(model, EngineConfig(chunk_size=CHUNK), BatchConfig(1, 1, 4096))
    for _ in range(2):  # the first run warms up (and teaches the planner the block sizes)
        task = engine.new_task(GenerationRequest("long", tuple(ids(BATCH_TOKENS, seed=1)), 2))
        start = time.perf_counter()
        engine.prefill(task, PreemptionChannel())
        batch_prefill_s = time.perf_counter() - start
        engine.join(task)
        start = time.perf_counter()
        engine.decode_step()
        step_s = time.perf_counter() - start
    iso = []
    for i in range(3):
        task = engine.new_task(GenerationRequest("c", tuple(ids(CRITICAL_TOKENS, seed=10 + i))))
        start = time.perf_counter()
        engine.prefill(task, PreemptionChannel())
        iso.append(time.perf_counter() - start)
    return {
        "step_s": step_s,
        "isolated_s": statistics.median(iso),
        "batch_prefill_s": batch_prefill_s,
    }


@pytest.fixture
def tiers_file(tmp_path: Path, engine_times) -> Path:
    # The scheduler's target is the bound itself (engine-side isolated TTFT + 2 budgets + a step).
    slo = engine_times["isolated_s"] + 2 * BUDGET_S + engine_times["step_s"]
    path = tmp_path / "tiers.toml"
    path.write_text(
        f"[tiers.critical]\nrank = 0\nttft_slo_s = {slo:.4f}\n"
        "[tiers.standard]\nrank = 1\nttft_slo_s = 10.0\n"
        "[tiers.batch]\nrank = 2\nttft_slo_s = 600.0\nsheddable = true\n"
    )
    return path


def critical_wait_s(target: str, seed: int) -> float:
    """A critical request's wait through the stack once queued: TTFT (from admission, as the
    service measures it) less its own prefill on the worker and less the time from the call to
    its ``Queued`` (the Kafka write, which no scheduling governs)."""
    events, queued_after_s = [], 0.0
    with TierflowClient(target, tier="critical") as client:
        called = time.monotonic()
        for event in client.generate(ids(CRITICAL_TOKENS, seed=seed), timeout=60):
            if event.WhichOneof("event") == "queued":
                queued_after_s = time.monotonic() - called
            events.append(event)
    assert kinds(events)[0] == "queued" and kinds(events)[-1] == "done", kinds(events)
    first = next(e.first_token for e in events if e.WhichOneof("event") == "first_token")
    return (first.ttft_ms - events[-1].done.timings.prefill_ms) / 1000 - queued_after_s


def test_every_critical_wait_is_within_two_budgets_and_a_step_of_its_isolated_wait(
    stack,  # noqa: F811
    engine_times,
):
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
    slowdown = min(
        MAX_SLOWDOWN, max(1.0, timings.prefill_ms / 1000 / engine_times["batch_prefill_s"])
    )
    bound = isolated + (2 * BUDGET_S + engine_times["step_s"]) * slowdown
    print(f"critical waits {[round(w, 3) for w in waits]} s, bound {bound:.3f} s", end=" ")
    print(f"(isolated {isolated:.3f} s, engine {slowdown:.2f}x slower than alone)")
    late = [round(w, 3) for w in waits if w > bound]
    assert not late, f"critical waits {waits} against {bound:.3f} s (isolated {isolated:.3f})"
