"""The capacity view that admission reads, and the tier a request is served at.

How the view is shared between queue-service instances. The instance that owns a tier's Kafka
partitions schedules that tier's requests, so only it knows their committed work
(``Scheduler.tier_load``); admission runs on whichever instance the client reached. So every
instance that owns partitions of a tier that admission judges (``TierTable.judged``: a tier
with an ``overflow`` rule, or the one a ``downgrade`` sends to) publishes its load of that
tier, with its instance id, its wall-clock time and, per admitting instance, the latest
admission stamp it has counted, to the capacity topic (``<prefix>capacity``) every
``publish_every_s``; every instance reads that topic into its ``CapacityBoard``. A load older
than ``stale_after_s`` is gone: its owner stopped or lost the partitions.

Between its admission and its owner counting it, a request is in no load, and a burst admitted
within one publish period would all see the same committed work. So the board also keeps a
ledger of what its own instance admitted (admission stamp, key, prompt length): an entry adds to the
committed work until a load counts it (its owner's ``counted_through`` for this instance
reaches the entry's stamp) or ``ledger_ttl_s`` passes. With one partition per tier (the
default) that is exact, except that two admissions whose Kafka writes overtake each other can
leave the ledger one write early; with several owners an entry leaves once any owner counted
through its stamp.

Nothing here does I/O: the service feeds ``update`` from the capacity topic and calls
``place`` and ``admitted`` at admission, all on its event loop.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from queue_service.scheduler.capacity import (
    KeyLoad,
    Pending,
    TierLoad,
    Verdict,
    judge,
    key_loads,
    reference_prefill_s,
    tier_capacity_s,
)
from queue_service.scheduler.fairness import HeldPeaks, SentRates
from tierflow.tiers import TierPolicy, TierTable
from tierflow.v1 import queue_pb2


@dataclass(frozen=True)
class PublishedLoad:
    """A tier's load as one owner published it."""

    instance_id: str
    as_of_s: float  # the owner's wall clock when it took the load
    load: TierLoad
    counted_through_ms: Mapping[str, int]  # admitting instance -> latest admission stamp counted


def load_record(published: PublishedLoad) -> queue_pb2.TierCapacity:
    """The capacity topic's record of a load."""
    load = published.load
    return queue_pb2.TierCapacity(
        tier=load.tier,
        instance_id=published.instance_id,
        as_of_unix_ms=int(published.as_of_s * 1000),
        workers=load.workers,
        committed_s=load.committed_s,
        switch_s=load.switch_s,
        margin=load.margin,
        coefficients=load.coefficients,
        calibrated=load.calibrated,
        counted_through_unix_ms=published.counted_through_ms,
        keys=[
            queue_pb2.KeyCapacity(
                key_id=k.key_id,
                weight=k.weight,
                committed_s=k.committed_s,
                error_s=k.error_s,
                running_s=k.running_s,
                over_share=k.over_share,
                lead_s=k.lead_s,
            )
            for k in load.keys
        ],
        error_s=load.error_s,
        busy_share=load.busy_share,
        reference_coefficients=load.reference_coefficients or (),
    )


def published_load(record: queue_pb2.TierCapacity) -> PublishedLoad:
    """A load read back from the capacity topic; ValueError when it is malformed."""
    if not record.tier or not record.instance_id or len(record.coefficients) != 3:
        raise ValueError("a tier load needs a tier, an instance id and 3 coefficients")
    a, b, c = record.coefficients
    reference = None
    if record.reference_coefficients:
        if len(record.reference_coefficients) != 3:
            raise ValueError("a tier load's reference coefficients are 3 or none")
        ra, rb, rc = record.reference_coefficients
        reference = (ra, rb, rc)
    load = TierLoad(
        tier=record.tier,
        workers=record.workers,
        committed_s=record.committed_s,
        switch_s=record.switch_s,
        margin=record.margin,
        coefficients=(a, b, c),
        calibrated=record.calibrated,
        keys=tuple(
            KeyLoad(
                k.key_id,
                k.weight or 1.0,
                k.committed_s,
                k.error_s,
                k.running_s,
                k.over_share,
                k.lead_s if k.HasField("lead_s") else None,
            )
            for k in record.keys
        ),
        error_s=record.error_s,
        busy_share=record.busy_share,
        reference_coefficients=reference,
    )
    return PublishedLoad(
        record.instance_id,
        record.as_of_unix_ms / 1000,
        load,
        dict(record.counted_through_unix_ms),
    )


