"""A Cancel at every phase of a request frees its KV slot once and ends its events.

The Cancel is sent from the engine thread, inside the runner's ``emit`` of the event that marks
the phase, so it lands at a known point of the run without any timing: queued (another
request's prefill is running), mid-prefill (a layer reported), after the prefill's last checked
boundary (its first token is out, the run has not returned), decoding (a step carried its
token), paused (its pause was acknowledged).
"""

from __future__ import annotations

import queue
from collections import Counter

import pytest

from tests.unit.test_batch_engine import prompt, reference
from tests.unit.test_batch_runner import collect_tokens, greedy
from worker.batch_engine import BatchEngine
from worker.batch_runner import BatchRunner
from worker.config import BatchConfig, EngineConfig
from worker.events import (
    Cancelled,
    DecodeStepDone,
    Failed,
    Finished,
    FirstToken,
    Preempted,
    Progress,
)

TARGET = "t"  # the request that is cancelled
OTHER = "o"  # assigned first: its prefill runs while the target is queued, then it decodes along
NEW_TOKENS = 12


def _names(event) -> tuple[str, ...]:
    if isinstance(event, DecodeStepDone):
        return event.request_ids
    return (event.request_id,)


class CancelAt:
    """The runner's ``emit``: records every event, and on the first one ``phase`` names sends
    the target's Cancel (or, for ``paused``, its pause first and the Cancel on the ack)."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.events: queue.Queue = queue.Queue()
        self.runner: BatchRunner | None = None
        self.sent = False
        self.paused = False

    def __call__(self, event) -> None:
        self.events.put(event)
        if not self.sent and self._is_trigger(event):
            self.sent = True
            self.runner.cancel(TARGET)

    def _is_trigger(self, event) -> bool:
        target = TARGET in _names(event)
        match self.phase:
            case "queued":
                return isinstance(event, Progress) and event.request_id == OTHER
            case "mid-prefill":
                return target and isinstance(event, Progress) and event.layers_done == 1
            case "after-last-boundary":
                return target and isinstance(event, FirstToken)
            case "decoding":
                return target and isinstance(event, DecodeStepDone)
            case "paused":
                if target and isinstance(event, DecodeStepDone) and not self.paused:
                    self.paused = True
                    self.runner.pause_decode(TARGET)
                return target and isinstance(event, Preempted)
        raise AssertionError(self.phase)


class SlotLedger:
    """Counts, per request, the slots the pool gave it and the frees that released one."""

    def __init__(self, engine: BatchEngine) -> None:
        self.allocated: Counter[str] = Counter()
        self.freed: Counter[str] = Counter()
        pool = engine.pool
        allocate, free = pool.allocate, pool.free

        def counted_allocate(owner, tokens):
            cache = allocate(owner, tokens)
            self.allocated[owner] += 1
            return cache

        def counted_free(cache):
            if cache.slot >= 0 and pool.owner_of(cache.slot) is cache:
                self.freed[cache.owner] += 1
            free(cache)

        pool.allocate, pool.free = counted_allocate, counted_free


def _drain(events: queue.Queue, names: set[str]) -> list:
    seen, left = [], set(names)
    while left:
        event = events.get(timeout=60)
        seen.append(event)
        if isinstance(event, Finished | Failed | Cancelled):
            left.discard(event.request_id)
    return seen


@pytest.mark.parametrize(
    "phase", ["queued", "mid-prefill", "after-last-boundary", "decoding", "paused"]
)
def test_a_cancel_frees_the_slot_once_and_nothing_follows_it(tiny_llama, phase):
    model = tiny_llama.model
    engine = BatchEngine(
        model,
        EngineConfig(chunk_size=64, check="layer", progress_interval_ms=0),  # a layer's report
        BatchConfig(max_batch_size=4, pool_slots=4, slot_tokens=160),
    )
    ledger = SlotLedger(engine)
    emit = CancelAt(phase)
    runner = emit.runner = BatchRunner(engine, emit)
    other_ids, target_ids = prompt(40, 500, seed=1), prompt(30, 500, seed=2)
    runner.assign(greedy(OTHER, other_ids, NEW_TOKENS), tbt_slo_s=0.05)
    runner.assign(greedy(TARGET, target_ids, NEW_TOKENS), tbt_slo_s=0.05)
    runner.start()
    try:
        events = _drain(emit.events, {OTHER, TARGET})
    finally:
        runner.stop()
    ends = [
        e for e in events if isinstance(e, Finished | Failed | Cancelled) and e.request_id == TARGET
    ]
    assert [type(e) for e in ends] == [Cancelled], ends
    after = events[events.index(ends[0]) + 1 :] + list(emit.events.queue)
    assert not [e for e in after if TARGET in _names(e)]
    assert ledger.freed[TARGET] == ledger.allocated[TARGET] == (0 if phase == "queued" else 1)
    assert ledger.freed[OTHER] == ledger.allocated[OTHER] == 1
    assert engine.pool.used_slots == 0 and not engine.rows and runner.suspended_bytes == 0
    # The request running beside it kept its own slot's cache: its tokens are generate's.
    assert collect_tokens(events)[OTHER] == reference(model, other_ids, NEW_TOKENS)[0]
