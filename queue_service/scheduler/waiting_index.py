"""The waiting requests, kept sorted so that a decision reads the head of each queue only.

A decision used to rank every waiting request on every event: at 256 live requests that took
about a millisecond, and it grew faster than the queue (``tierflow bench --scale``). Yet what a
decision does is decided at the head of the queues: free workers take the best few requests;
preemption is for the few that would miss a deadline soonest; the rest wait on a wake-up. So
the scheduler keeps its waiting requests here, in sorted sets (``sortedcontainers``) updated
by the events that change them, and plans over a **window**: per tier, the first ``k`` of

* its on-time requests in the policy's order (for flowprefill: by deadline),
* its late requests in the policy's order (late: predicted to miss the deadline already),
* its on-time requests by fair start tag (``fairness``: a quiet key's request may rank first
  in its tier while its deadline comes late),
* its on-time requests by the time they become late (the next to need a preemption),

with the oldest aged requests (``starvation_s``), every request whose wake-up fired or that is
past its first token, and what the caller adds (the suspended states of free workers). Where
the window holds every waiting request the decision is exactly the full planner's; the
differences elsewhere are listed in docs/design.md ("The scheduler at fleet scale").

Every waiting request's predicted prefill time is kept as the three features of the
predictor's model (``PrefillTimePredictor.predict_partial`` is linear in its coefficients), so
that the committed work of a tier or a key is a sum kept up to date, right under any refit.
Waiting short fresh prompts of one key and tier are prefilled in packs (``packing``), and a
pack pays the model's fixed cost ``c`` once, not once a member: a key's sum counts ``c`` once
for each pack its packable requests fill (by count and by tokens), which is what a burst of
short prompts costs. Measured on the flood (docs/results.md): three 55 ms prompts of one key
prefilled as one pack in 105 ms, and the sum of singles had admission refuse the third.
The policy's order (``SchedulingPolicy.order_key``) and lateness use the estimate made when
the request was indexed; a refit that moves the estimates by more than ``REINDEX_DRIFT``
re-indexes every request.

The index is told which requests changed (``touch``) and brought up to date with ``sync``:
one mechanism, so no transition needs its own bookkeeping here.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice

from sortedcontainers import SortedList

from queue_service.scheduler.packing import PackLimits, packable
from queue_service.scheduler.policies import SchedulingPolicy, SortKey
from queue_service.scheduler.predictor import PrefillTimePredictor
from queue_service.scheduler.request import Request

NO_PACKS = PackLimits(max_size=1, max_tokens=0)

# Re-index every request when a refit moves the predicted prefill of a reference prompt by
# more than this share: order and lateness are then out of date by more than the predictor's
# own typical error.
REINDEX_DRIFT = 0.02
_REFERENCE_PROMPT = 2048


def left_features(req: Request) -> tuple[float, float, float]:
    """(x, y, z) with the predicted prefill left ``a*x + b*y + c*z`` for the predictor's
    coefficients (a, b, c), as ``PrefillTimePredictor.predict_partial`` computes it for a
    waiting request (nothing runs: no time since its last report counts)."""
    if req.prefilled:
        return (0.0, 0.0, 0.0)
    return PrefillTimePredictor.partial_features(
        req.prompt_tokens, req.tokens_done, req.chunk_end, req.chunk_fraction
    )


@dataclass
class _Entry:
    req: Request
    features: tuple[float, float, float]
    order: tuple[SortKey, int]  # (policy order key, seq)
    late_at: float  # deadline - predicted prefill: past it the request is late
    late: bool
    special: bool  # always in the window: its wake-up fired, or it is past its first token
    packable: bool  # a fresh short prompt, which a pack may take (``packing.packable``)


class _Totals:
    """Sums of the features of one key's requests of a tier, how many, and how many of them
    (and of how many tokens) a pack may take."""

    __slots__ = ("count", "packable", "packable_tokens", "x", "y", "z")

    def __init__(self) -> None:
        self.count, self.x, self.y, self.z = 0, 0.0, 0.0, 0.0
        self.packable, self.packable_tokens = 0, 0

    def add(self, features: tuple[float, float, float], sign: int, pack_tokens: int) -> None:
        """``pack_tokens``: the request's prompt tokens if a pack may take it, else 0."""
        self.count += sign
        if pack_tokens:
            self.packable += sign
            self.packable_tokens += sign * pack_tokens
        if self.count == 0:  # exactly zero when empty: no rounding residue stays behind
            self.x = self.y = self.z = 0.0
            return
        self.x += sign * features[0]
        self.y += sign * features[1]
        self.z += sign * features[2]

    def seconds(self, coefficients: tuple[float, float, float], limits: PackLimits) -> float:
        """Predicted prefill seconds, the fixed cost paid once a pack by packable requests."""
        a, b, c = coefficients
        fixed = self.z - self.packable + _packs(self.packable, self.packable_tokens, limits)
        return a * self.x + b * self.y + c * fixed


