"""``choose_preemptions`` against its earlier, plainer self (as of c24d3fc, with
``_cheaper_eviction`` as it was then): the same decisions on random fleets. The reference
recomputed each victim's predicted time for every waiting request, rebuilt the allowed victims
and scanned every worker for the next free one, per waiting request: O(waiting x workers) for
the bookkeeping alone. Kept verbatim but for names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from queue_service.scheduler import PrefillTimePredictor, make_policy
from queue_service.scheduler.planner import (
    Estimator,
    Preemption,
    Rules,
    _busy_workers,
    _Lanes,
    choose_preemptions,
    evictable_decodes,
    rank_waiting,
)
from queue_service.scheduler.policies import Outlook, SchedulingPolicy, SortKey
from queue_service.scheduler.prediction_error import PredictionErrors
from queue_service.scheduler.request import Request, RequestState, WorkerSlot
from tests.tiers import UNIT_TIERS


def own_prefill_left(workers, requests, estimator: Estimator, now: float) -> dict[str, float]:
    """Each worker's running request's own prefill left (what a worker without a pack has)."""
    return {
        w.worker_id: estimator.prefill_left(requests[w.active], now)
        for w in workers
        if w.active in requests
    }


def reference_choose_preemptions(
    waiting: Sequence[Request],
    workers: Sequence[WorkerSlot],
    requests: Mapping[str, Request],
    policy: SchedulingPolicy,
    estimator: Estimator,
    rules: Rules,
    now: float,
    prefill_left: Mapping[str, float],
) -> list[Preemption]:
    """Running requests to preempt, for whom, and whether the victim's state is dropped (the
    policy's rule, or its worker's suspended states full) or a decode evicted for it.

    ``waiting``: the ranked requests that found no free worker. Walks them best first while
    simulating when each would start if nothing were preempted (list scheduling on the
    predicted busy time of every worker), which gives the policy the ``wait_s`` it needs to
    judge whether waiting is acceptable. At most one victim per worker and per beneficiary.
    """
    if not policy.preempts or not workers:
        return []
    free_at, victims = _busy_workers(workers, requests, estimator, rules, now, prefill_left)
    covered = {w.reserved_for for w in workers if w.reserved_for}
    seq = {w.worker_id: w.seq for w in workers}
    suspended = {w.worker_id: len(w.suspended) for w in workers}
    # A worker whose KV slots are all held has no room for a new request's state unless the
    # preempted request gives its own up.
    full = {w.worker_id: not w.has_kv_slot for w in workers}
    decoding = {w.worker_id: evictable_decodes(w, requests, rules, now) for w in workers}
    # Where a new request may start: not on a draining worker (it takes nothing new).
    serving = [w.worker_id for w in workers if not w.draining]
    draining = {w.worker_id for w in workers if w.draining}

    chosen: list[Preemption] = []
    for req in waiting:
        if not victims:
            break
        if req.request_id in covered:
            continue  # a worker is being preempted for it; its start is already counted
        pinned = req.worker_id if req.state is RequestState.SUSPENDED else None
        if pinned is not None:
            target = pinned
        elif serving:
            target = min(serving, key=lambda wid: (free_at[wid], seq[wid]))
        else:
            continue  # every worker is draining: nothing to preempt for a new request
        start = free_at[target]
        busy = estimator.prefill_left(req, now)
        picked = None
        if not rules.aged(req, now):
            # Aged requests go first when a worker frees, but do not preempt: that keeps an
            # old batch request from evicting a premium one.
            # Only a request whose state a draining worker holds may preempt there.
            allowed = {wid: v for wid, v in victims.items() if wid not in draining or wid == pinned}
            picked = reference_pick_victim(
                req, pinned, start - now, busy, allowed, suspended, full,
                policy, estimator, rules, now,
            )  # fmt: skip
        if picked is None:
            free_at[target] = start + busy  # it would take that worker when it frees
            continue
        victim, drop = picked
        assert victim.worker_id is not None
        chosen.append(
            reference_preemption(
                victim, req, drop, pinned, full, suspended, decoding, policy, estimator,
                rules, now,
            )
        )  # fmt: skip
        del victims[victim.worker_id]
        free_at[victim.worker_id] = now + busy
    return chosen


def reference_preemption(
    victim, req, drop, pinned, full, suspended, decoding, policy, estimator, rules, now
) -> Preemption:
    """The preemption of ``victim`` for ``req``: its state dropped, or a cheaper decode
    evicted in its place where its worker's KV slots are full."""
    wid = victim.worker_id
    evict = None
    if drop and not policy.drop_state and full[wid] and pinned is None:
        evict = reference_cheaper_eviction(victim, req, decoding[wid], estimator, now)
    if evict is not None and suspended[wid] < rules.max_suspended_per_worker:
        decoding[wid].remove(evict)
        return Preemption(victim, req, False, evict)
    return Preemption(victim, req, drop)