@dataclass(frozen=True)
class Placement:
    """Where admission puts a request: ``served_tier`` (None: rejected)."""

    requested_tier: str
    served_tier: str | None
    verdicts: tuple[Verdict, ...]  # the rules that refused it, from the requested tier down
    admitting: Verdict | None = None  # the rule that admitted it (None: no rule applied)
    # Why a tier with a rule took it without judging (``unjudged_reason``), else None.
    unjudged: str | None = None
    # Its key asked more than its share of the tier that serves it (``fairness.SentRates``).
    over_share: bool = False

    @property
    def predicted_ttft_s(self) -> float | None:
        """The TTFT the admitting rule predicted, before the error it added (what that
        error is measured against once the first token is out); None: no rule applied."""
        verdict = self.admitting
        return None if verdict is None else verdict.predicted_ttft_s - verdict.error_s

    @property
    def downgraded(self) -> bool:
        return self.served_tier is not None and self.served_tier != self.requested_tier

    @property
    def refusal(self) -> Verdict:
        """The verdict that refused it (only when rejected)."""
        return self.verdicts[-1]


def unjudged_reason(loads: list[TierLoad]) -> str:
    """Why ``judge`` could not apply a tier's rule to these loads (it then admits): no owner
    published a load in the last ``stale_after_s`` (the owner stopped, lost its partitions, or
    its writes are stuck in Kafka), none has a worker, or none has a calibrated predictor."""
    if not loads:
        return "no fresh load"
    if not any(load.workers for load in loads):
        return "no workers"
    return "uncalibrated predictor"


@dataclass
class _Admission:
    tier: str
    stamp_ms: int
    pending: Pending


