"""Packed prefills and decode steps slotted into a running prefill, against the model alone."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.engine_hooks import StopAfter
from tests.unit.test_batch_engine import Streams, greedy, make_engine, prompt, reference
from worker.batch_engine import BatchEngine
from worker.config import BatchConfig, EngineConfig
from worker.decode_slotting import DecodeSlotter
from worker.engine import RunStatus
from worker.packed_prefill import PackedPrefill
from worker.preemption import PreemptionChannel
from worker.task import Phase

TOL = 1e-4


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("stops", [(), (1,), (3, 6)])  # none; mid-layer; mid-layer + layer end
@pytest.mark.parametrize("hooked", [False, True])  # a decode slotter's hook, block_rows < the pack
def test_packed_prefill_is_exact_also_after_preemption(request, model_fixture, stops, hooked):
    model = request.getfixturevalue(model_fixture).model
    engine = BatchEngine(
        model,
        EngineConfig(chunk_size=16, check="half", block_rows=5),  # packs ignore chunks
        BatchConfig(max_batch_size=4, pool_slots=4, slot_tokens=128),
    )
    hook_calls = []
    hook = (lambda: hook_calls.append(1)) if hooked else None
    lengths = [7, 30, 19, 52]  # 30 and 52 cross tiny-qwen2's 24-token sliding window
    prompts = [prompt(n, model.config.vocab_size, seed=50 + n) for n in lengths]
    tasks = tuple(engine.new_task(greedy(f"p{i}", p, 6)) for i, p in enumerate(prompts))
    pack, channel, streams = PackedPrefill(tasks), PreemptionChannel(), Streams()
    trigger = StopAfter(model, channel, stops, halves=True)
    try:
        preemptions = 0
        while (
            outcome := engine.run_packed(pack, channel, streams, between_layers=hook)
        ).status is RunStatus.PREEMPTED:
            assert not outcome.state_dropped and engine.suspended_bytes == outcome.held_bytes
            preemptions += 1
    finally:
        trigger.remove()
    assert outcome.status is RunStatus.PREFILLED and preemptions == len(stops)
    # A pack keeps its halves whole: the hook runs once at each half and layer boundary,
    # across the preempted runs together (row blocks of 5 would call it far more often), but
    # not at a boundary where the check stopped the run (the check comes first).
    assert len(hook_calls) == (2 * len(engine.layers) - 1 - len(stops) if hooked else 0)
    for task, ids in zip(tasks, prompts, strict=True):
        with torch.no_grad():
            expected = model(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(streams.logits[task.request_id][0], expected, atol=TOL, rtol=0)
        engine.join(task)
    while engine.rows:
        engine.decode_step(streams)
    for task, ids in zip(tasks, prompts, strict=True):
        assert streams.tokens[task.request_id] == reference(model, ids, 6)[0]
    assert engine.pool.used_slots == 0 and engine.suspended_bytes == 0


def test_dropped_and_cancelled_packs_free_their_slots(tiny_llama):
    model = tiny_llama.model
    engine = make_engine(model, slots=4, batch=4)
    tasks = tuple(engine.new_task(greedy(f"d{i}", prompt(10 + i, 500, i), 3)) for i in range(3))
    pack, channel = PackedPrefill(tasks), PreemptionChannel()
    channel.preempt(drop_state=True)
    outcome = engine.run_packed(pack, channel)
    assert outcome.state_dropped and engine.pool.used_slots == 0
    assert all(t.phase is Phase.QUEUED and t.state is None for t in tasks)
    channel.preempt()
    assert engine.run_packed(pack, channel).status is RunStatus.PREEMPTED
    engine.cancel(tasks[1])  # one member cancelled while the pack is suspended
    assert engine.run_packed(pack, channel).status is RunStatus.PREFILLED
    assert tasks[1].phase is Phase.CANCELLED and engine.pool.used_slots == 2
    channel.cancel()
    other = PackedPrefill(tuple(engine.new_task(greedy(f"c{i}", (5, 6, 7), 2)) for i in range(2)))
    assert engine.run_packed(other, channel).status is RunStatus.CANCELLED
    assert engine.pool.used_slots == 2


class FakeClock:
    """Time moves only when the model runs: a prefill layer costs 1 (0.5 a half: a hooked
    prefill runs halves), a decode step 0.1 a layer."""

    def __init__(self, engine) -> None:
        self.now = 0.0
        self.engine = engine
        halves = [m for layer in engine.layers for m in (layer.self_attn, layer.mlp)]
        self.handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in halves]
        self.decode_step = engine.decode_step
        engine.decode_step = self._decode_step  # its layers may not be the modules' (fused)

    def _hook(self, module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] > 1:
            self.now += 0.5

    def _decode_step(self, *args, **kwargs):
        self.now += 0.1 * len(self.engine.layers)
        return self.decode_step(*args, **kwargs)

    def __call__(self) -> float:
        return self.now

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.engine.decode_step = self.decode_step


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
def test_decode_slotted_into_a_long_prefill_meets_the_tbt_target_and_stays_exact(
    request, model_fixture
):
    model = request.getfixturevalue(model_fixture).model
    engine = make_engine(model, chunk=32)
    n_layers = len(engine.layers)
    clock, streams, channel = FakeClock(engine), Streams(), PreemptionChannel()
    times: dict[str, list[float]] = {}

    def on_step(result):
        for task in result.tasks:
            times.setdefault(task.request_id, []).append(clock())

    target = 2.5  # prefill layers of 1: a step is due about every other layer
    slotter = DecodeSlotter(engine, lambda task: target, on_step, streams, clock)
    try:
        decoders = {f"d{i}": prompt(9 + 5 * i, 500, seed=70 + i) for i in range(3)}
        for name, ids in decoders.items():
            task = engine.new_task(greedy(name, ids, 40))
            engine.prefill(task, channel, streams)
            engine.join(task)
            slotter.joined(task)
        long_ids = prompt(100, model.config.vocab_size, seed=9)  # 4 chunks of 32
        long = engine.new_task(greedy("long", long_ids, 3))
        slotter.prefill_started(float("inf"))  # a prefill without a TBT target of its own
        started = clock()
        assert engine.prefill(long, channel, streams, between_layers=slotter) is not None
        prefill_fake_s = clock() - started
    finally:
        clock.remove()
    boundaries = 4 * n_layers - 1
    assert 0 < slotter.slotted_steps < boundaries  # only when a target needed it
    for name in decoders:
        gaps = [b - a for a, b in itertools.pairwise(times[name])]
        assert gaps and max(gaps) <= target + 1e-9, (name, gaps)
    assert prefill_fake_s > 4 * n_layers  # the prefill ran in full, steps slotted inside it
    with torch.no_grad():
        expected = model(torch.tensor([long_ids])).logits[0, -1]
    torch.testing.assert_close(streams.logits["long"][0], expected, atol=TOL, rtol=0)
    engine.join(long)
    while engine.rows:
        engine.decode_step(streams)
    for name, ids in {**decoders, "long": long_ids}.items():
        new = 40 if name != "long" else 3
        assert streams.tokens[name] == reference(model, ids, new)[0], name
