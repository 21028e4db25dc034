"""The runner configured as a single-request worker (one KV slot, a batch of one): the engine on
its own thread, driven from another thread as the scheduler does."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from worker.batch_engine import BatchEngine
from worker.batch_runner import BatchRunner
from worker.config import BatchConfig, EngineConfig
from worker.events import Cancelled, Failed, Finished, FirstToken, Preempted, Progress
from worker.request import GenerationRequest


class Gate:
    """Holds the engine thread inside its first Progress callback of ``request_id`` until
    the test releases it, so a preemption sent meanwhile lands mid-prefill deterministically."""

    def __init__(self) -> None:
        self.request_id: str | None = None
        self.reached = threading.Event()
        self.release = threading.Event()

    def hold(self, request_id: str) -> None:
        self.request_id = request_id
        self.reached.clear()
        self.release.clear()

    def __call__(self, event) -> None:
        if isinstance(event, Progress) and event.request_id == self.request_id:
            self.request_id = None
            self.reached.set()
            assert self.release.wait(30)


@pytest.fixture
def runner(tiny_llama):
    events: queue.Queue = queue.Queue()
    gate = Gate()

    def emit(event) -> None:
        events.put(event)
        gate(event)

    engine = BatchEngine(
        tiny_llama.model,
        EngineConfig(chunk_size=16, check="layer"),
        BatchConfig(max_batch_size=1, pool_slots=1),
    )
    r = BatchRunner(engine, emit).start()
    r.events, r.gate = events, gate
    yield r
    gate.release.set()
    r.stop()


def pause_mid_prefill(runner, request_id: str) -> None:
    assert runner.gate.reached.wait(30), f"{request_id} never reached a chunk boundary"


def next_event(runner, kind):
    while True:
        event = runner.events.get(timeout=30)
        if isinstance(event, kind):
            return event


def ids(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, 400, (n,), generator=g).tolist())


def test_preempt_from_another_thread_then_resume_finishes_exactly(runner, tiny_llama):
    prompt = ids(200, 1)
    with torch.no_grad():
        expected = int(tiny_llama.model(torch.tensor([prompt])).logits[0, -1].argmax())
    runner.gate.hold("a")
    runner.assign(GenerationRequest("a", prompt))
    pause_mid_prefill(runner, "a")
    assert runner.preempt("a")
    runner.gate.release.set()
    pre = next_event(runner, Preempted)
    assert not pre.state_dropped and pre.at >= pre.signalled_at and pre.held_bytes > 0
    assert runner.suspended_bytes == pre.held_bytes
    runner.resume("a")
    first = next_event(runner, FirstToken)
    assert first.token_id == expected and first.prefill_busy_s > 0
    done = next_event(runner, Finished)
    assert done.preemptions == 1 and done.output_ids == (expected,)
    assert runner.suspended_bytes == 0 and runner.engine.pool.used_slots == 0


def test_a_preempt_of_a_request_that_is_not_running_never_stops_the_next_one(runner):
    runner.preempt("nobody")  # ignored by the engine thread
    runner.assign(GenerationRequest("b", ids(20, 2), max_new_tokens=4))
    next_event(runner, Finished)
    runner.preempt("b")  # finished: no stale signal may reach the next request
    runner.assign(GenerationRequest("c", ids(20, 3), max_new_tokens=4))
    done = next_event(runner, Finished)
    assert done.request_id == "c" and done.preemptions == 0 and len(done.output_ids) == 4


def test_cancel_suspended_and_running(runner):
    runner.gate.hold("s")
    runner.assign(GenerationRequest("s", ids(300, 4)))
    pause_mid_prefill(runner, "s")
    assert runner.preempt("s")
    runner.gate.release.set()
    next_event(runner, Preempted)
    runner.cancel("s")
    assert next_event(runner, Cancelled).request_id == "s"
    assert runner.suspended_bytes == 0
    runner.gate.hold("r")
    runner.assign(GenerationRequest("r", ids(300, 5)))
    pause_mid_prefill(runner, "r")
    runner.cancel("r")
    runner.gate.release.set()
    assert next_event(runner, Cancelled).request_id == "r"


def test_invalid_request_fails_without_stopping_the_runner(runner):
    runner.assign(GenerationRequest("bad", ()))
    failed = next_event(runner, Failed)
    assert failed.invalid_request and "empty" in failed.error
    runner.assign(GenerationRequest("ok", ids(10, 6)))
    assert next_event(runner, Finished).request_id == "ok"


def test_cancel_landing_between_a_preemption_stop_and_the_runner_is_not_lost(runner):
    """The engine stopped for a preemption; a cancel arrives before the runner has cleared the
    channel (it still sees the request as running). The request must end cancelled, not
    suspended forever."""
    real_prefill = runner.engine.prefill

    def prefill_then_cancel(task, channel, listener, between_layers):
        outcome = real_prefill(task, channel, listener, between_layers)
        runner.cancel(task.request_id)  # exactly in the window
        return outcome

    runner.engine.prefill = prefill_then_cancel
    runner.gate.hold("late")
    runner.assign(GenerationRequest("late", ids(300, 7)))
    pause_mid_prefill(runner, "late")
    assert runner.preempt("late")
    runner.gate.release.set()
    assert next_event(runner, Cancelled).request_id == "late"
    assert runner.suspended_bytes == 0 and runner.running_request_id is None
    assert runner.engine.pool.used_slots == 0


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
def test_a_single_request_worker_decodes_as_generate_does_through_the_models_layers(
    request, model_fixture
):
    """A batch of one decodes through the model's own layers (no fused or packed copies of
    the weights, which a larger batch makes: docs/design.md, "The batched engine")."""
    model = request.getfixturevalue(model_fixture).model
    events: queue.Queue = queue.Queue()
    engine = BatchEngine(
        model, EngineConfig(chunk_size=16), BatchConfig(1, 1, kv_release_idle_s=0.0)
    )
    assert engine.decode_layers is None and not engine.fast_decode
    runner = BatchRunner(engine, events.put).start()
    prompt = ids(37, 8)
    try:
        runner.assign(GenerationRequest("one", prompt, max_new_tokens=10, stop_at_eos=False))
        while not isinstance(done := events.get(timeout=30), Finished):
            pass
        for _ in range(600):  # the engine thread hands the KV back as it goes idle
            if engine.pool.allocated_bytes == 0:
                break
            time.sleep(0.05)
    finally:
        runner.stop()
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=10, min_new_tokens=10
        )[0, len(prompt) :].tolist()
    assert list(done.output_ids) == expected
    assert engine.pool.allocated_bytes == 0  # an idle worker holds no KV