class CapacityBoard:
    def __init__(
        self,
        instance_id: str,
        tiers: TierTable,
        *,
        stale_after_s: float = 3.0,
        ledger_ttl_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.instance_id = instance_id
        self.tiers = tiers
        self.stale_after_s = stale_after_s
        self.ledger_ttl_s = ledger_ttl_s
        self.clock = clock
        self._loads: dict[tuple[str, str], PublishedLoad] = {}  # (tier, owner) -> latest
        self._ledger: deque[_Admission] = deque()  # in admission order
        # What each key asked of each judged tier, admitted or not. A key's first requests
        # keep their standing through the burst allowance (``_ask``), not through a long
        # first average: averaged over at least 1 s, a flood that had just begun stayed
        # within its share for its first 5-11 requests, and got the credit with them.
        self._asked = SentRates(min_age_s=0.1)
        self._held = HeldPeaks()  # what each key asked to hold of each judged tier at once

    def update(self, published: PublishedLoad) -> None:
        """A load read from the capacity topic (a newer one of the same owner replaces it).
        A tier this table does not know (another deployment's) is ignored."""
        if published.load.tier not in self.tiers:
            return
        key = (published.load.tier, published.instance_id)
        current = self._loads.get(key)
        if current is None or published.as_of_s >= current.as_of_s:
            self._loads[key] = published

    def loads(self, tier: str) -> list[PublishedLoad]:
        """The tier's fresh loads, one per owner."""
        now = self.clock()
        return [
            p
            for (t, _), p in self._loads.items()
            if t == tier and now - p.as_of_s <= self.stale_after_s
        ]

    def pending(self, tier: str) -> list[Pending]:
        """This instance's admissions of ``tier`` that no load counts yet."""
        self._forget_old()
        counted = max(
            (p.counted_through_ms.get(self.instance_id, 0) for p in self.loads(tier)), default=0
        )
        return [a.pending for a in self._ledger if a.tier == tier and a.stamp_ms > counted]

    def admitted(
        self, tier: str, stamp_ms: int, prompt_tokens: int, key_id: str = "", weight: float = 1.0
    ) -> None:
        """This instance queued a request of ``tier`` stamped ``stamp_ms`` (its arrival)."""
        if tier in self.tiers.judged():
            self._ledger.append(_Admission(tier, stamp_ms, Pending(key_id, weight, prompt_tokens)))

    def place(
        self, tier: str, prompt_tokens: int, key_id: str = "", weight: float = 1.0
    ) -> Placement:
        """The tier a new request of ``tier`` from key ``key_id`` is served at: its own while
        the rule admits it, else the next tier down (``downgrade``) if it fits there, judged
        the same way behind the higher tiers' work, or none (``reject``, or no room below)."""
        verdicts: list[Verdict] = []
        policy = self.tiers[tier]
        if policy.overflow is None:
            return Placement(tier, tier, ())
        above: list[TierLoad] = [
            p.load for t in self.tiers if t.rank < policy.rank for p in self.loads(t.name)
        ]
        while True:
            loads = [p.load for p in self.loads(policy.name)]
            pending = self.pending(policy.name)
            standings = self._ask(policy, loads, prompt_tokens, key_id, weight)
            over = standings[key_id]
            now = self.clock()
            peaks = {k: self._held.peak(policy.name, k, now) for k in standings}
            verdict = judge(
                policy, loads, prompt_tokens, pending, key_id, weight, above, standings, peaks
            )
            if verdict is None:
                unjudged = unjudged_reason(loads)
                return Placement(tier, policy.name, tuple(verdicts), None, unjudged, over)
            self._held.hold(policy.name, key_id, verdict.held_s, now)
            if verdict.admit:
                return Placement(tier, policy.name, tuple(verdicts), verdict, None, over)
            verdicts.append(verdict)
            below = self.tiers.below(policy.name)
            if policy.overflow != "downgrade" or below is None:
                return Placement(tier, None, tuple(verdicts))
            above += loads
            policy = below

    def _ask(
        self,
        policy: TierPolicy,
        loads: list[TierLoad],
        prompt_tokens: int,
        key_id: str,
        weight: float,
    ) -> dict[str, bool]:
        """Count what the request asks of the tier (its prefill seconds as the tier's
        predictor was first calibrated, ``reference_prefill_s``); then, of its key and of every
        active key that asked here, whether it asked more than its share of the tier's workers
        lately (among the loads' active keys and the request's), beyond a burst of the key's
        burst credit (``fairness``: the tier's capacity, with the key's own error). A calm
        key's Poisson start is such a burst: its first 12 requests came in 1.3 s, and judged on
        its rate alone it lost its standing at the 11th (docs/results.md)."""
        tier, now = policy.name, self.clock()
        self._asked.add(tier, key_id, reference_prefill_s(loads, prompt_tokens), now)
        weights = {k.key_id: k.weight for load in loads for k in load.keys}
        weights[key_id] = weight
        total = sum(weights.values())
        workers = sum(load.workers for load in loads)
        switch_s = max((load.switch_s for load in loads), default=0.0)
        tier_error_s = max((load.error_s for load in loads), default=0.0)
        keys = key_loads(loads, (), lambda tokens: 0.0, tier_error_s)  # each key's own error

        def burst_s(k: str) -> float:
            error_s = keys[k].error_s if k in keys else tier_error_s
            return tier_capacity_s(workers, policy.ttft_slo_s, switch_s + error_s)

        return {
            k: self._asked.over_share(tier, k, w / total, workers, now, burst_s(k))
            for k, w in weights.items()
            if self._asked.knows(tier, k)
        }

    def _forget_old(self) -> None:
        oldest_ms = (self.clock() - self.ledger_ttl_s) * 1000
        while self._ledger and self._ledger[0].stamp_ms < oldest_ms:
            self._ledger.popleft()