def reference_cheaper_eviction(
    victim: Request,
    beneficiary: Request,
    decoding: Sequence[Request],
    estimator: Estimator,
    now: float,
) -> Request | None:
    """The decode to drop instead of the victim's prefill state, if one costs less to
    recompute than the prefill work the drop would throw away, and is of a tier below the
    beneficiary's and no higher than the victim's: a long prefill that was nearly done is
    not restarted from scratch to spare a short decode of the same or a lower tier."""
    done_s = estimator.predictor.predict(victim.prompt_tokens) - estimator.prefill_left(victim, now)
    candidates = [
        (estimator.predictor.predict(r.prompt_tokens), r.seq, r)
        for r in decoding
        if r.tier.rank > beneficiary.tier.rank and r.tier.rank >= victim.tier.rank
    ]
    cheapest = min(candidates, default=None, key=lambda c: (c[0], c[1]))
    if cheapest is None or cheapest[0] >= done_s:
        return None
    return cheapest[2]


def reference_pick_victim(
    req: Request,
    pinned: str | None,
    wait_s: float,
    busy_s: float,
    victims: Mapping[str, Request],
    suspended: Mapping[str, int],
    full: Mapping[str, bool],
    policy: SchedulingPolicy,
    estimator: Estimator,
    rules: Rules,
    now: float,
) -> tuple[Request, bool] | None:
    """The running request to preempt for ``req``, and whether its state must be dropped."""
    waiting_left = estimator.prefill_left(req, now)
    margin = estimator.errors.margin()
    switch_s = estimator.switch.p95()
    eligible: list[tuple[tuple[bool, SortKey], Request, bool]] = []
    for worker_id, running in victims.items():
        if pinned is not None and worker_id != pinned:
            continue  # a suspended request can only run where its state is
        if running.tier is req.tier and running.key_id != req.key_id:
            # Between the keys of one tier fair order decides (``fairness``), not deadlines:
            # preempting by deadline would let the victim rank first again once the worker
            # is free (a preempt/resume loop).
            continue
        if len(running.pack) > 1 and req.tier.rank >= running.tier.rank:
            continue  # a pack gives way to a higher tier only (``packing``)
        # Past the cap on suspended states (memory), the victim's state is dropped: it is
        # recomputed later, which beats a higher tier waiting behind it.
        drop = policy.drop_state
        if not drop:
            # The victim's state stays on its worker; a resumed beneficiary frees one slot.
            held = suspended[worker_id] - (1 if pinned == worker_id else 0)
            drop = held >= rules.max_suspended_per_worker
            # A new request needs a KV slot: on a full worker, keeping the victim's state would
            # leave the beneficiary without one, and the freed prefill would go straight back
            # to the victim (a preempt/resume loop).
            drop = drop or (full[worker_id] and pinned is None)
        running_left = estimator.prefill_left(running, now)
        outlook = Outlook(waiting_left, running_left, wait_s, margin, req.due, switch_s)
        if policy.should_preempt(req, running, now, outlook):
            key = policy.victim_key(running, now, running_left, busy_s)
            eligible.append(((drop and not policy.drop_state, key), running, drop))
    if not eligible:
        return None
    _, victim, drop = min(eligible, key=lambda kv: kv[0])
    return victim, drop


running_spec = st.tuples(
    st.sampled_from(UNIT_TIERS.names),
    st.floats(0.0, 3.0),  # how long ago it arrived
    st.integers(100, 3000),  # prompt tokens (1000 = 1 s)
    st.floats(0.0, 0.9),  # share of its prefill done
    st.integers(0, 8),  # preemptions so far
    st.integers(0, 2),  # key (of one key with a waiting request: deadlines decide between them)
)
decode_spec = st.tuples(st.sampled_from(UNIT_TIERS.names), st.integers(10, 2000))
worker_spec = st.tuples(
    st.none() | running_spec,  # its prefill
    st.lists(decode_spec, max_size=3),  # its decoding rows
    st.integers(0, 4),  # suspended states
    st.integers(1, 8),  # KV slots
    st.booleans(),  # draining
)
waiting_spec = st.tuples(
    st.sampled_from(UNIT_TIERS.names),
    st.floats(0.0, 0.6),  # mostly still on time: then the predicted wait decides
    st.integers(1, 400) | st.integers(1, 2000),
    st.integers(0, 2),  # key
    st.booleans(),  # due (its wake-up fired)
)


