"""The planner against its earlier, plainer self: changes made for speed must not change a
decision. Each reference below is the code as it was before such a change, kept verbatim; a
property test (hypothesis) compares the two on random queues.

- ``guard_tiers``: asked "is a lower tier ahead?" by walking the whole prefix for every request
  (quadratic in the queue) and recomputed every request's predicted time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from queue_service.scheduler import PrefillTimePredictor, make_policy
from queue_service.scheduler.planner import Estimator, Rules, guard_tiers, rank_waiting
from queue_service.scheduler.prediction_error import PredictionErrors
from queue_service.scheduler.request import Request, RequestState, WorkerSlot
from tests.tiers import UNIT_TIERS


def reference_guard_tiers(
    aged: Sequence[Request],
    ranked: Sequence[Request],
    left: Mapping[str, float],
    policy,
    estimator: Estimator,
    now: float,
    workers: Sequence[WorkerSlot],
) -> list[Request]:
    lanes = max(1, len(workers))
    cost = {r.request_id: estimator.prefill_left(r, now) for r in (*aged, *ranked)}
    margin, switch_s = estimator.errors.margin(), estimator.switch.p95()
    aged_cost = sum(cost[r.request_id] for r in aged)

    def moved_forward(prefix: list[Request], req: Request) -> list[Request] | None:
        mine = left[req.request_id]
        if req.prefilled or not policy.on_time(req, now, mine, switch_s):
            return None
        keep = [r for r in prefix if r.tier.rank <= req.tier.rank]
        lower = [r for r in prefix if r.tier.rank > req.tier.rank]
        urgent = [
            r for r in lower if policy.holds_off(r, now, left[r.request_id], mine, margin, switch_s)
        ]
        ahead = aged_cost + sum(cost[r.request_id] for r in (*keep, *urgent))
        if policy.guarded(req, now, ahead / lanes, mine, margin, switch_s):
            return [*keep, req, *lower]
        rest = [r for r in lower if r not in urgent]
        return [*keep, *urgent, req, *rest] if rest else None

    order = list(ranked)
    i = 0
    while i < len(order):
        req = order[i]
        if any(r.tier.rank > req.tier.rank for r in order[:i]):
            prefix = moved_forward(order[:i], req)
            if prefix is not None:
                order[: i + 1] = prefix
        i += 1
    return order


requests = st.lists(
    st.tuples(
        st.sampled_from(UNIT_TIERS.names),
        st.floats(0.0, 6.0),  # how long ago it arrived: deadlines near enough to matter
        st.integers(1, 2500),  # prompt tokens (1000 = 1 s of prefill)
        st.integers(0, 3),  # key
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(requests, st.floats(10.0, 30.0), st.integers(1, 3))
def test_guard_tiers_decides_as_the_reference(specs, now, n_workers):
    policy = make_policy("flowprefill")
    estimator = Estimator(
        PrefillTimePredictor(a=1e-3, b=0.0, c=0.0), PredictionErrors(default_margin=0.2)
    )
    rules = Rules(starvation_s=300.0, max_preemptions=32, max_suspended_per_worker=4)
    reqs = [
        Request(
            request_id=f"r{i}",
            tier=UNIT_TIERS[tier],
            arrival_s=now - ago,
            prompt_tokens=tokens,
            seq=i + 1,
            key_id=f"k{key}",
            state=RequestState.QUEUED,
        )
        for i, (tier, ago, tokens, key) in enumerate(specs)
    ]
    workers = [WorkerSlot(f"w{i}", i + 1, kv_slots=8) for i in range(n_workers)]
    left = {r.request_id: estimator.prefill_left(r, now) for r in reqs}
    ranked = sorted(reqs, key=lambda r: policy.key(r, now, left[r.request_id]))
    got = guard_tiers([], ranked, left, policy, estimator, now, workers)
    want = reference_guard_tiers([], ranked, left, policy, estimator, now, workers)
    assert [r.request_id for r in got] == [r.request_id for r in want]
    # And through the whole ranking.
    assert rank_waiting(reqs, policy, estimator, rules, now, workers)
