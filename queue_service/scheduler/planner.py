"""Who runs where: rank the waiting requests, fill free workers, choose preemptions.

Pure functions of the scheduler's state at one instant: they decide and return decisions; the
Scheduler applies them and turns them into commands. The rules common to every policy live
here: aging (a request that has waited ``starvation_s`` since arrival goes first and is not
preempted any more), the per-request preemption bound, the cap on suspended states per worker,
and one preemption per waiting request (the worker being preempted is marked with the request
it is preempted for, so that request does not cause a second preemption meanwhile).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from queue_service.scheduler.fairness import fair_order
from queue_service.scheduler.policies import Outlook, SchedulingPolicy, SortKey, slack_s
from queue_service.scheduler.prediction_error import PredictionErrors, SwitchTime
from queue_service.scheduler.predictor import PrefillTimePredictor
from queue_service.scheduler.request import Request, RequestState, WorkerSlot


@dataclass
class Estimator:
    """Predicted time left for a request's prefill: what it holds its worker's engine for
    (past its first token it decodes in the worker's batch, beside the next prefill).

    One event reads the same request's estimate many times (admission, fair order, ranking,
    preemption, decode pressure, packing, wake-ups). At one instant it does not change once the
    event's own news is applied: a decision only starts, preempts or pauses requests, and one
    started now has done nothing yet. So between ``hold(now)`` and ``release()`` each
    request's estimate at ``now`` is computed once.
    """

    predictor: PrefillTimePredictor
    errors: PredictionErrors
    switch: SwitchTime = field(default_factory=SwitchTime)
    _held_at: float | None = field(default=None, init=False, repr=False)
    _memo: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def hold(self, now: float) -> None:
        """From here to ``release`` no request's estimate changes but by time passing: keep
        each one computed at ``now`` (already held at ``now``: keep those kept)."""
        if self._held_at != now:
            self._held_at = now
            self._memo.clear()

    def release(self) -> None:
        if self._held_at is not None:  # (after every event: most hold nothing)
            self._held_at = None
            self._memo.clear()

    def prefill_left(self, req: Request, now: float) -> float:
        if now != self._held_at:
            return self._prefill_left(req, now)
        left = self._memo.get(req.request_id)
        if left is None:
            left = self._memo[req.request_id] = self._prefill_left(req, now)
        return left

    def _prefill_left(self, req: Request, now: float) -> float:
        if req.prefilled:
            return 0.0
        left = self.predictor.predict_partial(
            req.prompt_tokens, req.tokens_done, req.chunk_end, req.chunk_fraction
        )
        state = req.state
        if state is RequestState.RUNNING or state is RequestState.PREEMPTING:
            # Between progress reports the worker keeps computing.
            left = max(0.0, left - (now - req.progress_at_s))
        return left


@dataclass(frozen=True)
class Rules:
    """The policy-independent limits, from SchedulerConfig."""

    starvation_s: float
    max_preemptions: int
    max_suspended_per_worker: int

    def aged(self, req: Request, now: float) -> bool:
        return now - req.arrival_s >= self.starvation_s

    def preemptible(self, req: Request, now: float) -> bool:
        return (
            req.state in (RequestState.RUNNING, RequestState.DECODING)
            and req.preemptions < self.max_preemptions
            and not self.aged(req, now)
        )


def rank_waiting(
    requests: Iterable[Request],
    policy: SchedulingPolicy,
    estimator: Estimator,
    rules: Rules,
    now: float,
    workers: Sequence[WorkerSlot] = (),
    left: Mapping[str, float] | None = None,
) -> list[Request]:
    """Waiting requests (queued or suspended), best first: aged ones, then the policy's order,
    fair between the keys of each tier (``fairness``), corrected by its tier guard. ``left``:
    their predicted prefill time left, when the caller has it already."""
    waiting = [r for r in requests if r.waiting]
    if left is None:
        left = waiting_left(waiting, estimator, now)
    aged: list[Request] = []
    fresh: list[Request] = []
    for req in waiting:
        (aged if rules.aged(req, now) else fresh).append(req)
    aged.sort(key=lambda r: (r.arrival_s, r.seq))  # oldest starving request first
    fresh.sort(key=lambda r: policy.key(r, now, left[r.request_id]))
    late = {r.request_id for r in fresh if slack_s(r, now, left[r.request_id]) < 0}
    fresh = fair_order(fresh, late)
    if policy.guards_tiers:
        fresh = guard_tiers(aged, fresh, left, policy, estimator, now, workers)
    return aged + fresh


def guard_tiers(
    aged: Sequence[Request],
    ranked: Sequence[Request],
    left: Mapping[str, float],
    policy: SchedulingPolicy,
    estimator: Estimator,
    now: float,
    workers: Sequence[WorkerSlot],
) -> list[Request]:
    """``ranked`` with the policy's tier guard applied: a request that can still make its
    deadline moves before the lower-tier requests ranked ahead of it, except those that
    ``holds_off`` (they would miss their own deadline behind it), unless it would miss its own
    behind those (``guarded``). The rest keeps its order.

    The wait in front of a request is the predicted work ranked ahead of it, spread over the
    workers: the start time ``choose_preemptions`` sees, so that a request that preempted by
    the guard also ranks first when its worker frees (no preempt/resume loop).
    """
    lanes = max(1, len(workers))
    margin, switch_s = estimator.errors.margin(), estimator.switch.p95()
    aged_cost = sum(left[r.request_id] for r in aged)

    def moved_forward(prefix: list[Request], req: Request) -> list[Request] | None:
        mine = left[req.request_id]
        if req.prefilled or not policy.on_time(req, now, mine, switch_s):
            return None  # late work keeps the place ``key`` gives it
        keep = [r for r in prefix if r.tier.rank <= req.tier.rank]
        lower = [r for r in prefix if r.tier.rank > req.tier.rank]
        urgent = [
            r for r in lower if policy.holds_off(r, now, left[r.request_id], mine, margin, switch_s)
        ]
        ahead = aged_cost + sum(left[r.request_id] for r in (*keep, *urgent))
        if policy.guarded(req, now, ahead / lanes, mine, margin, switch_s):
            return [*keep, req, *lower]
        rest = [r for r in lower if r not in urgent]
        return [*keep, *urgent, req, *rest] if rest else None

    order = list(ranked)
    # The lowest tier (largest rank) ahead of position i: moving a request forward permutes
    # the prefix, never changes which requests it holds, so a running maximum answers "is a
    # lower tier ahead of it?" without walking the prefix (which made this quadratic).
    lowest_ahead = -1
    for i, req in enumerate(order):
        if lowest_ahead > req.tier.rank:
            prefix = moved_forward(order[:i], req)
            if prefix is not None:
                order[: i + 1] = prefix
        lowest_ahead = max(lowest_ahead, req.tier.rank)
    return order


def place_on_free_workers(
    ranked: Sequence[Request], workers: Sequence[WorkerSlot], requests: Mapping[str, Request]
) -> list[tuple[Request, WorkerSlot]]:
    """(request, worker) pairs to start now. Workers are in join order.

    Each free worker gets the best candidate that can use it: a queued request (any worker) or
    a suspended one (only the worker holding its state). A worker freed by a preemption is not
    kept for the request it was preempted for: if something better arrived meanwhile, that
    goes first, and the ranking is the same one that justified the preemption. A worker whose
    KV slots are all held while it stops a decode waits for that ack: the slot it frees is
    what the best waiting request needs, and a suspended prefill resumed meanwhile would take
    the prefill from it.
    """
    left = [
        w
        for w in workers
        if w.free and (w.has_kv_slot or w.draining or not stopping_decode(w, requests))
    ]
    usable = [w for w in left if w.has_kv_slot]  # for a queued request
    placed: list[tuple[Request, WorkerSlot]] = []
    for req in ranked:
        if not left:
            break
        if req.state is RequestState.SUSPENDED:
            worker = next((w for w in left if w.worker_id == req.worker_id), None)
            if worker is None:
                continue  # its worker is busy: it waits for that one
        else:
            if not usable:
                continue
            # Keep workers that hold suspended states free for their own requests if possible.
            worker = min(usable, key=lambda w: (len(w.suspended), w.seq))
        placed.append((req, worker))
        left.remove(worker)
        if worker in usable:
            usable.remove(worker)
    return placed


@dataclass(frozen=True)
class Preemption:
    """A running prefill to stop for a waiting request. On a worker whose KV slots are all
    held, the beneficiary needs a slot: either the victim's state is dropped
    (``drop_state``), or, when that would throw away more work, a decoding request of a lower
    tier there is dropped instead (``evict``) and the victim's state is kept."""

    victim: Request
    beneficiary: Request
    drop_state: bool
    evict: Request | None = None


