"""The batched engine against the model's own forward pass and generate(), request by request.

Every decode step is one forward over the whole batch; each row's tokens and logits must be
what the model gives that request alone.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tests.attention import model_with_attention
from tests.engine_hooks import StopAfter
from worker.batch_engine import BatchEngine, BatchFullError
from worker.config import BatchConfig
from worker.engine import EngineConfig, RunStatus
from worker.kv_pool import PoolFullError
from worker.preemption import PreemptionChannel
from worker.request import GenerationRequest, InvalidRequestError, SamplingParams
from worker.task import Phase

TOL = 1e-4


class Streams:
    """Per request: every token the engine emitted, in order, with its logits."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)

    def on_chunk_done(self, task, tokens_done):
        pass

    def on_layers_done(self, task, chunk, layers_done):
        pass

    def on_first_token(self, task, token_id, logits):
        self.tokens[task.request_id].append(token_id)
        self.logits[task.request_id].append(logits.clone())

    def on_token(self, task, token_id):
        self.tokens[task.request_id].append(token_id)

    def record_step(self, result) -> None:
        for task, row_logits in zip(result.tasks, result.logits, strict=True):
            self.logits[task.request_id].append(row_logits.clone())


def prompt(n: int, vocab: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, vocab, (n,), generator=g).tolist())


