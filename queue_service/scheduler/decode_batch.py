"""Tier-aware decode on batched workers: which decoding requests to pause, drop or resume.

A batched worker prefills one request while the others decode in its batch; decode steps are
slotted into the prefill whenever a row would miss its TBT target, so every decoding row slows
the prefill a little. Two pressures, handled with the same limits as prefill preemption (the
policy must preempt; anti-thrash bound and aging via ``Rules.preemptible``):

- a prefill that would miss its TTFT deadline because of the decode steps slotted into it, and
  would make it without the lower tiers' rows, pauses the decode of every lower tier on its
  worker (their KV stays; the policy's ``drop_state`` decides, as for prefills); they resume
  when no such prefill is left there. Only rows the worker would step inside that prefill
  count: those whose TBT target is as tight as the prefill's own tier's (a looser row waits for
  the prefill's end on the worker anyway, so pausing it buys nothing, and a pause costs the
  engine a copy of the row's cache, 0.1 s for a long one). A pause that cannot save the deadline
  (the prefill is late even without those rows, or a row of its own tier or above sets the same
  slotting) is not made: it would cost the lower tiers their tokens and buy nothing;
- a waiting request that finds a worker's prefill free but all its KV slots held drops the
  state of one decoding request of a lower tier there (the lowest tier, then the newest), which
  recomputes later without sending any token twice.

A prefill on a batched worker is slowed by the decode steps slotted into it: about one step
(whose time the worker reports, ``DecodeStepDone``) per TBT target of its tightest decoding row
among those as tight as its own tier's.
Whether it is at risk is judged with that slowdown, counting the paused rows as well (they come
back), so that pausing them does not by itself flip the verdict and resume them at once.

Pure functions over the scheduler's records; the scheduler turns their answers into commands.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from queue_service.scheduler.planner import Estimator, Rules, evictable_decodes
from queue_service.scheduler.policies import SchedulingPolicy
from queue_service.scheduler.request import Request, RequestState, WorkerSlot


# A step's time is learnt fast when it grows (a larger batch), slowly when it shrinks.
def learn_step(estimate: float, seconds: float) -> float:
    return seconds if seconds > estimate else estimate + 0.2 * (seconds - estimate)


# At most this share of a prefill's time goes to slotted decode steps in the estimate.
MAX_SLOTTED_SHARE = 0.9


def slotting_slowdown(
    worker: WorkerSlot,
    requests: Mapping[str, Request],
    within_s: float = math.inf,
    up_to_rank: int | None = None,
) -> float:
    """How many times longer a prefill takes on ``worker`` with its decode rows (decoding or
    paused) slotted into it: one step every TBT target of the tightest of them. Only rows whose
    target is within ``within_s`` count (the worker steps no other row inside a prefill whose
    own target that is: ``worker.decode_slotting``); with ``up_to_rank``, only rows of that
    tier rank or more important."""
    rows = (requests[r] for r in (*worker.decoding, *worker.suspended) if r in requests)
    targets = [
        r.tier.tbt_slo_s
        for r in rows
        if r.prefilled
        and r.tier.tbt_slo_s
        and r.tier.tbt_slo_s <= within_s
        and (up_to_rank is None or r.tier.rank <= up_to_rank)
    ]
    if not targets or worker.decode_step_s <= 0:
        return 1.0
    share = min(MAX_SLOTTED_SHARE, worker.decode_step_s / min(targets))
    return 1.0 / (1.0 - share)


def at_risk(prefill: Request, estimator: Estimator, now: float, slowdown: float = 1.0) -> bool:
    """Its predicted first token (with the prediction-error margin and the decode steps slotted
    into it) is past its deadline."""
    left = estimator.prefill_left(prefill, now) * (1.0 + estimator.errors.margin()) * slowdown
    return now + left > prefill.deadline_s


NO_RANK = 1 << 30  # no tier's decode yields


@dataclass(frozen=True)
class TierBounds:
    """What decode pressure needs of the tier table: the smallest TBT target of any tier (0:
    unknown), and the rank of the lowest tier (NO_RANK: unknown). A prefill of the lowest tier
    has no lower tier's rows to pause: on a busy fleet most workers prefill the batch tier's
    long prompts, and every decision skips them without predicting anything."""

    tightest_tbt_s: float = 0.0
    lowest_rank: int = NO_RANK


def _risky_rank(
    worker: WorkerSlot,
    requests: Mapping[str, Request],
    estimator,
    now,
    bounds: TierBounds,
) -> int:
    """The tier rank of the worker's prefill if pausing the lower tiers' decode saves its
    deadline (at risk with every row slotted in, on time with its own tier's and above's);
    decode of a lower tier yields to it."""
    active = requests.get(worker.active) if worker.active else None
    if active is None or active.state is not RequestState.RUNNING:
        return NO_RANK
    if active.tier.rank >= bounds.lowest_rank:
        return NO_RANK  # no tier below it
    # The most its rows can slow it down (one step every tightest target): a prefill safe
    # even so needs no row to yield, and its rows need not be read (the common case, on every
    # decision for every worker).
    share = MAX_SLOTTED_SHARE
    if bounds.tightest_tbt_s > 0:
        share = min(share, worker.decode_step_s / bounds.tightest_tbt_s)
    most = 1.0 / (1.0 - share) if worker.decode_step_s > 0 else 1.0
    if not at_risk(active, estimator, now, most):
        return NO_RANK
    rank, within = active.tier.rank, active.tier.tbt_slo_s or math.inf
    if not at_risk(active, estimator, now, slotting_slowdown(worker, requests, within)):
        return NO_RANK
    kept = slotting_slowdown(worker, requests, within, up_to_rank=rank)
    return NO_RANK if at_risk(active, estimator, now, kept) else rank


def decode_pauses(
    workers: Sequence[WorkerSlot],
    requests: Mapping[str, Request],
    policy: SchedulingPolicy,
    estimator: Estimator,
    rules: Rules,
    now: float,
    bounds: TierBounds = TierBounds(),
) -> list[Request]:
    """Decoding requests to pause because a higher tier's prefill on their worker is at risk."""
    if not policy.preempts:
        return []
    pauses = []
    for worker in workers:
        if not worker.decoding:
            continue
        rank = _risky_rank(worker, requests, estimator, now, bounds)
        if rank == NO_RANK:
            continue  # nothing at risk there: no row yields (the common case)
        for rid in worker.decoding:
            req = requests[rid]
            preemptible = req.state is RequestState.DECODING and rules.preemptible(req, now)
            if preemptible and req.tier.rank > rank:
                pauses.append(req)
    return pauses


