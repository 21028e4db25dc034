"""Interruption points bounded in time: row blocks of every prefill operator.

The planner is tested with made-up timings; the engine with a real model, stops raised through
the real PreemptionChannel by forward hooks on the attention and MLP modules (each row block is
one call of one of them), compared with the model's own forward.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from bench.interruption_bench import FirstLogits
from tests.attention import ATTENTION, model_with_attention
from tests.engine_hooks import StopAfter
from worker.batch_engine import BatchEngine
from worker.config import BatchConfig, EngineConfig
from worker.engine import RunStatus
from worker.preemption import PreemptionChannel
from worker.request import GenerationRequest
from worker.row_blocks import ATTENTION as ATTN
from worker.row_blocks import MLP, BlockRule, RowBlockPlanner

TOL = 1e-4


def prompt(n: int, vocab: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, vocab, (n,), generator=g).tolist())


def reference_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def engine_for(model, **config) -> BatchEngine:
    return BatchEngine(model, EngineConfig(**config), BatchConfig(2, 2, slot_tokens=256))


# ---------------------------------------------------------------------------------- planner


def planner(budget_ms: float = 25.0, offset: int = 640, **rule) -> RowBlockPlanner:
    return RowBlockPlanner(BlockRule(budget_ms / 1000, offset, **rule))


def test_an_unknown_operator_starts_small_then_fills_the_budget():
    p = planner()
    assert p.rows(MLP, 0, 2048) == 128  # nothing measured yet
    p.observe(MLP, 128, 0, 128 * 50e-6)  # 50 us a row
    rows = p.rows(MLP, 0, 2048)
    assert rows == 400  # 0.8 x 25 ms / 50 us
    assert p.predicted_s(MLP, rows, 0) <= 0.025


def test_attention_blocks_shrink_as_their_rows_see_more_keys():
    p = planner()
    p.observe(ATTN, 64, 64, 64 * (64 + 640) * 1e-8)
    early, late = p.rows(ATTN, 0, 8192), p.rows(ATTN, 6000, 8192)
    assert early > late > 0
    for past, rows in ((0, early), (6000, late)):
        assert p.predicted_s(ATTN, rows, past + rows) <= 0.025 * 0.8 + 1e-9


def test_the_rate_is_the_lower_quartile_of_recent_blocks():
    p = planner(window=8)
    for seconds in (0.010, 0.011, 0.012, 0.013, 0.030, 0.050, 0.060, 0.070):
        p.observe(MLP, 100, 0, seconds)
    assert p.rate(MLP) == pytest.approx(0.011 / 100)
    for _ in range(8):  # a slowdown that lasts the whole window is followed
        p.observe(MLP, 100, 0, 0.040)
    assert p.rate(MLP) == pytest.approx(0.040 / 100)


def test_a_fixed_cost_per_block_settles_where_the_whole_block_fits():
    """Blocks cost 1 ms each plus 50 us a row: the sizes settle where the block, its fixed cost
    included, takes the target (0.8 x 25 ms)."""
    p = planner()
    rows = p.rows(MLP, 0, 100_000)
    for _ in range(60):
        p.observe(MLP, rows, 0, 0.001 + rows * 50e-6)
        rows = p.rows(MLP, 0, 100_000)
    assert 0.018 <= 0.001 + rows * 50e-6 <= 0.020


def test_contention_does_not_shrink_the_blocks():
    """A neighbour takes the cores for a few blocks: they run slow whatever their size, and
    smaller blocks would only add fixed costs, so the sizes stay."""
    p = planner()
    for _ in range(32):
        p.observe(MLP, 400, 0, 400 * 50e-6)
    steady = p.rows(MLP, 0, 100_000)
    for _ in range(6):
        p.observe(MLP, steady, 0, 10 * steady * 50e-6)
    assert p.rows(MLP, 0, 100_000) == steady


def test_no_sliver_at_the_end_and_a_short_operator_is_one_block():
    p = planner()
    p.observe(MLP, 100, 0, 100 * 50e-6)  # 400 rows fit
    assert p.rows(MLP, 0, 300) == 300  # fits: one block
    assert p.rows(MLP, 0, 500) == 250  # 400 + a sliver of 100: two halves instead
    assert p.rows(MLP, 0, 1000) == 400


def test_fixed_rows_replace_the_timed_size():
    p = planner(fixed_rows=5)
    assert [p.rows(MLP, 0, n) for n in (16, 5, 3)] == [5, 5, 3]


# ---------------------------------------------------------------------------------- engine


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("chunk_size", [16, None])
def test_a_stop_at_every_block_boundary_resumes_to_the_same_logits(
    request, model_fixture, attn, chunk_size
):
    """The flag is raised after every block: each run computes exactly one block, stops at
    the next boundary (mid-operator too, keeping the rows done), and the resumed prefill gives
    the model's own logits."""
    model = model_with_attention(request, model_fixture, attn).model
    ids = prompt(45, model.config.vocab_size, seed=11)  # 30+ tokens: qwen2's window is crossed
    engine = engine_for(model, chunk_size=chunk_size, check="block", block_rows=5)
    channel, first = PreemptionChannel(), FirstLogits()
    trigger = StopAfter(model, channel, range(1, 10_000), halves=True)
    task = engine.new_task(GenerationRequest("r", ids, max_new_tokens=2))
    mid_operator = {0: 0, 1: 0}  # stops inside an attention half, an MLP half
    runs = 0
    try:
        while True:
            calls_before = trigger.calls
            outcome = engine.prefill(task, channel, first)
            runs += 1
            assert trigger.calls - calls_before == 1  # stopped within one block
            if outcome.status is not RunStatus.PREEMPTED:
                break
            point = outcome.resume_point
            if point.rows_done:
                mid_operator[point.half] += 1
                assert task.state.partial is not None
                assert outcome.held_bytes >= task.state.partial.numel() * 4
    finally:
        trigger.remove()
    assert outcome.status is RunStatus.PREFILLED
    chunks = [16, 16, 13] if chunk_size else [45]
    blocks = sum(-(-rows // 5) for rows in chunks) * 2 * len(engine.layers)
    assert runs == blocks == trigger.calls
    assert mid_operator[0] > 0 and mid_operator[1] > 0
    torch.testing.assert_close(first.logits, reference_logits(model, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
def test_timed_blocks_stop_at_random_boundaries_and_resume_exactly(request, model_fixture):
    """With the planner sizing blocks from measured times (a budget so small that every block
    has the planner's fewest rows, 16 here), random stops still resume to the model's
    logits."""
    model = request.getfixturevalue(model_fixture).model
    ids = prompt(130, model.config.vocab_size, seed=5)
    engine = engine_for(model, chunk_size=64, check="block", preempt_budget_ms=1e-4)
    engine.blocks.rule = dataclasses.replace(engine.blocks.rule, min_rows=16)  # 4 blocks a half
    expected = reference_logits(model, ids)
    rng = random.Random(model_fixture)
    for _ in range(3):
        channel, first = PreemptionChannel(), FirstLogits()
        stops = set(rng.sample(range(1, 60), k=8))
        trigger = StopAfter(model, channel, stops, halves=True)
        task = engine.new_task(GenerationRequest("t", ids, max_new_tokens=2))
        preemptions = 0
        try:
            while (outcome := engine.prefill(task, channel, first)).status is RunStatus.PREEMPTED:
                preemptions += 1
        finally:
            trigger.remove()
        assert outcome.status is RunStatus.PREFILLED and preemptions == len(stops)
        torch.testing.assert_close(first.logits, expected, atol=TOL, rtol=0)
        engine.cancel(task)
    assert engine.blocks.rate(ATTN) and engine.blocks.rate(MLP)


def test_a_cancel_between_blocks_stops_there_and_frees_the_slot(tiny_llama):
    model = tiny_llama.model
    engine = engine_for(model, chunk_size=None, check="block", block_rows=5)
    channel = PreemptionChannel()
    calls = 0

    def cancel_after_three(module, args, output):
        nonlocal calls
        calls += 1
        if calls == 3:
            channel.cancel()

    handle = model.model.layers[0].self_attn.o_proj.register_forward_hook(cancel_after_three)
    task = engine.new_task(GenerationRequest("c", prompt(40, model.config.vocab_size, 2)))
    try:
        outcome = engine.prefill(task, channel)
    finally:
        handle.remove()
    assert outcome.status is RunStatus.CANCELLED and calls == 3
    assert task.state is None and engine.pool.used_slots == 0 and engine.suspended_bytes == 0


@pytest.mark.parametrize("boundary", [2, 3, 6], ids=["in-attention", "after-attention", "later"])
def test_a_preempt_during_a_slotted_step_stops_at_that_boundary(tiny_llama, boundary):
    """The hook (a decode step slotted in) raises the flag at one boundary: no block runs
    after it. Before, the check came only before the hook, so the prefill ran one more block."""
    model = tiny_llama.model
    engine = engine_for(model, chunk_size=None, check="block", block_rows=16)
    channel = PreemptionChannel()
    blocks, hooks = [], []
    start = engine._block_clock.start

    def counted_start():
        blocks.append(1)
        start()

    def step_that_the_flag_comes_during():
        hooks.append(len(blocks))
        if len(hooks) == boundary:
            channel.preempt()

    engine._block_clock.start = counted_start
    task = engine.new_task(GenerationRequest("p", prompt(40, model.config.vocab_size, 4)))
    outcome = engine.prefill(task, channel, between_layers=step_that_the_flag_comes_during)
    assert outcome.status is RunStatus.PREEMPTED
    assert len(hooks) == boundary and len(blocks) == hooks[-1]


def test_operators_run_whole_without_a_budget_or_a_hook(tiny_llama):
    """check="layer" keeps the layer modules' own forward: one call per layer and chunk."""
    model = tiny_llama.model
    engine = engine_for(model, chunk_size=None, check="layer")
    channel = PreemptionChannel()
    trigger = StopAfter(model, channel, (), halves=True)
    try:
        engine.prefill(engine.new_task(GenerationRequest("w", prompt(40, 100, 3))), channel)
    finally:
        trigger.remove()
    assert trigger.calls == 2 * len(engine.layers)


@pytest.mark.parametrize("attn", ATTENTION)
def test_a_first_chunks_later_blocks_attend_without_a_mask_under_sdpa_on_the_cpu(request, attn):
    """The unmasked path (worker.block_attention) is the one the exactness tests above run for
    sdpa: a first chunk's blocks after the first, split in two flash calls and merged."""
    model = model_with_attention(request, "tiny_llama", attn).model
    engine = engine_for(model, chunk_size=None, check="block", block_rows=5)
    assert engine._unmasked_blocks is (attn == "sdpa")


def test_a_chunks_set_up_is_its_own_step_and_a_stop_during_it_runs_no_block(tiny_llama):
    """A chunk's masks are made before its first block, then the channel is read: a stop asked
    for meanwhile costs no block. Made inside the first blocks instead, they were in no plan
    (12 ms for 2048 rows over 4000 keys), and a stop at a chunk's start took 45-98 ms."""
    model = tiny_llama.model
    ids = prompt(48, model.config.vocab_size, seed=3)
    engine = engine_for(model, chunk_size=16, check="block", block_rows=5)
    channel, first = PreemptionChannel(), FirstLogits()
    made = engine._additive_mask

    def stop_while_setting_up(allowed):
        if allowed.shape[-1] > 16:  # the second chunk's masks (keys beyond the first chunk)
            channel.preempt()
        return made(allowed)

    engine._additive_mask = stop_while_setting_up
    task = engine.new_task(GenerationRequest("s", ids, max_new_tokens=2))
    outcome = engine.prefill(task, channel, first)
    assert outcome.status is RunStatus.PREEMPTED
    point = outcome.resume_point
    assert (point.tokens_done, point.layer, point.rows_done) == (16, 0, 0)  # no block ran
    assert task.state.context.block_masks  # the set-up is kept for the resume
    engine._additive_mask = made
    assert engine.prefill(task, channel, first).status is RunStatus.PREFILLED
    torch.testing.assert_close(first.logits, reference_logits(model, ids), atol=TOL, rtol=0)
