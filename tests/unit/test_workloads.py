"""Workload generation and trace replay (both supported trace shapes, and the real Azure trace)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.traces import TraceOptions, load_trace_workload, read_trace
from bench.workload import DEFAULT_MIX, prompt_ids, synthetic

AZURE_TRACE = (
    Path(__file__).resolve().parents[3] / "shared/traces/azure_llm_inference_code_2023.csv"
)


def test_synthetic_is_deterministic_sorted_and_follows_the_mix():
    a, b = synthetic(duration_s=200, seed=3), synthetic(duration_s=200, seed=3)
    assert a == b and a != synthetic(duration_s=200, seed=4)
    times = [x.at_s for x in a.arrivals]
    assert times == sorted(times) and times[-1] < 200
    assert len({x.request_id for x in a.arrivals}) == len(a.arrivals)
    for mix in DEFAULT_MIX:
        mine = [x for x in a.arrivals if x.tier == mix.tier]
        assert all(mix.min_tokens <= x.prompt_tokens <= mix.max_tokens for x in mine)
        # Poisson counts: within 40% of rate x duration over 200 s.
        assert abs(len(mine) - mix.rate_per_s * 200) < 0.4 * mix.rate_per_s * 200


def test_a_time_scale_stretches_the_gaps_of_the_same_requests():
    base = synthetic(duration_s=60, seed=4, max_new_tokens=128)
    slow = synthetic(duration_s=60, seed=4, max_new_tokens=128, time_scale=1.7)
    assert len(slow.arrivals) == len(base.arrivals) and "x1.7" in slow.name
    for a, b in zip(base.arrivals, slow.arrivals, strict=True):
        assert b.at_s == pytest.approx(a.at_s * 1.7)
        assert (b.request_id, b.tier, b.prompt_tokens, b.max_new_tokens) == (
            a.request_id, a.tier, a.prompt_tokens, a.max_new_tokens,
        )  # fmt: skip
    with pytest.raises(ValueError, match="time_scale"):
        synthetic(duration_s=60, time_scale=0)


def test_prompt_ids_are_repeatable_and_in_the_vocabulary():
    w = synthetic(duration_s=30, seed=1)
    first = w.arrivals[0]
    ids = prompt_ids(first, vocab_size=100)
    assert len(ids) == first.prompt_tokens and ids == prompt_ids(first, vocab_size=100)
    assert all(3 <= i < 100 for i in ids)


def test_azure_csv_shape(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:04.0319600,60,8\n"
        "2023-11-16 18:17:05.9799600,700,27\n"
    )
    records = read_trace(path)
    assert [r.input_tokens for r in records] == [4808, 60, 700]
    assert records[1].at_s == pytest.approx(0.052) and records[2].at_s == pytest.approx(2.0)
    opts = TraceOptions(duration_s=10, time_scale=2.0, critical_share=1.0, max_new_tokens=4)
    w = load_trace_workload(path, opts)
    assert [a.tier for a in w.arrivals] == ["batch", "critical", "standard"]
    assert w.arrivals[2].at_s == pytest.approx(4.0)
    assert [a.max_new_tokens for a in w.arrivals] == [4, 4, 4]


def test_mooncake_jsonl_shape_window_and_length_scaling(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": t, "input_length": n, "output_length": 3, "hash_ids": []}
        for t, n in [(0, 9000), (1500, 100), (2500, 50), (9000, 10)]
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    opts = TraceOptions(start_s=1.0, duration_s=5.0, length_scale=0.5, critical_share=0.0)
    w = load_trace_workload(path, opts)
    assert [a.prompt_tokens for a in w.arrivals] == [50, 25]
    assert [a.at_s for a in w.arrivals] == pytest.approx([0.5, 1.5])
    assert {a.tier for a in w.arrivals} == {"standard"}


def test_unknown_trace_format_is_a_clear_error(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("hello\n")
    with pytest.raises(ValueError, match="unknown trace format"):
        read_trace(path)


def test_the_real_azure_trace_replays():
    records = read_trace(AZURE_TRACE)
    assert len(records) == 8819
    w = load_trace_workload(AZURE_TRACE, TraceOptions(duration_s=120, length_scale=0.5, seed=1))
    assert w.arrivals and {a.tier for a in w.arrivals} == {"critical", "standard", "batch"}
    assert all(8 <= a.prompt_tokens <= 4096 for a in w.arrivals)
    assert w == load_trace_workload(
        AZURE_TRACE, TraceOptions(duration_s=120, length_scale=0.5, seed=1)
    )


def test_synthetic_outputs_spread_below_the_longest_and_keep_the_arrivals():
    prefill_only = synthetic(duration_s=200, seed=5)
    decoding = synthetic(duration_s=200, seed=5, max_new_tokens=128)
    # Same arrivals, same prompts: only the output lengths differ.
    assert [(a.at_s, a.tier, a.prompt_tokens) for a in decoding.arrivals] == [
        (a.at_s, a.tier, a.prompt_tokens) for a in prefill_only.arrivals
    ]
    assert {a.max_new_tokens for a in prefill_only.arrivals} == {1}
    lengths = sorted(a.max_new_tokens for a in decoding.arrivals)
    assert lengths[0] >= 1 and lengths[-1] <= 128
    median = lengths[len(lengths) // 2]
    assert 16 <= median <= 64  # a quarter of the longest, give or take the draw
    assert lengths[-1] > 2 * median  # a long tail
    assert decoding == synthetic(duration_s=200, seed=5, max_new_tokens=128)


def test_trace_output_lengths_scale_and_clip(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,100,10\n"
        "2023-11-16 18:17:04.0319600,60,800\n"
    )
    opts = TraceOptions(duration_s=10, max_new_tokens=200, output_scale=0.5)
    assert [a.max_new_tokens for a in load_trace_workload(path, opts).arrivals] == [5, 200]