def decode_resumes(
    workers: Sequence[WorkerSlot],
    requests: Mapping[str, Request],
    estimator: Estimator,
    now: float,
    bounds: TierBounds = TierBounds(),
) -> list[tuple[Request, WorkerSlot]]:
    """Paused decodes whose worker no longer runs a higher tier's prefill at risk."""
    resumes = []
    for worker in workers:
        if not worker.suspended:
            continue
        rank = _risky_rank(worker, requests, estimator, now, bounds)
        for rid in worker.suspended:
            req = requests[rid]
            if req.prefilled and req.tier.rank <= rank:
                resumes.append((req, worker))
    return resumes


def slot_evictions(
    waiting: Iterable[Request],
    workers: Sequence[WorkerSlot],
    requests: Mapping[str, Request],
    policy: SchedulingPolicy,
    rules: Rules,
    now: float,
) -> list[Request]:
    """For the best waiting new request that a worker could prefill now but for its full KV
    slots: one decoding request of a lower tier there, whose state is dropped."""
    if not policy.preempts:
        return []
    req = next((r for r in waiting if r.state is RequestState.QUEUED), None)
    if req is None:
        return []
    # A draining worker takes no new request: freeing a slot there would serve nobody.
    blocked = [w for w in workers if w.free and not w.has_kv_slot and not w.draining]
    if not blocked:
        return []
    candidates = [
        r
        for worker in blocked
        for r in evictable_decodes(worker, requests, rules, now)
        if r.tier.rank > req.tier.rank
    ]
    if not candidates:
        return []
    return [max(candidates, key=lambda r: (r.tier.rank, r.seq))]