def build(workers_specs, waiting_specs, now):
    requests: dict[str, Request] = {}
    workers: list[WorkerSlot] = []
    seq = 0

    def new(rid, tier, ago, tokens, **kw) -> Request:
        nonlocal seq
        seq += 1
        req = Request(rid, UNIT_TIERS[tier], now - ago, tokens, seq=seq, **kw)
        requests[rid] = req
        return req

    for w, (prefill, decodes, n_suspended, slots, draining) in enumerate(workers_specs):
        worker = WorkerSlot(f"w{w}", w + 1, kv_slots=slots, draining=draining)
        workers.append(worker)
        if prefill is not None:
            tier, ago, tokens, share, preemptions, key = prefill
            req = new(f"p{w}", tier, ago, tokens, worker_id=worker.worker_id,
                      state=RequestState.RUNNING, tokens_done=int(tokens * share),
                      preemptions=preemptions, progress_at_s=now, key_id=f"k{key}")  # fmt: skip
            worker.active = req.request_id
        for d, (tier, tokens) in enumerate(decodes):
            req = new(f"d{w}.{d}", tier, 0.5, tokens, worker_id=worker.worker_id,
                      state=RequestState.DECODING, prefilled=True, tokens_done=tokens)  # fmt: skip
            worker.decoding[req.request_id] = None
        for s in range(n_suspended):
            req = new(f"s{w}.{s}", "batch", 1.0, 500, worker_id=worker.worker_id,
                      state=RequestState.SUSPENDED, tokens_done=200)  # fmt: skip
            worker.suspended[req.request_id] = None
    for i, (tier, ago, tokens, key, due) in enumerate(waiting_specs):
        new(f"q{i}", tier, ago, tokens, key_id=f"k{key}", due=due)
    return requests, workers


def summary(chosen: Sequence[Preemption]) -> list[tuple]:
    return [
        (c.victim.request_id, c.beneficiary.request_id, c.drop_state,
         c.evict.request_id if c.evict else None)
        for c in chosen
    ]  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(
    st.lists(worker_spec, min_size=1, max_size=6),
    st.lists(waiting_spec, min_size=1, max_size=25),
    st.sampled_from(["flowprefill", "recompute", "chunked"]),
)
def test_choose_preemptions_decides_as_the_reference(workers_specs, waiting_specs, policy_name):
    now = 100.0
    policy = make_policy(policy_name)
    estimator = Estimator(
        PrefillTimePredictor(a=1e-3, b=0.0, c=0.0), PredictionErrors(default_margin=0.2)
    )
    rules = Rules(starvation_s=300.0, max_preemptions=8, max_suspended_per_worker=4)
    results = []
    for choose in (choose_preemptions, reference_choose_preemptions):
        requests, workers = build(workers_specs, waiting_specs, now)  # fresh: no shared state
        ranked = rank_waiting(requests.values(), policy, estimator, rules, now, workers)
        waiting = [r for r in ranked if r.waiting]
        left = own_prefill_left(workers, requests, estimator, now)  # no packs here
        results.append(
            summary(choose(waiting, workers, requests, policy, estimator, rules, now, left))
        )
    assert results[0] == results[1]


def test_the_lanes_give_the_worker_that_frees_first_as_list_scheduling_moves_them():
    workers = [WorkerSlot("w0", 1), WorkerSlot("w1", 2), WorkerSlot("w2", 3, draining=True)]
    free_at = {"w0": 1.0, "w1": 1.0, "w2": 0.0}
    lanes = _Lanes(free_at, workers)
    assert lanes.next_free() == "w0"  # a tie goes to join order; a draining worker never
    lanes.busy_until("w0", 3.0)
    assert lanes.next_free() == "w1"  # w0's old entry is stale
    lanes.busy_until("w1", 4.0)
    assert lanes.next_free() == "w0"
    lanes.busy_until("w2", 0.5)  # a draining worker's time moves, it is still not a lane
    assert lanes.next_free() == "w0" and free_at["w2"] == 0.5
    assert not _Lanes({"w2": 0.0}, [workers[2]])