def _packs(count: int, tokens: int, limits: PackLimits) -> int:
    """How many packs ``count`` packable prompts of ``tokens`` in all fill (each alone when
    packing is off)."""
    if count == 0 or limits.max_size < 2:
        return count
    return max(math.ceil(count / limits.max_size), math.ceil(tokens / limits.max_tokens))


class _TierQueues:
    """One tier's sorted sets: entries by order (on time, late), by tag and by lateness."""

    def __init__(self) -> None:
        self.on_time: SortedList = SortedList()  # (order, seq)
        self.late: SortedList = SortedList()  # (order, seq)
        self.by_tag: SortedList = SortedList()  # (fair tag, seq), on time only
        self.by_late_at: SortedList = SortedList()  # (late_at, seq), on time only

    def add_heads(self, seqs: set[int], k: int, served: Collection[int]) -> None:
        """Add to ``seqs`` the first ``k`` of each set that are not ``served``, and the served
        ones before them."""
        for items in (self.on_time, self.late, self.by_tag, self.by_late_at):
            if not items:
                continue
            if not served:
                seqs.update(item[-1] for item in islice(items, k))
                continue
            left = k
            for item in items:
                seqs.add(item[-1])
                if item[-1] not in served:
                    left -= 1
                    if not left:
                        break


