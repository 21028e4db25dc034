"""Weighted fair order between the API keys of one tier.

Inside a tier, the policy's order (deadline first for flowprefill) would serve a key that
floods the tier before a key that sends one request now and then: the flood's requests arrived
first, so their deadlines come first. Fair order instead gives each key of a tier a share of
the tier's turn in proportion to its weight (``weight`` in ``config/keys.toml``, carried by
every request), by start-time fair queueing over predicted prefill seconds. At its arrival a
request of key k gets

    start tag  S = max(V - B / weight_k, F_k)     finish tag  F_k = S + predicted prefill / weight_k

where ``F_k`` is the finish tag of the key's previous request and ``V``, the tier's virtual
time, is the smallest start tag of the tier's requests still to prefill, running or waiting,
that can still make their deadlines (a late one is no longer dealt a place, below): as
in start-time fair queueing, the start tag of the request in service (the highest finish tag
issued, when none is left), kept from going back. A key that floods runs its tags far ahead of
``V``.

A key that sends within its share of the tier gets a burst credit ``B``: its next ``B`` seconds
of work start before ``V``, before the waiting requests of every key over its share. Within its
share means that the prefill seconds it asked of the tier, admitted or not, decayed over the
last 10 s, are at most its weight's share of the tier's workers over that time plus a burst of
``B`` (a token bucket's depth; ``SentRates``, at admission, which stamps the standing on each
request it admits: ``key_over_share``). A request's seconds are reckoned as the tier's
predictor was first calibrated, not as it follows the machine under load: the load that other
keys put on the machine does not count against this key. ``B`` is the tier's whole capacity as
admission reckons it (``capacity.tier_capacity_s``, with the key's own error), not the key's
share of it: a key sending a quarter of the tier's capacity at random (Poisson) holds more than
half of the tier's in-flight capacity for a quarter of its requests, and dealt one for one with
a flood past that half, those requests missed. What it asks bounds what such a key takes over
time, and admission what it holds at once. A key over its share gets no credit (plain
start-time fair queueing). Standing is judged on what a key asks, not on its tags: admission
throttles a flood, so between its admitted requests its tags fell behind ``V``, and a credit
given to every key whose tags had fallen behind went to the flood too, whose newcomers then
went before a calm key's burst (docs/results.md, "One key floods the critical tier": a calm
request waited 450 ms while seven later requests went first).

The tier's requests then take the tier's places in the policy's ranking in start-tag order:

* a key's own requests keep the policy's order among themselves (deadlines within one key: the
  key's tags are dealt to its requests in that order);
* the places the tier holds among the other tiers do not move, so tier guards and preemption
  rules see the same tier pattern;
* with one key in a tier (every request of the demo, of the benchmarks without keys) the order
  is exactly the policy's.

What a key may hold of a tier is bounded at admission (``capacity.judge``), which keeps each
active key's share free for it; ``KeyBook`` also says which keys are active.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

from queue_service.scheduler.request import Request
from tierflow.recent import RecentMap


@dataclass(frozen=True)
class KeyEntry:
    weight: float
    last_arrival_s: float
    finish_tag: float
    over_share: bool = False  # the standing its latest request carried (``SentRates``)


class KeyBook:
    """Per (tier, key): its weight, its last arrival, its finish tag and its standing; at most
    ``capacity`` keys remembered (the least recently seen forgotten first)."""

    def __init__(self, capacity: int) -> None:
        self._keys: RecentMap[tuple[str, str], KeyEntry] = RecentMap(capacity)
        self._top_tag: dict[str, float] = defaultdict(float)  # tier -> highest finish tag
        self._virtual: dict[str, float] = {}  # tier -> V, never decreasing

    def arrive(
        self,
        req: Request,
        predicted_s: float,
        waiting: Iterable[Request],
        credit_s: Callable[[], float] = lambda: 0.0,
    ) -> float:
        """Record ``req``'s arrival and return its start tag. ``waiting``: the tier's other
        requests still to prefill, running or waiting, that can still make their deadlines
        (their tags give the virtual time: a late request's old tag would hold it back);
        ``credit_s``: the key's burst credit (``B``, 0 for a key over its share), asked only
        of a key whose last finish tag is behind the virtual time (a busy key's never matters)."""
        tier = req.tier.name
        virtual = self._virtual[tier] = self.virtual(tier, waiting)
        before = self._keys.get((tier, req.key_id))
        start = before.finish_tag if before else -math.inf
        if start < virtual:
            start = max(start, virtual - credit_s() / req.key_weight)
        finish = start + predicted_s / req.key_weight
        entry = KeyEntry(req.key_weight, req.arrival_s, finish, req.key_over_share)
        self._keys[(tier, req.key_id)] = entry
        self._top_tag[tier] = max(self._top_tag[tier], finish)
        return start

    def virtual(self, tier: str, waiting: Iterable[Request]) -> float:
        """The tier's virtual time ``V`` (``waiting`` as for ``arrive``); nothing recorded."""
        now_virtual = min((r.fair_tag for r in waiting), default=self._top_tag[tier])
        return max(self._virtual.get(tier, now_virtual), now_virtual)

    def lead_s(
        self, tier: str, key_id: str, committed_s: float, virtual: float, credit_s: float
    ) -> float | None:
        """How much of the key's ``committed_s`` fair order places before the virtual time
        (``capacity.KeyLoad.lead_s``; None for a key not remembered): its work ends at its
        last finish tag, or, for a key whose tags fell behind, where its credit (``credit_s``)
        would start its next request (then it may exceed ``committed_s``). Admission places a
        newcomer after its own key's work from there, not as if the key's credit were unspent,
        and lays out a key over its share where its tags lie, before V where they were dealt
        with its credit (``capacity._ahead_s``)."""
        entry = self._keys.get((tier, key_id))
        if entry is None:
            return None
        return committed_s - max(entry.weight * (entry.finish_tag - virtual), -credit_s)

    def over_share(self, tier: str, key_id: str) -> bool:
        """The key's standing as its latest request of the tier carried it."""
        entry = self._keys.get((tier, key_id))
        return entry is not None and entry.over_share

    def active(self, tier: str, since_s: float) -> Iterator[tuple[str, float]]:
        """(key, weight) of the tier's keys that sent a request at ``since_s`` or later.

        Newest first, up to the first key (of any tier) last seen before ``since_s``: keys are
        recorded in the order their requests reach the scheduler, so this reads the keys
        active lately, not every key remembered (up to ``remember_keys``, on every arrival of
        a tier that admission judges). A request that reaches the scheduler with an arrival
        time older than the keys recorded before it (held in Kafka) may end the walk early by
        that much: seconds, against a ``since_s`` a minute back."""
        for (key_tier, key_id), entry in self._keys.newest_first():
            if entry.last_arrival_s < since_s:
                return
            if key_tier == tier:
                yield key_id, entry.weight


class SentRates:
    """What each key asked of each tier lately, at admission: the prefill seconds of every
    request it sent, admitted or not (``capacity.reference_prefill_s``), a second, as an
    exponentially decayed average over ``window_s``; and whether that is over the key's share
    of the tier's workers.

    Measured where requests arrive, not where they are scheduled: the owner of a tier sees only
    what admission let in, and a flood that admission held to about half a worker looked within
    a share of half a worker there, now and then (docs/results.md). With several admitting
    instances each sees its part of every key's requests and compares it with the same part of
    the workers (``over_share``'s ``workers``)."""

    # Long enough that a calm key's random bursts stay inside its share: over 2 s, a key
    # sending half its share at random (Poisson) went over it at its largest bursts, and lost
    # its credit just when it needed it (docs/results.md). A flood at 3x the tier's capacity
    # passes its share of one half within 2 s even so.
    def __init__(
        self, window_s: float = 10.0, capacity: int = 10_000, min_age_s: float = 1.0
    ) -> None:
        if not window_s > 0 or not min_age_s > 0:
            raise ValueError("window_s and min_age_s must be > 0")
        self.window_s = window_s
        self.min_age_s = min_age_s
        # (tier, key) -> (decayed seconds, as of, first seen)
        self._sent: RecentMap[tuple[str, str], tuple[float, float, float]] = RecentMap(
            max(1, capacity)
        )

    def add(self, tier: str, key_id: str, seconds: float, now: float) -> None:
        sent_s, as_of, first = self._sent.get((tier, key_id), (0.0, now, now))
        self._sent[(tier, key_id)] = (self._decay(sent_s, as_of, now) + seconds, now, first)

    def knows(self, tier: str, key_id: str) -> bool:
        """Whether the key asked anything of the tier here (and is still remembered)."""
        return (tier, key_id) in self._sent

    def rate(self, tier: str, key_id: str, now: float) -> float:
        """Predicted prefill seconds a second the key asked of the tier. Over a key's first
        seconds the average is over the time since it was first seen (at least
        ``min_age_s``), not the whole window: a flood that has just begun is not taken for
        a key within its share while its average fills."""
        return self._sent_s(tier, key_id, now) / self.rate_window_s(tier, key_id, now)

    def rate_window_s(self, tier: str, key_id: str, now: float) -> float:
        """The seconds ``rate`` averages over: the window, weighted as the sum decays, since
        the key was first seen (at least ``min_age_s`` ago)."""
        _, _, first = self._sent.get((tier, key_id), (0.0, now, now))
        age_s = max(self.min_age_s, now - first)
        return self.window_s * -math.expm1(-age_s / self.window_s)

    def _sent_s(self, tier: str, key_id: str, now: float) -> float:
        sent_s, as_of, _ = self._sent.get((tier, key_id), (0.0, now, now))
        return self._decay(sent_s, as_of, now)

    def over_share(
        self,
        tier: str,
        key_id: str,
        fraction: float,
        workers: float,
        now: float,
        burst_s: float = 0.0,
    ) -> bool:
        """Whether the key asked more than ``fraction`` (its weight over the active keys'
        weights) of ``workers`` (a worker does a prefill second a second) over the decayed
        window, plus ``burst_s`` seconds of work: a bucket that drains at the key's share and
        holds its decayed window's worth and ``burst_s`` more. A key that asked little over
        the last 10 s therefore keeps its standing through about its window's share of work
        too, not ``burst_s`` alone. With no worker known (no fresh load) nothing can be said:
        not over."""
        if workers <= 0:
            return False
        allowed_s = self.rate_window_s(tier, key_id, now) * fraction * workers + burst_s
        return self._sent_s(tier, key_id, now) > allowed_s

    def _decay(self, seconds: float, as_of: float, now: float) -> float:
        return seconds * math.exp(-max(0.0, now - as_of) / self.window_s)


class HeldPeaks:
    """The most of a tier each key asked to hold at once lately: at each of its requests,
    the key's committed work there with the request's own (``capacity.Verdict.held_s``),
    admitted or not; the peak decays by ``exp(-age / decay_s)``.

    Admission keeps free, for a key within its share, what it holds at its bursts, not only its
    share of the tier (``capacity._ahead_s``): a key sending a quarter of the tier's capacity
    at random (Poisson) holds more than its half of it at its bursts (four requests in 100 ms,
    twice its share), and with the flood filling the rest those bursts missed: 10 of the calm
    key's 13 misses in one run (docs/results.md). Measured where requests arrive, as
    ``SentRates`` is. A refused request counts: a refused burst is what the key needed. So one
    request as long as the tier's capacity, refused, keeps the whole tier (the room is capped
    at the key's credit) from keys over their share for some 30 s: the cost falls on keys
    over their share only."""

    # Long enough to span the gaps between a calm key's bursts (one every 10-20 s in the flood
    # bench); short enough that a key whose traffic changed gets its share back in a minute.
    def __init__(self, decay_s: float = 30.0, capacity: int = 10_000) -> None:
        if not decay_s > 0:
            raise ValueError("decay_s must be > 0")
        self.decay_s = decay_s
        self._peaks: RecentMap[tuple[str, str], tuple[float, float]] = RecentMap(max(1, capacity))

    def hold(self, tier: str, key_id: str, held_s: float, now: float) -> None:
        self._peaks[(tier, key_id)] = (max(held_s, self.peak(tier, key_id, now)), now)

    def peak(self, tier: str, key_id: str, now: float) -> float:
        peak_s, as_of = self._peaks.get((tier, key_id), (0.0, now))
        return peak_s * math.exp(-max(0.0, now - as_of) / self.decay_s)


def fair_order(ranked: Sequence[Request], late: Collection[str] = ()) -> list[Request]:
    """``ranked`` (the policy's order) with each tier's requests re-dealt over the tier's own
    places in start-tag order between keys. ``late``: ids of requests predicted to miss their
    deadline already; they keep the places the policy gave them (behind their tier's on-time
    work, for flowprefill) and take no part in the dealing. Dealt in, a late request's old,
    low tag went to its key's newest on-time request: a flood with one late request kept the
    head of the tier, ahead of a calm key's request that had arrived before."""
    by_tier: dict[str, list[Request]] = defaultdict(list)
    for req in ranked:
        if req.request_id not in late:
            by_tier[req.tier.name].append(req)
    dealt = {
        tier: _by_start_tag(requests)
        for tier, requests in by_tier.items()
        if len({r.key_id for r in requests}) > 1
    }
    if not dealt:
        return list(ranked)
    cursor: dict[str, int] = defaultdict(int)
    order = []
    for req in ranked:
        tier = req.tier.name
        if tier in dealt and req.request_id not in late:
            req = dealt[tier][cursor[tier]]
            cursor[tier] += 1
        order.append(req)
    return order


def _by_start_tag(requests: Sequence[Request]) -> list[Request]:
    """One tier's requests by start tag, each key's tags dealt to its requests in their order
    in ``requests``; ties by place in ``requests``."""
    tags: dict[str, list[float]] = defaultdict(list)
    for req in requests:
        tags[req.key_id].append(req.fair_tag)
    for key_tags in tags.values():
        key_tags.sort(reverse=True)  # popped smallest first
    tagged = [(tags[req.key_id].pop(), place, req) for place, req in enumerate(requests)]
    tagged.sort(key=lambda t: (t[0], t[1]))
    return [req for _, _, req in tagged]
