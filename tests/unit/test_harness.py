"""The real scheduler driving the real engine in one process (the policy benchmark's harness)."""

from __future__ import annotations

import io
import itertools
import time

import pytest
import torch
from rich.console import Console

from bench.event_log import EventLog, read
from bench.harness import run_policy
from bench.misses import report, waits
from bench.workload import Arrival, Workload, prompt_ids
from queue_service.scheduler import PrefillTimePredictor, Scheduler, SchedulerConfig, make_policy
from queue_service.scheduler.policies import ABLATIONS
from tierflow.tiers import TierPolicy, TierTable
from worker.batch_engine import BatchEngine
from worker.config import BatchConfig, EngineConfig

TIERS = TierTable(
    [
        TierPolicy("critical", 0, ttft_slo_s=1.0),
        TierPolicy("standard", 1, ttft_slo_s=5.0),
        TierPolicy("batch", 2, ttft_slo_s=600.0, sheddable=True),
    ]
)


class SlowLayers:
    """Makes every decoder layer of a prefill take at least ``seconds`` (sleeping releases the
    GIL), so a tiny model's prefill lasts long enough for an arrival to land inside it on any
    machine. On its attention: a prefill with a decode slotter runs a layer as its halves."""

    def __init__(self, model, seconds: float) -> None:
        self.handles = [
            layer.self_attn.register_forward_pre_hook(lambda m, a: time.sleep(seconds))
            for layer in model.model.layers
        ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class LogitsTap:
    """Records the LM head's output at every call (one per first token with max_new_tokens=1)."""

    def __init__(self, model) -> None:
        self.calls: list[torch.Tensor] = []
        self.handle = model.lm_head.register_forward_hook(
            lambda m, a, out: self.calls.append(out[0, -1].clone())
        )


def test_critical_preempts_a_long_batch_prefill_which_then_finishes_exactly(tiny_llama):
    model = tiny_llama.model
    batch = Arrival(0.0, "batch-1", "batch", prompt_tokens=1500)
    critical = Arrival(0.4, "crit-1", "critical", prompt_tokens=24)
    workload = Workload("one batch, one critical", (batch, critical))
    vocab = model.config.vocab_size
    with torch.no_grad():
        expected = {
            a.request_id: model(torch.tensor([prompt_ids(a, vocab)])).logits[0, -1]
            for a in (batch, critical)
        }
    # The predictor says the batch prefill takes 10 s: the critical request would miss its 1 s
    # SLO by waiting, so flowprefill must preempt.
    predictor = PrefillTimePredictor(a=10.0 / 1500, b=0.0, c=0.0)
    scheduler = Scheduler(make_policy("flowprefill"), TIERS, predictor)
    engine = BatchEngine(model, EngineConfig(chunk_size=256, check="layer"))
    slow, tap = SlowLayers(model, 0.03), LogitsTap(model)  # batch prefill ~0.7 s
    try:
        result = run_policy(scheduler, [engine], workload, vocab_size=vocab)
    finally:
        slow.remove()
        tap.handle.remove()

    b, c = result.records["batch-1"], result.records["crit-1"]
    assert b.preemptions == 1 and b.recomputes == 0 and c.preemptions == 0
    assert c.first_token_at < b.first_token_at  # the critical request went first
    # Preempted within about one layer (30 ms here), with a generous margin for a loaded CI.
    assert len(result.preemption_latencies_s) == 1 and result.preemption_latencies_s[0] < 0.5
    # LM-head calls in first-token order: critical, then the resumed batch request.
    assert len(tap.calls) == 2
    torch.testing.assert_close(tap.calls[0], expected["crit-1"], atol=1e-4, rtol=0)
    torch.testing.assert_close(tap.calls[1], expected["batch-1"], atol=1e-4, rtol=0)
    assert engine.suspended_bytes == 0


# The order each policy promises for requests that wait together (module doc of policies.py):
# fifo arrival order; the priority family tier rank, then arrival; flowprefill and its
# ablations tier rank (EDF within a tier; late work keeps its tier).
ARRIVAL_ORDER = {"fifo"}
TIER_THEN_ARRIVAL = {"priority", "chunked", "recompute", "priority-layer"}
LAYER_DELAY_S = 0.004


@pytest.mark.parametrize(
    "policy", ["fifo", "priority", "chunked", "recompute", "flowprefill", *ABLATIONS]
)
def test_every_policy_completes_a_mixed_workload_in_the_order_it_promises(tiny_llama, policy):
    model = tiny_llama.model
    # A critical prefill of 16 slowed layer calls (>= 64 ms) runs while twelve requests of
    # every tier arrive behind it, in a known order: they all wait together.
    blocker = Arrival(0.0, "blocker", "critical", 256, 3)
    arrivals = tuple(
        Arrival(0.02 + 0.001 * i, f"r{i}", ("batch", "standard", "critical")[i % 3], 40 + 37 * i, 3)
        for i in range(12)
    )
    p = make_policy(policy)
    engine = BatchEngine(model, EngineConfig(chunk_size=64, check=p.engine_check))
    slow = SlowLayers(model, LAYER_DELAY_S)
    # No packed prefill: a pack takes short prompts ranked after its head in one forward and
    # may pass over a longer one that still makes its deadline (test_scheduler_packing.py);
    # here each policy's own order is under test.
    unpacked = SchedulerConfig(max_pack_size=1)
    try:
        result = run_policy(
            Scheduler(p, TIERS, PrefillTimePredictor(), unpacked),
            [engine],
            Workload("mixed", (blocker, *arrivals)),
            vocab_size=model.config.vocab_size,
        )
    finally:
        slow.remove()
    records = result.records
    assert all(r.done_at is not None and r.failed is None for r in records.values())
    for a in (blocker, *arrivals):  # a TTFT covers at least the request's own slowed layers
        layer_calls = -(-a.prompt_tokens // 64) * len(model.model.layers)
        assert records[a.request_id].ttft_s >= layer_calls * LAYER_DELAY_S, a
    first_tokens = [
        a.request_id for a in sorted(arrivals, key=lambda a: records[a.request_id].first_token_at)
    ]
    rank = {t.name: t.rank for t in TIERS}
    by_arrival = [a.request_id for a in arrivals]
    by_tier = [a.request_id for a in sorted(arrivals, key=lambda a: rank[a.tier])]  # stable
    if policy in ARRIVAL_ORDER:
        assert first_tokens == by_arrival
    elif policy in TIER_THEN_ARRIVAL:
        assert first_tokens == by_tier
    else:
        tiers = [records[rid].arrival.tier for rid in first_tokens]
        assert tiers == sorted(tiers, key=rank.get), first_tokens
    assert result.busy_s > 0 and engine.suspended_bytes == 0


@pytest.mark.parametrize("policy", ["fifo", "flowprefill"])
def test_a_batched_worker_decodes_requests_together_and_streams_each_token_once(tiny_llama, policy):
    model = tiny_llama.model
    tiers = TierTable(
        [
            TierPolicy("critical", 0, ttft_slo_s=1.0, tbt_slo_s=0.2),
            TierPolicy("standard", 1, ttft_slo_s=5.0, tbt_slo_s=1.0),
            TierPolicy("batch", 2, ttft_slo_s=600.0, sheddable=True, tbt_slo_s=5.0),
        ]
    )
    # Four short standard prompts arrive together while a long batch prompt prefills: they
    # wait for it (fifo) or preempt it (flowprefill), and either way find each other waiting
    # when the prefill frees, so they pack; then a mix of tiers arrives one by one.
    arrivals = (
        Arrival(0.0, "r0", "batch", 480, 24),
        *(Arrival(0.001, f"r{i}", "standard", 30 + 9 * i, 24) for i in range(1, 5)),
        *(
            Arrival(0.05 + 0.01 * i, f"r{i}", ("critical", "batch")[i % 2], 40 + 7 * i, 24)
            for i in range(5, 8)
        ),
    )
    p = make_policy(policy)
    engine = BatchEngine(
        model,
        EngineConfig(chunk_size=64, check=p.engine_check),
        BatchConfig(max_batch_size=4, pool_slots=6, slot_tokens=512),
    )
    result = run_policy(
        Scheduler(p, tiers, PrefillTimePredictor()),
        [engine],
        Workload("mixed, decoding", arrivals),
        vocab_size=model.config.vocab_size,
    )
    records = result.records.values()
    assert all(r.done_at is not None and r.failed is None for r in records)
    assert all(len(r.token_times) == 24 for r in records)  # each token once, none lost
    spans = sorted((r.first_token_at, r.done_at) for r in records)
    overlapping = sum(a[1] > b[0] for a, b in itertools.pairwise(spans))
    assert overlapping > 0  # some requests decoded at the same time
    assert result.counters.get("packs", 0) >= 1  # waiting short prompts were prefilled together
    assert result.decode_rows > result.decode_steps  # more than one row per step on average
    vocab = model.config.vocab_size
    with torch.no_grad():  # packed or not, each first token is the request's own
        for a in arrivals:
            logits = model(torch.tensor([prompt_ids(a, vocab)])).logits[0, -1]
            assert result.records[a.request_id].first_token == int(logits.argmax()), a
    assert engine.pool.used_slots == 0 and engine.suspended_bytes == 0


def test_the_event_log_tells_what_a_missed_request_waited_for(tiny_llama, tmp_path):
    """The run of the first test with its timeline written (`tierflow bench --event-log`):
    `tierflow misses` finds the critical request's preemption and the batch request's."""
    model = tiny_llama.model
    batch = Arrival(0.0, "batch-1", "batch", prompt_tokens=1500)
    critical = Arrival(0.4, "crit-1", "critical", prompt_tokens=24)
    workload = Workload("one batch, one critical", (batch, critical))
    scheduler = Scheduler(
        make_policy("flowprefill"), TIERS, PrefillTimePredictor(a=10.0 / 1500, b=0.0, c=0.0)
    )
    engine = BatchEngine(model, EngineConfig(chunk_size=256, check="layer"))
    log = EventLog(tmp_path / "run.jsonl", steal_interval_s=0.05)
    slow = SlowLayers(model, 0.03)
    try:
        result = run_policy(
            scheduler,
            [engine],
            workload,
            vocab_size=model.config.vocab_size,
            event_log=log,
            admission=True,  # its records carry no engine time: `misses` must place them too
        )
    finally:
        slow.remove()
        log.close()
    assert [r["request_id"] for r in read(log.path) if r["kind"] == "admit"] == [
        "batch-1",
        "crit-1",
    ]
    (wait,) = waits(read(log.path), "critical")
    record = result.records["crit-1"]
    assert wait.request_id == "crit-1" and wait.prompt_tokens == 24
    assert wait.ttft_s == pytest.approx(record.ttft_s, abs=1e-6)
    assert len(wait.preempt_acks_s) == 1 and wait.preempt_acks_s[0] > 0
    assert wait.preempt_acks_s[0] <= wait.to_assign_s < wait.ttft_s
    assert wait.first_before == ()  # the batch request's first token came after
    assert wait.steal is not None and 0.0 <= wait.steal <= 1.0  # sampled while it waited
    (batch_wait,) = waits(read(log.path), "batch")
    assert "crit-1" in batch_wait.first_before
    missed = report(log.path, "critical", 0.0, Console(width=200, file=io.StringIO()))
    assert [w.request_id for w in missed] == ["crit-1"]
