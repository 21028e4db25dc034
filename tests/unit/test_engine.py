"""The preemptible engine against the model's own forward pass and generate().

Preemptions are triggered through the real PreemptionChannel by forward hooks that raise the
signal after the n-th operator, so every stop happens at a real boundary of the real loop.
A run prefills up to the first token; decoding is the batched engine's (``BatchEngine``), the
only decode there is, so the tests that decode use it.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from tests.attention import ATTENTION, model_with_attention
from tests.engine_hooks import StopAfter
from worker import engine as engine_module
from worker.batch_engine import BatchEngine
from worker.engine import EngineConfig, PrefillEngine, RunStatus
from worker.preemption import PreemptionChannel
from worker.request import GenerationRequest, InvalidRequestError, SamplingParams
from worker.task import Phase

TOL = 1e-4


class Recorder:
    def __init__(self) -> None:
        self.first_logits: torch.Tensor | None = None
        self.tokens: list[int] = []
        self.progress: list[int] = []
        self.layer_progress: list[tuple[int, int]] = []  # (chunk, layers done)

    def on_chunk_done(self, task, tokens_done):
        self.progress.append(tokens_done)

    def on_layers_done(self, task, chunk, layers_done):
        self.layer_progress.append((chunk, layers_done))

    def on_first_token(self, task, token_id, logits):
        self.first_logits = logits.clone()
        self.tokens.append(token_id)

    def on_token(self, task, token_id):
        self.tokens.append(token_id)


def run_to_end(engine, task, channel, recorder):
    preemptions = 0
    while (outcome := engine.run(task, channel, recorder)).status is RunStatus.PREEMPTED:
        assert not outcome.state_dropped
        preemptions += 1
    assert outcome.status is RunStatus.FINISHED
    return preemptions


def prefill_to_end(engine, task, channel, recorder) -> int:
    """Prefill ``task`` up to its first token, resuming after every stop; the stops."""
    preemptions = 0
    while (outcome := engine.run(task, channel, recorder)).status is RunStatus.PREEMPTED:
        assert not outcome.state_dropped
        preemptions += 1
    assert outcome.status is RunStatus.PREFILLED
    return preemptions


def decode_until(engine: BatchEngine, task, recorder, n_tokens: int | None = None) -> None:
    """Join the batch and step until ``task`` has ``n_tokens`` (None: until it finishes)."""
    engine.join(task)
    while task.phase is not Phase.FINISHED and len(task.output_ids) != n_tokens:
        engine.decode_step(recorder)


def prompt(n: int, vocab: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, vocab, (n,), generator=g).tolist())


def reference_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("chunk_size", [5, 48, None])
@pytest.mark.parametrize("check", ["layer", "half"])
def test_preempted_prefill_gives_exact_logits(request, model_fixture, chunk_size, check, attn):
    loaded = model_with_attention(request, model_fixture, attn)
    model = loaded.model
    ids = prompt(130, model.config.vocab_size, seed=7)
    expected = reference_logits(model, ids)
    engine = PrefillEngine(model, EngineConfig(chunk_size=chunk_size, check=check))
    n_layers = len(model.model.layers)
    n_chunks = -(-len(ids) // (chunk_size or len(ids)))
    operators = n_layers * n_chunks * (2 if check == "half" else 1)
    rng = random.Random(f"{model_fixture}-{chunk_size}-{check}")
    for _ in range(4):  # 4 schedules x 12 combinations = 48 random schedules
        stops = rng.sample(range(1, operators), k=min(6, operators - 1))
        channel = PreemptionChannel()
        trigger = StopAfter(model, channel, stops, halves=check == "half")
        task = engine.new_task(GenerationRequest("r", ids))
        recorder = Recorder()
        try:
            preemptions = run_to_end(engine, task, channel, recorder)
        finally:
            trigger.remove()
        # Every operator but the prompt's last is followed by a check, so every stop is taken.
        assert preemptions == len(stops)
        torch.testing.assert_close(recorder.first_logits, expected, atol=TOL, rtol=0)
    assert engine.suspended_bytes == 0


def test_half_boundary_stop_resumes_inside_the_layer(tiny_llama):
    engine = PrefillEngine(tiny_llama.model, EngineConfig(chunk_size=None, check="half"))
    ids = prompt(40, tiny_llama.model.config.vocab_size, seed=1)
    channel = PreemptionChannel()
    trigger = StopAfter(tiny_llama.model, channel, {1}, halves=True)  # after layer 0 attention
    task = engine.new_task(GenerationRequest("h", ids))
    try:
        outcome = engine.run(task, channel)
    finally:
        trigger.remove()
    assert outcome.status is RunStatus.PREEMPTED
    assert (outcome.resume_point.layer, outcome.resume_point.half) == (0, 1)
    # The cache is uneven: layer 0 holds the chunk, layer 1 does not yet.
    assert task.state.cache.filled[:2] == [40, 0]
    recorder = Recorder()
    assert engine.run(task, channel, recorder).status is RunStatus.FINISHED
    torch.testing.assert_close(
        recorder.first_logits, reference_logits(tiny_llama.model, ids), atol=TOL, rtol=0
    )


def test_smollm2_preempted_prefill_is_exact(smollm2):
    model = smollm2.model
    ids = tuple(smollm2.tokenizer("The quick brown fox jumps over the lazy dog. " * 6)["input_ids"])
    expected = reference_logits(model, ids)
    rng = random.Random(3)
    for chunk_size, check in [(16, "layer"), (32, "half"), (None, "layer")]:
        engine = PrefillEngine(model, EngineConfig(chunk_size=chunk_size, check=check))
        channel = PreemptionChannel()
        stops = rng.sample(range(1, 60), k=5)
        trigger = StopAfter(model, channel, stops, halves=check == "half")
        recorder = Recorder()
        try:
            run_to_end(engine, engine.new_task(GenerationRequest("s", ids)), channel, recorder)
        finally:
            trigger.remove()
        torch.testing.assert_close(recorder.first_logits, expected, atol=TOL, rtol=0)


def test_interleaving_three_tasks(tiny_qwen2):
    """A is preempted, B and C run to completion, A resumes: all three exact."""
    model = tiny_qwen2.model
    engine = PrefillEngine(model, EngineConfig(chunk_size=16, check="layer"))
    channel = PreemptionChannel()
    prompts = {
        name: prompt(n, model.config.vocab_size, seed=i)
        for i, (name, n) in enumerate([("A", 120), ("B", 33), ("C", 70)])
    }
    recorders = {name: Recorder() for name in prompts}
    tasks = {name: engine.new_task(GenerationRequest(name, ids)) for name, ids in prompts.items()}
    trigger = StopAfter(model, channel, {5}, halves=False)
    try:
        outcome = engine.run(tasks["A"], channel, recorders["A"])
    finally:
        trigger.remove()
    assert outcome.status is RunStatus.PREEMPTED and outcome.held_bytes > 0
    assert engine.suspended_bytes == outcome.held_bytes
    for name in ("B", "C"):
        assert engine.run(tasks[name], channel, recorders[name]).status is RunStatus.FINISHED
    assert engine.run(tasks["A"], channel, recorders["A"]).status is RunStatus.FINISHED
    for name, ids in prompts.items():
        torch.testing.assert_close(
            recorders[name].first_logits, reference_logits(model, ids), atol=TOL, rtol=0
        )
    assert engine.suspended_bytes == 0


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
def test_greedy_tokens_after_resume_match_generate(request, model_fixture, attn):
    loaded = model_with_attention(request, model_fixture, attn)
    model = loaded.model
    ids = prompt(90, model.config.vocab_size, seed=11)
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=16, min_new_tokens=16
        )[0, len(ids) :].tolist()
    engine = BatchEngine(model, EngineConfig(chunk_size=32, check="layer"))
    channel = PreemptionChannel()
    # Stops in prefill (operators 2 and 7), and a pause in decode, its KV kept.
    trigger = StopAfter(model, channel, {2, 7}, halves=False)
    recorder = Recorder()
    task = engine.new_task(GenerationRequest("g", ids, max_new_tokens=16, stop_at_eos=False))
    try:
        preemptions = prefill_to_end(engine, task, channel, recorder)
    finally:
        trigger.remove()
    decode_until(engine, task, recorder, n_tokens=6)
    assert engine.pause(task)  # kept: it joins again where it stopped
    decode_until(engine, task, recorder)
    assert preemptions == 2 and task.preemptions == 3
    assert recorder.tokens == generated == task.output_ids
    assert task.phase is Phase.FINISHED and task.state is None
    assert engine.pool.used_slots == 0 and engine.suspended_bytes == 0


def test_sampling_is_seeded(tiny_llama):
    engine = BatchEngine(tiny_llama.model, EngineConfig(chunk_size=None))
    ids = prompt(20, tiny_llama.model.config.vocab_size, seed=2)
    params = SamplingParams(temperature=1.5, top_p=0.9, seed=42)

    def sample_once(seed_params):
        task = engine.new_task(
            GenerationRequest("s", ids, max_new_tokens=12, sampling=seed_params, stop_at_eos=False)
        )
        engine.prefill(task, PreemptionChannel())
        decode_until(engine, task, Recorder())
        return task.output_ids

    assert sample_once(params) == sample_once(params)
    assert sample_once(params) != sample_once(SamplingParams(temperature=1.5, top_p=0.9, seed=43))


@pytest.mark.parametrize("attn", ATTENTION)
def test_memory_cap_drops_state_and_recompute_is_exact(request, attn):
    model = model_with_attention(request, "tiny_llama", attn).model
    ids = prompt(100, model.config.vocab_size, seed=5)
    engine = PrefillEngine(model, EngineConfig(chunk_size=25, check="layer", memory_cap_bytes=1))
    channel = PreemptionChannel()
    trigger = StopAfter(model, channel, {3}, halves=False)
    task = engine.new_task(GenerationRequest("m", ids))
    try:
        outcome = engine.run(task, channel)
    finally:
        trigger.remove()
    assert outcome.status is RunStatus.PREEMPTED and outcome.state_dropped
    assert outcome.resume_point.tokens_done == 0
    assert task.state is None and task.phase is Phase.QUEUED and task.recomputes == 1
    assert engine.suspended_bytes == 0
    recorder = Recorder()
    assert engine.run(task, channel, recorder).status is RunStatus.FINISHED
    torch.testing.assert_close(
        recorder.first_logits, reference_logits(model, ids), atol=TOL, rtol=0
    )


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=1.2, top_p=0.9, seed=5)]
)
def test_decode_dropped_for_recompute_emits_each_token_once_and_continues_exactly(
    request, attn, sampling
):
    """A decoding request whose state is dropped (recompute policy, memory cap) recomputes its
    prompt and the tokens it produced, then continues: no token is emitted twice, and the
    tokens are those of an uninterrupted run (sampling too: its generator is kept)."""
    model = model_with_attention(request, "tiny_llama", attn).model
    ids = prompt(40, model.config.vocab_size, seed=21)

    def new_task(engine):
        return engine.new_task(
            GenerationRequest("k", ids, max_new_tokens=12, sampling=sampling, stop_at_eos=False)
        )

    reference = BatchEngine(model, EngineConfig(chunk_size=16))
    uninterrupted = new_task(reference)
    reference.prefill(uninterrupted, PreemptionChannel())
    decode_until(reference, uninterrupted, Recorder())
    # A cap of one byte: a pause that keeps the state is over it and drops it too.
    engine = BatchEngine(model, EngineConfig(chunk_size=16, check="layer", memory_cap_bytes=1))
    channel = PreemptionChannel()
    recorder = Recorder()
    task = new_task(engine)
    assert engine.prefill(task, channel, recorder).status is RunStatus.PREFILLED
    for stop_at, drop_state in ((3, True), (8, False)):  # asked to drop; over the cap
        decode_until(engine, task, recorder, n_tokens=stop_at)
        assert not engine.pause(task, drop_state=drop_state)
        assert task.state is None and task.phase is Phase.QUEUED
        assert engine.pool.used_slots == 0 and engine.suspended_bytes == 0
        # The recompute of its prompt and tokens emits nothing, and it decodes on.
        assert engine.prefill(task, channel, recorder).status is RunStatus.PREFILLED
    decode_until(engine, task, recorder)
    assert task.recomputes == 2
    assert recorder.tokens == uninterrupted.output_ids == task.output_ids  # once each, exact
    assert engine.pool.used_slots == 0 and engine.suspended_bytes == 0


def test_drop_signal_recomputes_even_under_the_cap(tiny_llama):
    engine = PrefillEngine(tiny_llama.model, EngineConfig(chunk_size=25))
    channel = PreemptionChannel()
    task = engine.new_task(GenerationRequest("d", prompt(60, 500, seed=9)))
    channel.preempt(drop_state=True)
    outcome = engine.run(task, channel)
    assert outcome.state_dropped and task.state is None and engine.suspended_bytes == 0
    assert channel.signal is None  # the engine consumed the signal it acted on


def test_cancel_running_and_suspended_tasks_frees_everything(tiny_llama):
    model = tiny_llama.model
    engine = PrefillEngine(model, EngineConfig(chunk_size=10))
    channel = PreemptionChannel()
    suspended = engine.new_task(GenerationRequest("s", prompt(50, 500, seed=1)))
    channel.preempt()
    assert engine.run(suspended, channel).status is RunStatus.PREEMPTED
    assert engine.suspended_bytes > 0
    engine.cancel(suspended)
    assert engine.suspended_bytes == 0 and suspended.state is None
    assert suspended.phase is Phase.CANCELLED

    running = engine.new_task(GenerationRequest("r", prompt(50, 500, seed=2)))
    channel.cancel()
    assert engine.run(running, channel).status is RunStatus.CANCELLED
    assert running.state is None and engine.suspended_bytes == 0
    with pytest.raises(ValueError, match="already cancelled"):
        engine.run(running, channel)


def test_bad_input_is_rejected_clearly(tiny_llama):
    engine = PrefillEngine(tiny_llama.model, EngineConfig())
    context = tiny_llama.model.config.max_position_embeddings
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.new_task(GenerationRequest("e", ()))
    with pytest.raises(InvalidRequestError, match="exceeds the model's context"):
        engine.new_task(GenerationRequest("l", (5,) * context))
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        engine.new_task(GenerationRequest("n", (5,), max_new_tokens=0))
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        engine.new_task(GenerationRequest("n", (5,), max_new_tokens=10**9))
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.new_task(GenerationRequest("v", (10**7,)))
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    for bad in (0, -4):
        with pytest.raises(ValueError, match="chunk_size must be positive"):
            EngineConfig(chunk_size=bad)
    with pytest.raises(ValueError, match="check must be"):
        EngineConfig(check="sometimes")


def test_progress_is_reported_per_chunk(tiny_llama):
    engine = PrefillEngine(tiny_llama.model, EngineConfig(chunk_size=30))
    recorder = Recorder()
    task = engine.new_task(GenerationRequest("p", prompt(100, 500, seed=4)))
    engine.run(task, PreemptionChannel(), recorder)
    assert recorder.progress == [30, 60, 90]  # the last chunk's end is the first-token event
    assert len(recorder.tokens) == 1


@pytest.mark.parametrize("every", [0, 1, 2])
def test_progress_is_reported_every_few_layers_inside_a_chunk(tiny_llama, every):
    config = EngineConfig(chunk_size=60, progress_every_layers=every, progress_interval_ms=0)
    engine = PrefillEngine(tiny_llama.model, config)
    n_layers = len(engine.layers)
    recorder = Recorder()
    task = engine.new_task(GenerationRequest("p", prompt(100, 500, seed=4)))
    engine.run(task, PreemptionChannel(), recorder)
    # Inside each chunk, every ``every`` layers but the last (the chunk end reports that).
    inside = [k for k in range(1, n_layers) if every and k % every == 0]
    assert recorder.layer_progress == [(c, k) for c in (0, 1) for k in inside]
    assert recorder.progress == [60]


def test_progress_inside_a_chunk_is_reported_at_most_every_interval(tiny_llama, monkeypatch):
    readings = itertools.count(step=0.003)  # the engine's clock: 3 ms later at every look
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: next(readings)))
    config = EngineConfig(chunk_size=60, progress_interval_ms=5)
    engine = PrefillEngine(tiny_llama.model, config)
    recorder = Recorder()
    task = engine.new_task(GenerationRequest("p", prompt(100, 500, seed=4)))
    engine.run(task, PreemptionChannel(), recorder)
    # Each chunk's clock starts at its first layer: a report 6 ms in, none 3 ms after it.
    inside = [k for k in range(1, len(engine.layers)) if k % 2 == 0]
    assert recorder.layer_progress == [(c, k) for c in (0, 1) for k in inside]
    assert recorder.progress == [60]  # chunk ends always go out


def test_chunk_only_check_stops_at_chunk_boundary(tiny_llama):
    engine = PrefillEngine(tiny_llama.model, EngineConfig(chunk_size=30, check="chunk"))
    channel = PreemptionChannel()
    channel.preempt()  # raised before the first layer: honoured only at the chunk's end
    task = engine.new_task(GenerationRequest("c", prompt(100, 500, seed=4)))
    outcome = engine.run(task, channel)
    assert outcome.status is RunStatus.PREEMPTED
    assert outcome.resume_point == type(outcome.resume_point)(
        chunk=1, layer=0, half=0, tokens_done=30
    )