def choose_preemptions(
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
    ``prefill_left``: per worker prefilling, the predicted work left of its prefill, a pack's
    whole (``packing.work_left``): its first member's own part would make a pack look as if it
    freed the worker soon and could yield at little cost.
    """
    if not policy.preempts or not workers or not waiting:
        return []
    free_at, victims = _busy_workers(workers, requests, estimator, rules, now, prefill_left)
    lanes = _Lanes(free_at, workers)
    by_id = {w.worker_id: w for w in workers}
    covered = {w.reserved_for for w in workers if w.reserved_for}
    # A new request may not preempt on a draining worker (it takes nothing new there).
    open_victims = {wid: v for wid, v in victims.items() if not by_id[wid].draining}
    # What every (waiting, victim) pair reads, computed once.
    victim_left = {wid: prefill_left[wid] for wid in victims}
    margin, switch_s = estimator.errors.margin(), estimator.switch.p95()

    chosen: list[Preemption] = []
    for req in waiting:
        if not victims:
            break
        if req.request_id in covered:
            continue  # a worker is being preempted for it; its start is already counted
        pinned = req.worker_id if req.state is RequestState.SUSPENDED else None
        if pinned is not None:  # it can only run where its state is, draining or not
            target, allowed = pinned, ({pinned: victims[pinned]} if pinned in victims else {})
        elif lanes:
            target, allowed = lanes.next_free(), open_victims
        else:
            continue  # every worker is draining: nothing to preempt for a new request
        start = free_at[target]
        busy = estimator.prefill_left(req, now)
        picked = None
        if not rules.aged(req, now) and allowed:
            # Aged requests go first when a worker frees, but do not preempt: that keeps an
            # old batch request from evicting a premium one.
            outlook = Outlook(busy, 0.0, start - now, margin, req.due, switch_s)
            picked = _pick_victim(
                req, pinned, outlook, allowed, victim_left, by_id, policy, rules, now
            )
        if picked is None:
            lanes.busy_until(target, start + busy)  # it would take that worker when it frees
            continue
        victim, drop = picked
        wid = victim.worker_id
        assert wid is not None
        evict = None
        if drop and not policy.drop_state and pinned is None:
            evict = _cheaper_eviction(
                victim, req, by_id[wid], requests, victim_left[wid], estimator, rules, now
            )
        chosen.append(Preemption(victim, req, drop and evict is None, evict))
        del victims[wid]
        open_victims.pop(wid, None)
        lanes.busy_until(wid, now + busy)
    return chosen


class _Lanes:
    """The serving (not draining) workers by when their prefill frees, as the list scheduling
    of ``choose_preemptions`` moves them: a heap whose stale entries are skipped, so finding
    the next free worker is not a scan of every worker for every waiting request."""

    def __init__(self, free_at: dict[str, float], workers: Sequence[WorkerSlot]) -> None:
        self.free_at = free_at
        self._seq = {w.worker_id: w.seq for w in workers}
        self._serving = {w.worker_id for w in workers if not w.draining}
        self._heap = [(free_at[wid], self._seq[wid], wid) for wid in self._serving]
        heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self._serving)

    def next_free(self) -> str:
        """The serving worker that frees first (join order breaks ties)."""
        while self._heap[0][0] != self.free_at[self._heap[0][2]]:  # moved: its newer entry counts
            heapq.heappop(self._heap)
        return self._heap[0][2]

    def busy_until(self, worker_id: str, at: float) -> None:
        self.free_at[worker_id] = at
        if worker_id in self._serving:
            heapq.heappush(self._heap, (at, self._seq[worker_id], worker_id))


def _busy_workers(
    workers: Sequence[WorkerSlot],
    requests: Mapping[str, Request],
    estimator: Estimator,
    rules: Rules,
    now: float,
    prefill_left: Mapping[str, float],
) -> tuple[dict[str, float], dict[str, Request]]:
    """When each worker's prefill frees if nothing is preempted, and the running requests that
    may be preempted (by worker id; a pack by its first member). ``prefill_left``: as
    ``choose_preemptions`` takes it."""
    free_at: dict[str, float] = {}
    victims: dict[str, Request] = {}
    for worker in workers:
        active = requests.get(worker.active) if worker.active else None
        if active is None:
            free_at[worker.worker_id] = now
        elif active.state is RequestState.PREEMPTING:
            # Stopping now; then busy with the request it was preempted for.
            heir = requests.get(worker.reserved_for) if worker.reserved_for else None
            busy = estimator.prefill_left(heir, now) if heir is not None and heir.waiting else 0.0
            free_at[worker.worker_id] = now + busy
        else:
            # A worker's prefill frees when the first tokens are out (of every member of a
            # pack); decode is batched.
            free_at[worker.worker_id] = now + prefill_left[worker.worker_id]
            if rules.preemptible(active, now):
                victims[worker.worker_id] = active
    return free_at, victims


def stopping_decode(worker: WorkerSlot, requests: Mapping[str, Request]) -> bool:
    """Whether a decode on ``worker`` is being paused or dropped (its ack not yet back)."""
    return any(requests[rid].state is RequestState.PREEMPTING for rid in worker.decoding)


def evictable_decodes(
    worker: WorkerSlot, requests: Mapping[str, Request], rules: Rules, now: float
) -> list[Request]:
    """The decoding requests whose state may be dropped to free a KV slot on ``worker``; none
    while a decode there is being stopped already (its slot is on its way: taking a second
    one would evict two for one newcomer)."""
    if stopping_decode(worker, requests):
        return []
    held = (requests[rid] for rid in worker.decoding)
    return [r for r in held if r.state is RequestState.DECODING and rules.preemptible(r, now)]


def _cheaper_eviction(
    victim: Request,
    beneficiary: Request,
    worker: WorkerSlot,
    requests: Mapping[str, Request],
    victim_left_s: float,
    estimator: Estimator,
    rules: Rules,
    now: float,
) -> Request | None:
    """The decode to drop instead of the victim's prefill state, when the state would be
    dropped only because ``worker``'s KV slots are all held (not for the cap on suspended
    states): one that costs less to recompute than the prefill work the drop would throw away,
    of a tier below the beneficiary's and no higher than the victim's. A long prefill that was
    nearly done is not restarted from scratch to spare a short decode of its tier or below."""
    if worker.has_kv_slot or len(worker.suspended) >= rules.max_suspended_per_worker:
        return None
    done_s = estimator.predictor.predict(victim.prompt_tokens) - victim_left_s
    candidates = [
        (estimator.predictor.predict(r.prompt_tokens), r.seq, r)
        for r in evictable_decodes(worker, requests, rules, now)
        if r.tier.rank > beneficiary.tier.rank and r.tier.rank >= victim.tier.rank
    ]
    cheapest = min(candidates, default=None, key=lambda c: (c[0], c[1]))
    if cheapest is None or cheapest[0] >= done_s:
        return None
    return cheapest[2]


def _pick_victim(
    req: Request,
    pinned: str | None,
    outlook: Outlook,
    victims: Mapping[str, Request],
    victim_left: Mapping[str, float],
    workers: Mapping[str, WorkerSlot],
    policy: SchedulingPolicy,
    rules: Rules,
    now: float,
) -> tuple[Request, bool] | None:
    """The running request to preempt for ``req``, and whether its state must be dropped.
    ``outlook``: the waiting side of the policy's outlook (each victim fills in its own)."""
    eligible: list[tuple[tuple[bool, SortKey], Request, bool]] = []
    for worker_id, running in victims.items():
        if running.tier.rank < req.tier.rank and not running.prefilled:
            continue  # no policy lets a lower tier stop a higher tier's prefill
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
            worker = workers[worker_id]
            held = len(worker.suspended) - (1 if pinned == worker_id else 0)
            drop = held >= rules.max_suspended_per_worker
            # A new request needs a KV slot: on a full worker, keeping the victim's state would
            # leave the beneficiary without one, and the freed prefill would go straight back
            # to the victim (a preempt/resume loop).
            drop = drop or (not worker.has_kv_slot and pinned is None)
        running_left = victim_left[worker_id]
        # Built directly: dataclasses.replace costs five times as much, in the hottest loop.
        pair = Outlook(
            outlook.waiting_remaining_s,
            running_left,
            outlook.wait_s,
            outlook.margin,
            outlook.due,
            outlook.switch_s,
        )
        if policy.should_preempt(req, running, now, pair):
            key = policy.victim_key(running, now, running_left, outlook.waiting_remaining_s)
            eligible.append(((drop and not policy.drop_state, key), running, drop))
    if not eligible:
        return None
    _, victim, drop = min(eligible, key=lambda kv: kv[0])
    return victim, drop


def waiting_left(waiting: Iterable[Request], estimator: Estimator, now: float) -> dict[str, float]:
    """Request id -> predicted prefill time left. For a waiting request this does not move
    with ``now``, so one decision computes it once for the ranking and the wake-ups."""
    return {r.request_id: estimator.prefill_left(r, now) for r in waiting}


def wakeups(
    waiting: Iterable[Request],
    policy: SchedulingPolicy,
    estimator: Estimator,
    now: float,
    left: Mapping[str, float],
) -> dict[str, float]:
    """Request id -> when it must be reconsidered at the latest, for requests that wait on a
    prediction (the policy's ``latest_start_s``). A request whose wake-up fired has none."""
    if not policy.preempts:
        return {}
    margin, switch_s = estimator.errors.margin(), estimator.switch.p95()
    times: dict[str, float] = {}
    for req in waiting:
        if req.due:
            continue
        at = policy.latest_start_s(req, now, left[req.request_id], margin, switch_s)
        if at is not None:
            times[req.request_id] = at
    return times
