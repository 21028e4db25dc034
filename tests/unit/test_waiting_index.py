"""The scheduler's waiting index (``waiting_index``) and its sliding quantiles, on their own."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_service.scheduler import PrefillSample, PrefillTimePredictor, make_policy
from queue_service.scheduler.packing import PackLimits
from queue_service.scheduler.request import Request, RequestState
from queue_service.scheduler.sliding_quantile import SlidingQuantile
from queue_service.scheduler.waiting_index import WaitingIndex, left_features
from tests.tiers import UNIT_TIERS

CRITICAL, STANDARD, BATCH = (UNIT_TIERS[name] for name in UNIT_TIERS.names)


def request(seq: int, tier=CRITICAL, arrival_s: float = 0.0, tokens: int = 100, **fields):
    return Request(f"r{seq}", tier, arrival_s, tokens, seq=seq, **fields)


def index(predictor: PrefillTimePredictor | None = None, starvation_s: float = 300.0):
    predictor = predictor or PrefillTimePredictor(a=1e-3, b=0.0, c=0.0)  # 1000 tokens = 1 s
    return WaitingIndex(make_policy("flowprefill"), predictor, starvation_s), predictor


def waits(req: Request) -> bool:
    return req.waiting


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.integers(1, 8000),
    done=st.integers(0, 8000),
    chunk=st.integers(0, 4000),
    fraction=st.floats(0, 1.5),
    coefficients=st.tuples(*[st.floats(0, 1e-2)] * 3),
)
def test_the_features_give_the_predictors_estimate_for_any_coefficients(
    tokens, done, chunk, fraction, coefficients
):
    req = request(1, tokens=tokens, tokens_done=min(done, tokens), chunk_fraction=fraction)
    req.chunk_end = req.tokens_done + chunk
    predictor = PrefillTimePredictor(*coefficients)
    x, y, z = left_features(req)
    a, b, c = coefficients
    expected = predictor.predict_partial(tokens, req.tokens_done, req.chunk_end, fraction)
    # The predictor subtracts the chunk's done share from the whole: compare within the
    # rounding of the whole prompt's prediction.
    scale = predictor.predict(tokens)
    assert a * x + b * y + c * z == pytest.approx(expected, rel=1e-9, abs=1e-12 + 1e-12 * scale)


def test_the_committed_work_follows_a_refit_of_the_predictor():
    idx, predictor = index()
    reqs = [request(i, STANDARD, tokens=100 * i, key_id="k1" if i % 2 else "k2") for i in (1, 2, 3)]
    for req in reqs:
        idx.touch(req)
    idx.sync(0.0, waits)
    assert idx.committed_s("standard") == pytest.approx({"k1": 0.4, "k2": 0.2})
    predictor.fit([PrefillSample(n, 0, 2e-3 * n) for n in (100, 200, 400, 800, 1600)] * 2)
    assert idx.committed_s("standard") == pytest.approx({"k1": 0.8, "k2": 0.4})
    assert idx.backlog_s() == pytest.approx(1.2)
    assert idx.count("standard") == 3 and idx.count("critical") == 0


def test_a_keys_short_fresh_prompts_pay_the_fixed_cost_once_a_pack():
    """Packs of at most 3 prompts and 250 tokens: k1's four 100-token prompts fill two packs
    (by tokens), its 600-token prompt is not packable; k2's one prompt is a pack alone. A
    suspended prompt (work done) pays its own fixed cost."""
    predictor = PrefillTimePredictor(a=1e-3, b=0.0, c=0.05)  # 100 tokens alone: 0.15 s
    idx = WaitingIndex(make_policy("flowprefill"), predictor, 300.0, PackLimits(3, 250))
    reqs = [request(i, STANDARD, tokens=100, key_id="k1") for i in (1, 2, 3, 4)]
    reqs += [request(5, STANDARD, tokens=600, key_id="k1"), request(6, STANDARD, key_id="k2")]
    for req in reqs:
        idx.touch(req)
    idx.sync(0.0, waits)
    # k1: 1000 tokens = 1 s, + 2 packs' and the long prompt's fixed costs; k2: 0.1 + 0.05.
    assert idx.committed_s("standard") == pytest.approx({"k1": 1.15, "k2": 0.15})
    suspended = request(7, STANDARD, tokens=100, key_id="k2", tokens_done=50)
    suspended.state = RequestState.SUSPENDED
    idx.touch(suspended)
    idx.sync(0.0, waits)
    assert idx.committed_s("standard")["k2"] == pytest.approx(0.15 + 0.05 + 0.05)
    # Without packing every prompt pays its own, and the sums return to zero when they leave.
    alone = WaitingIndex(make_policy("flowprefill"), predictor, 300.0)
    for req in reqs:
        alone.touch(req)
    alone.sync(0.0, waits)
    assert alone.committed_s("standard") == pytest.approx({"k1": 1.25, "k2": 0.15})
    for req in reqs:
        req.state = RequestState.RUNNING
        idx.touch(req)
    idx.sync(0.0, waits)
    assert idx.committed_s("standard") == pytest.approx({"k2": 0.1})


def test_a_request_that_stops_waiting_leaves_and_the_sums_return_to_zero():
    idx, _ = index()
    req = request(1, tokens=333)
    idx.touch(req)
    idx.sync(0.0, waits)
    assert "r1" in idx and len(idx) == 1
    req.state = RequestState.RUNNING
    idx.touch(req)
    idx.sync(0.0, waits)
    assert "r1" not in idx and len(idx) == 0
    assert idx.committed_s("critical") == {} and idx.backlog_s() == 0.0


def test_the_window_holds_the_head_of_each_tier_by_deadline_and_by_lateness():
    idx, _ = index()
    # Critical prompts of 0.5 s due at 1.0 s + arrival; the longest one (0.9 s) is the next
    # to become late though it is due last.
    reqs = [request(i, arrival_s=0.01 * i, tokens=500) for i in range(1, 6)]
    reqs.append(request(6, arrival_s=0.06, tokens=900))
    reqs += [request(10 + i, BATCH, arrival_s=0.01 * i, tokens=500) for i in range(1, 4)]
    for req in reqs:
        idx.touch(req)
    idx.sync(0.07, waits)
    window = {r.request_id for r in idx.window(0.07, 1)}
    assert window == {"r1", "r6", "r11"}  # earliest deadline, next late, and batch's head
    assert len(idx.window(0.07, None)) == len(reqs)


def test_requests_move_to_the_late_queue_when_their_slack_runs_out():
    idx, _ = index()
    early, late = request(1, tokens=100), request(2, tokens=950)
    for req in (early, late):
        idx.touch(req)
    idx.sync(0.0, waits)
    assert {r.request_id for r in idx.by_tag("critical")} == {"r1", "r2"}
    idx.sync(0.06, waits)  # r2: 1.0 s deadline - 0.95 s left passed
    assert [r.request_id for r in idx.by_tag("critical")] == ["r1"]
    assert {r.request_id for r in idx.window(0.06, 1)} == {"r1", "r2"}  # head of each queue


def test_aged_due_and_extra_requests_are_always_in_the_window():
    idx, _ = index(starvation_s=10.0)
    old = request(1, BATCH, arrival_s=0.0)
    due = request(2, STANDARD, arrival_s=5.0, due=True)
    others = [request(3 + i, BATCH, arrival_s=1.0 + i) for i in range(5)]
    pinned = request(20, BATCH, arrival_s=8.0, state=RequestState.SUSPENDED)
    for req in (old, due, pinned, *others):
        idx.touch(req)
    idx.sync(10.5, waits)
    ids = {r.request_id for r in idx.window(10.5, 1, extra=[pinned])}
    assert {"r1", "r2", "r20"} <= ids
    assert "r5" not in ids  # behind the batch tier's head and not aged


def test_a_sliding_quantile_is_numpys():
    window = SlidingQuantile(5)
    assert math.isnan(window.quantile(0.5))
    values = [3.0, -1.0, 7.5, 2.25, 0.0, 9.0, -4.0, 1e-9]
    for i, value in enumerate(values):
        window.add(value)
        kept = values[max(0, i - 4) : i + 1]
        for q in (0.0, 0.1, 0.5, 0.95, 0.99, 1.0):
            assert window.quantile(q) == float(np.quantile(kept, q))
    assert list(window) == values[-5:]


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=60),
    size=st.integers(1, 40),
    q=st.floats(0, 1),
)
def test_sliding_quantiles_match_numpy_exactly(values, size, q):
    window = SlidingQuantile(size)
    for value in values:
        window.add(value)
    assert window.quantile(q) == float(np.quantile(values[-size:], q))