def reference(model, ids, new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """generate()'s greedy tokens and the model's logits for each of them (one forward)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )[0]  # fmt: skip
        logits = model(out[None, :-1]).logits[0, len(ids) - 1 :]
    return out[len(ids) :].tolist(), logits


def make_engine(model, *, slots=10, batch=8, chunk=16, cap=4 << 30) -> BatchEngine:
    return BatchEngine(
        model,
        EngineConfig(chunk_size=chunk, check="layer", memory_cap_bytes=cap),
        BatchConfig(max_batch_size=batch, pool_slots=slots, slot_tokens=128),
    )


def greedy(name: str, ids, new_tokens: int) -> GenerationRequest:
    return GenerationRequest(name, ids, max_new_tokens=new_tokens, stop_at_eos=False)


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
def test_eight_requests_joining_at_different_steps_match_generate(request, model_fixture):
    model = request.getfixturevalue(model_fixture).model
    vocab = model.config.vocab_size
    lengths = [5, 37, 18, 61, 9, 44, 26, 70]
    new_tokens = [9, 6, 12, 8, 10, 7, 11, 9]
    join_at = [0, 0, 1, 2, 4, 4, 6, 7]  # decode step before which each one is prefilled
    prompts = {f"r{i}": prompt(n, vocab, seed=i) for i, n in enumerate(lengths)}
    engine = make_engine(model)
    channel, streams = PreemptionChannel(), Streams()
    tasks = {
        name: engine.new_task(greedy(name, ids, new_tokens[i]))
        for i, (name, ids) in enumerate(prompts.items())
    }
    # r3 (61 tokens, 4 chunks) is preempted in its second chunk, stays suspended for two
    # decode steps of the others, then resumes where it stopped.
    trigger = StopAfter(model, channel, {len(engine.layers) + 1}, halves=False)
    try:
        outcome = engine.prefill(tasks["r3"], channel, streams)
    finally:
        trigger.remove()
    assert outcome.status is RunStatus.PREEMPTED and outcome.resume_point.layer == 1
    step = 0
    while step == 0 or engine.rows:
        for i, name in enumerate(tasks):
            if join_at[i] == step:
                assert engine.prefill(tasks[name], channel, streams).status is RunStatus.PREFILLED
                engine.join(tasks[name])
        streams.record_step(engine.decode_step(streams))
        step += 1
    for i, (name, ids) in enumerate(prompts.items()):
        tokens, logits = reference(model, ids, new_tokens[i])
        assert streams.tokens[name] == tokens == tasks[name].output_ids, name
        torch.testing.assert_close(torch.stack(streams.logits[name]), logits, atol=TOL, rtol=0)
        assert tasks[name].phase is Phase.FINISHED and tasks[name].state is None
    assert engine.pool.used_slots == 0 and engine.suspended_bytes == 0


@pytest.mark.parametrize(("attn", "check"), [("sdpa", "half"), ("eager", "layer")])
@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
def test_decode_steps_slotted_between_row_blocks_change_no_result(
    request, model_fixture, attn, check
):
    """A hooked prefill with ``block_rows`` runs each half of a layer in blocks of rows, the hook
    between them, whatever its preemption checks. A decode step at every one of those boundaries
    (decoders finishing and leaving meanwhile) leaves the prefill's first-token logits and every
    decoder's tokens as the model gives them alone."""
    model = model_with_attention(request, model_fixture, attn).model
    vocab = model.config.vocab_size
    engine = BatchEngine(
        model,
        EngineConfig(chunk_size=16, check=check, block_rows=5),
        BatchConfig(max_batch_size=3, pool_slots=4, slot_tokens=192),
    )
    decoders = {f"d{i}": prompt(n, vocab, seed=10 + i) for i, n in enumerate((7, 19, 30))}
    new_tokens = {"d0": 20, "d1": 60, "d2": 150}
    channel, streams = PreemptionChannel(), Streams()
    tasks = {}
    for name, ids in decoders.items():
        tasks[name] = engine.new_task(greedy(name, ids, new_tokens[name]))
        engine.prefill(tasks[name], channel, streams)
        engine.join(tasks[name])
    hooks = 0

    def between() -> None:
        nonlocal hooks
        hooks += 1
        streams.record_step(engine.decode_step(streams))

    long_ids = prompt(45, vocab, seed=3)  # chunks of 16, 16 and 13 rows: blocks of 5, 5, 5, 1
    long = engine.new_task(greedy("long", long_ids, 2))
    assert engine.prefill(long, channel, streams, between_layers=between).status is (
        RunStatus.PREFILLED
    )
    n_layers = len(engine.layers)
    per_chunk = [n_layers * 2 * (-(-rows // 5)) - 1 for rows in (16, 16, 13)]
    assert hooks == sum(per_chunk) + 2  # every block boundary, and the two chunk ends
    while engine.rows:
        streams.record_step(engine.decode_step(streams))
    with torch.no_grad():
        alone = model(torch.tensor([long_ids])).logits[0, -1]
    torch.testing.assert_close(streams.logits["long"][0], alone, atol=TOL, rtol=0)
    for name, ids in decoders.items():
        tokens, logits = reference(model, ids, new_tokens[name])
        assert streams.tokens[name] == tokens, name
        torch.testing.assert_close(torch.stack(streams.logits[name]), logits, atol=TOL, rtol=0)
    engine.cancel(long)
    assert engine.pool.used_slots == 0


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
def test_steps_of_some_rows_decode_those_alone_and_change_no_result(request, model_fixture):
    """A step of some of the batch's rows (the runner's: those whose TBT target is as tight as a
    prefill's, wherever they sit in the batch) decodes those alone; leaves move rows meanwhile;
    and every row's tokens and logits are still the model's."""
    model = request.getfixturevalue(model_fixture).model
    vocab = model.config.vocab_size
    keys = {"b0": 5.0, "s0": 1.0, "c0": 0.4, "b1": 5.0, "s1": 1.0, "c1": 0.4, "b2": 5.0}
    new_tokens = {"b0": 14, "s0": 9, "c0": 5, "b1": 12, "s1": 11, "c1": 7, "b2": 13}
    engine = make_engine(model, slots=8, batch=8)
    channel, streams = PreemptionChannel(), Streams()
    prompts = {name: prompt(6 + 5 * i, vocab, seed=20 + i) for i, name in enumerate(keys)}
    tasks = {name: engine.new_task(greedy(name, ids, new_tokens[name])) for name, ids in
             prompts.items()}  # fmt: skip
    limits = (0.4, 1.0, None, 5.0, 0.4)

    def step(limit: float | None) -> None:
        rows = None if limit is None else [t for t in engine.rows if keys[t.request_id] <= limit]
        expected = {t.request_id for t in (engine.rows if rows is None else rows)}
        result = engine.decode_step(streams, rows=rows)
        assert {t.request_id for t in result.tasks} == expected
        streams.record_step(result)

    for i, name in enumerate(keys):  # one joins before each of the first steps
        engine.prefill(tasks[name], channel, streams)
        engine.join(tasks[name])
        step(limits[i % len(limits)])
    engine.cancel(tasks["s1"])  # a leave from the middle: the last row takes its slot
    del new_tokens["s1"]
    i = 0
    while engine.rows:
        step(limits[i % len(limits)])
        i += 1
    for name, n in new_tokens.items():
        tokens, logits = reference(model, prompts[name], n)
        assert streams.tokens[name] == tokens, name
        torch.testing.assert_close(torch.stack(streams.logits[name]), logits, atol=TOL, rtol=0)
    assert engine.pool.used_slots == 0


def test_rows_sample_with_their_own_seed(tiny_llama):
    """A sampled request gives the same tokens alone as inside a batch of others."""
    model = tiny_llama.model
    params = SamplingParams(temperature=1.3, top_p=0.9, seed=7)

    def run(others: int) -> list[int]:
        engine = make_engine(model)
        channel = PreemptionChannel()
        names = ["s"] + [f"o{i}" for i in range(others)]
        tasks = []
        for i, name in enumerate(names):
            sampling = params if name == "s" else SamplingParams(temperature=1.0, seed=100 + i)
            req = GenerationRequest(name, prompt(12 + 7 * i, 500, seed=i), 10, sampling, False)
            tasks.append(engine.new_task(req))
            engine.prefill(tasks[-1], channel)
            engine.join(tasks[-1])
        while engine.rows:
            engine.decode_step()
        return tasks[0].output_ids

    assert run(0) == run(5)


def test_pause_and_resume_stream_each_token_once(tiny_qwen2):
    model = tiny_qwen2.model
    engine = make_engine(model)
    channel, streams = PreemptionChannel(), Streams()
    ids = {n: prompt(20 + 9 * i, 500, seed=30 + i) for i, n in enumerate("abc")}
    tasks = {n: engine.new_task(greedy(n, p, 10)) for n, p in ids.items()}
    for task in tasks.values():
        engine.prefill(task, channel, streams)
        engine.join(task)
    engine.decode_step(streams)
    assert engine.pause(tasks["b"])  # kept: counted as paused memory
    assert engine.suspended_bytes == tasks["b"].held_bytes() > 0
    for _ in range(3):
        engine.decode_step(streams)
    engine.join(tasks["b"])
    assert engine.suspended_bytes == 0
    while engine.rows:
        engine.decode_step(streams)
    for name, p in ids.items():
        assert streams.tokens[name] == reference(model, p, 10)[0], name


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
def test_a_decode_step_stopped_at_every_layer_boundary_resumes_exactly(request, model_fixture):
    """Each call runs one layer and stops; a row that joins mid-step waits for the next step,
    and one paused mid-step abandons the step (its rows move), which the next call redoes."""
    model = request.getfixturevalue(model_fixture).model
    engine = make_engine(model)
    channel, streams = PreemptionChannel(), Streams()
    ids = {n: prompt(15 + 11 * i, 500, seed=50 + i) for i, n in enumerate("abcd")}
    tasks = {n: engine.new_task(greedy(n, p, 9)) for n, p in ids.items()}
    for name in "abc":
        engine.prefill(tasks[name], channel, streams)
        engine.join(tasks[name])
    engine.prefill(tasks["d"], channel, streams)
    stops, step = 0, 0
    while engine.rows:
        result = engine.decode_step(streams, stop=lambda: True)
        if result is None:
            stops += 1
            assert engine.step_pending
            if step == 1 and stops == 1:
                engine.join(tasks["d"])  # mid-step: the step keeps its rows
            if step == 3 and stops == 1:
                assert engine.pause(tasks["b"])  # mid-step: the step is abandoned
                assert not engine.step_pending
            if step == 5 and stops == 1:
                engine.join(tasks["b"])
            continue
        step, stops = step + 1, 0
        assert "d" not in {t.request_id for t in result.tasks} or step > 2
        streams.record_step(result)
    for name, p in ids.items():
        tokens, logits = reference(model, p, 9)
        assert streams.tokens[name] == tokens, name
        torch.testing.assert_close(torch.stack(streams.logits[name]), logits, atol=TOL, rtol=0)
    assert engine.pool.used_slots == 0


def test_paused_decode_past_the_cap_recomputes_without_repeating_tokens(tiny_llama):
    model = tiny_llama.model
    engine = make_engine(model, cap=1)
    channel, streams = PreemptionChannel(), Streams()
    ids = prompt(33, 500, seed=4)
    task = engine.new_task(greedy("d", ids, 12))
    engine.prefill(task, channel, streams)
    engine.join(task)
    for _ in range(4):
        engine.decode_step(streams)
    assert not engine.pause(task)  # over the cap: dropped
    assert task.state is None and task.phase is Phase.QUEUED and engine.pool.used_slots == 0
    assert engine.prefill(task, channel, streams).status is RunStatus.PREFILLED  # recompute
    engine.join(task)
    while engine.rows:
        engine.decode_step(streams)
    assert streams.tokens["d"] == reference(model, ids, 12)[0]


def test_memory_is_freed_on_finish_and_cancel(tiny_llama):
    model = tiny_llama.model
    engine = make_engine(model, slots=4, batch=4)
    channel = PreemptionChannel()
    tasks = [engine.new_task(greedy(f"m{i}", prompt(15 + i, 500, seed=i), 5)) for i in range(4)]
    for task in tasks[:3]:
        engine.prefill(task, channel)
        engine.join(task)
    channel.preempt()
    assert engine.prefill(tasks[3], channel).status is RunStatus.PREEMPTED  # suspended
    reserved = sum(len(t.request.prompt_ids) + 5 for t in tasks) * engine.pool.token_bytes
    assert engine.pool.used_slots == 4 and engine.held_bytes == reserved
    engine.decode_step()
    engine.cancel(tasks[1])  # decoding
    engine.cancel(tasks[3])  # suspended prefill
    assert engine.pool.used_slots == 2 and engine.suspended_bytes == 0
    while engine.rows:
        engine.decode_step()
    assert engine.pool.used_slots == 0 and engine.held_bytes == 0


def test_pool_and_batch_limits_are_clear_errors_and_the_engine_keeps_serving(tiny_llama):
    model = tiny_llama.model
    for bad in (dict(max_batch_size=0), dict(pool_slots=0), dict(max_batch_size=5, pool_slots=4)):
        with pytest.raises(ValueError, match=r"max_batch_size|pool_slots"):
            BatchConfig(**bad)
    engine = make_engine(model, slots=2, batch=1)
    with pytest.raises(InvalidRequestError, match="larger than a KV slot"):
        engine.new_task(greedy("big", prompt(120, 500, seed=1), 20))
    channel = PreemptionChannel()
    a, b, c = (engine.new_task(greedy(n, prompt(10, 500, seed=i), 4)) for i, n in enumerate("abc"))
    engine.prefill(a, channel)
    engine.prefill(b, channel)
    with pytest.raises(PoolFullError):
        engine.prefill(c, channel)
    assert c.state is None and engine.pool.used_slots == 2
    engine.join(a)
    with pytest.raises(BatchFullError):
        engine.join(b)
    while engine.rows:
        engine.decode_step()
    engine.join(b)
    engine.prefill(c, channel)  # a's slot is free again
    engine.decode_step()
    assert b.output_ids and c.phase is Phase.DECODE


def test_a_finished_row_leaves_without_its_kv_being_copied_and_the_rest_stay_exact(tiny_llama):
    """A long row finishing ahead of a short one: its slot is freed before the short row is
    moved into it, so what the pool still holds of freed slots (until the engine idles) is
    the short row's old copies, not the long row's K/V moved out of the way (a swap's)."""
    model = tiny_llama.model
    vocab = model.config.vocab_size
    engine = make_engine(model, slots=4, batch=2)
    channel, streams = PreemptionChannel(), Streams()
    ids = {"long": prompt(100, vocab, seed=1), "short": prompt(9, vocab, seed=2)}
    tasks = {
        "long": engine.new_task(greedy("long", ids["long"], 3)),
        "short": engine.new_task(greedy("short", ids["short"], 12)),
    }
    for task in tasks.values():
        engine.prefill(task, channel, streams)
        engine.join(task)
    while engine.in_batch(tasks["long"]):
        streams.record_step(engine.decode_step(streams))
    short = tasks["short"].state.cache
    assert engine.rows == [tasks["short"]] and short.slot == 0
    freed = engine.pool.allocated_bytes - engine.pool.used_bytes
    # The short row's old copies alone: where it was prefilled (9 positions) and row 1.
    assert freed == (9 + max(short.filled)) * engine.pool.token_bytes
    while engine.rows:
        streams.record_step(engine.decode_step(streams))
    assert streams.tokens["short"] == reference(model, ids["short"], 12)[0]
    assert streams.tokens["long"] == reference(model, ids["long"], 3)[0]