class WaitingIndex:
    """The scheduler's waiting requests that need a prefill (queued or suspended), sorted."""

    def __init__(
        self,
        policy: SchedulingPolicy,
        predictor: PrefillTimePredictor,
        starvation_s: float,
        pack_limits: PackLimits = NO_PACKS,
    ) -> None:
        self._policy = policy
        self._predictor = predictor
        self._starvation_s = starvation_s
        self._pack_limits = pack_limits
        self._entries: dict[int, _Entry] = {}  # by seq
        self._seq_of: dict[str, int] = {}
        self._tiers: dict[str, _TierQueues] = defaultdict(_TierQueues)
        self._by_arrival: SortedList = SortedList()  # (arrival, seq): aged ones come first
        self._special: set[int] = set()
        self._totals: dict[str, dict[str, _Totals]] = defaultdict(dict)  # tier -> key -> sums
        self._touched: dict[str, Request] = {}
        self._indexed_at = predictor.predict(_REFERENCE_PROMPT)
        self._coefficients = predictor.coefficients  # a refit makes a new tuple
        self._late_checked_at = -math.inf
        self._added_since_check = False

    # ------------------------------------------------------------------ updates

    def touch(self, req: Request) -> None:
        """``req``'s state, estimate or wake-up may have changed: re-index it at ``sync``."""
        self._touched[req.request_id] = req

    def sync(self, now: float, waits: Callable[[Request], bool]) -> list[Request]:
        """Apply the touches (``waits``: whether a request belongs here now), re-index on a
        refit that moved the estimates, and move the requests that became late. Returns the
        requests touched."""
        touched = list(self._touched.values())
        self._touched.clear()
        for req in touched:
            self._remove(req.request_id)
            if waits(req):
                self._add(req)
        self._reindex_on_drift()
        self._mark_late(now)
        return touched

    def _add(self, req: Request) -> None:
        seq = req.seq
        features = left_features(req)
        left = self._seconds(features)
        special = req.due or req.prefilled
        late_at = req.deadline_s - left
        order = (self._policy.order_key(req, left), seq)
        entry = _Entry(
            req, features, order, late_at, False, special, packable(req, self._pack_limits)
        )
        self._entries[seq] = entry
        self._seq_of[req.request_id] = seq
        self._added_since_check = True
        self._by_arrival.add((req.arrival_s, seq))
        self._count_in(entry, +1)
        if special:
            self._special.add(seq)
            return
        queues = self._tiers[req.tier.name]
        queues.on_time.add(entry.order)
        queues.by_tag.add((req.fair_tag, seq))
        queues.by_late_at.add((late_at, seq))

    def _remove(self, request_id: str) -> None:
        seq = self._seq_of.pop(request_id, None)
        if seq is None:
            return
        entry = self._entries.pop(seq)
        req = entry.req
        self._by_arrival.remove((req.arrival_s, seq))
        self._count_in(entry, -1)
        if entry.special:
            self._special.discard(seq)
            return
        queues = self._tiers[req.tier.name]
        if entry.late:
            queues.late.remove(entry.order)
            return
        queues.on_time.remove(entry.order)
        queues.by_tag.remove((req.fair_tag, seq))
        queues.by_late_at.remove((entry.late_at, seq))

    def _count_in(self, entry: _Entry, sign: int) -> None:
        req = entry.req
        keys = self._totals[req.tier.name]
        totals = keys.get(req.key_id)
        if totals is None:
            totals = keys[req.key_id] = _Totals()
        totals.add(entry.features, sign, req.prompt_tokens if entry.packable else 0)
        if not totals.count:
            del keys[req.key_id]  # a key with nothing waiting costs nothing to read

    def _mark_late(self, now: float) -> None:
        if now == self._late_checked_at and not self._added_since_check:
            return  # nothing became late since the last look
        self._late_checked_at, self._added_since_check = now, False
        for queues in self._tiers.values():
            while queues.by_late_at and queues.by_late_at[0][0] < now:
                _, seq = queues.by_late_at.pop(0)
                entry = self._entries[seq]
                entry.late = True
                queues.on_time.remove(entry.order)
                queues.by_tag.remove((entry.req.fair_tag, seq))
                queues.late.add(entry.order)

    def _reindex_on_drift(self) -> None:
        if self._predictor.coefficients is self._coefficients:
            return
        self._coefficients = self._predictor.coefficients
        predicted = self._predictor.predict(_REFERENCE_PROMPT)
        if abs(predicted - self._indexed_at) <= REINDEX_DRIFT * self._indexed_at:
            return
        self._indexed_at = predicted
        requests = [entry.req for entry in self._entries.values()]
        for req in requests:
            self._remove(req.request_id)
            self._add(req)

    def _seconds(self, features: tuple[float, float, float]) -> float:
        a, b, c = self._predictor.coefficients
        return a * features[0] + b * features[1] + c * features[2]

    # ------------------------------------------------------------------ reads

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._seq_of

    def requests(self) -> Iterator[Request]:
        return (entry.req for entry in self._entries.values())

    def window(
        self,
        now: float,
        k: int | None,
        extra: Iterable[Request] = (),
        served: Collection[str] = (),
    ) -> list[Request]:
        """The requests a decision plans over (module docstring); every one when ``k`` is
        None. ``extra``: waiting requests to include as well. ``served``: requests a worker is
        being preempted for; they do not count in the ``k`` of an order (they need nothing
        more, so the next one in line is planned for)."""
        if k is None or not self._entries:
            return [entry.req for entry in self._entries.values()]
        seqs = set(self._special)
        skip = {self._seq_of[rid] for rid in served if rid in self._seq_of}
        for queues in self._tiers.values():
            queues.add_heads(seqs, k, skip)
        for arrival_s, seq in islice(self._by_arrival, k):
            if now - arrival_s < self._starvation_s:
                break  # the rest arrived later: none of them is aged
            seqs.add(seq)
        seqs.update(req.seq for req in extra if req.request_id in self._seq_of)
        return [self._entries[seq].req for seq in sorted(seqs)]

    def committed_s(self, tier: str) -> dict[str, float]:
        """Key -> predicted prefill seconds of its waiting requests of ``tier`` (keys with
        none waiting left out)."""
        coefficients, limits = self._predictor.coefficients, self._pack_limits
        return {
            key: t.seconds(coefficients, limits) for key, t in self._totals.get(tier, {}).items()
        }

    def count(self, tier: str | None = None) -> int:
        if tier is None:
            return len(self._entries)
        return sum(t.count for t in self._totals.get(tier, {}).values())

    def backlog_s(self) -> float:
        """Predicted prefill seconds of every waiting request."""
        coefficients, limits = self._predictor.coefficients, self._pack_limits
        return sum(
            t.seconds(coefficients, limits) for keys in self._totals.values() for t in keys.values()
        )

    def by_tag(self, tier: str) -> Iterator[Request]:
        """The tier's waiting requests indexed as on time, smallest fair start tag first."""
        queues = self._tiers.get(tier)
        if queues is not None:
            yield from (self._entries[seq].req for _, seq in queues.by_tag)

    def special(self) -> Iterator[Request]:
        """The requests always in the window: their wake-up fired, or past their first token."""
        return (self._entries[seq].req for seq in self._special)
