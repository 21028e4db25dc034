"""Admission of a tier against its capacity: may one more request of the tier still meet its
deadline, given the work the tier has already committed?

A tier with an ``overflow`` rule (``config/tiers.toml``) admits a new request only while it
can. The committed work is the predicted prefill time left of the tier's admitted, unfinished
requests, as each instance that schedules part of the tier sees it (``TierLoad``, from
``Scheduler.tier_load``). Admission runs on whichever instance the client reached, so loads
travel between instances (``queue_service/core/capacity_board.py`` says how) and are summed
here.

Every request of a tier has the same SLO, so a newcomer's deadline is the latest of its tier:
deadline-first, it runs after every committed request of the tier and delays none of them. On W
workers a work-conserving schedule starts it at most ``committed / W`` from now, after the wait
for a running lower-tier prefill to stop (``switch_s``). The newcomer's own prefill is
inflated by the prefill predictor's observed under-estimate (``margin``, a high quantile of
one prefill's relative error), and admission's own observed error is added (``error_s``: a high
quantile of how much later than predicted the TTFTs of the key's, or the tier's, requests
came; ``admission_error``):

    predicted TTFT = switch_s + committed_s / W + (1 + margin) * own prefill + error_s

For a key within its share of the tier (``fairness``) the committed work is not inflated by
the margin: it is a sum of several prefills whose errors partly cancel, so one prefill's p95
relative error taken over all of it overstated the wait (the TTFTs of a calm key's requests
admitted behind 80-300 ms of it came 77-127 ms sooner than so predicted, and every calm
refusal under the flood was one of those; docs/results.md). What the sum does miss comes back
measured, in ``error_s``. For a key over its share the committed work is inflated too,
``(1 + margin) * (committed_s / W + own prefill)``: what it is admitted into is the tier's
spare capacity, a refusal costs it only a lower tier, and a miss costs the promise made to
every admitted request. Calibrated, the flood's first admissions (its errors measured on a few
requests with nothing ahead) missed the SLO behind 170-220 ms of work.

A request is admitted at its tier when that is within the tier's SLO. The same rule covers a
request whose own prefill alone exceeds the SLO.

Between the keys of a tier (``fairness``) the scheduler serves in weighted fair order, so the
work ahead of a newcomer of key k is not all the tier's committed work. Fair order lays each
key's work out in virtual time from ``V``, less the key's burst credit ``B_j``: the tier's
capacity (``capacity_j`` below, with key j's own error) for a key within its share of what the
tier is asked, 0 for a key over it (``fairness.SentRates``: each key the admitting instance has
seen ask, as it measures that key now, ``standings``; the others as the owner published them,
``KeyLoad.over_share``). The owner's is the standing of the last request it was sent: a flood
whose every request admission refused kept there the standing of its first, within its share,
and the calm key was charged the flood's unused share (docs/results.md). Where each key's
committed work lies against ``V`` the owner publishes (``L_j``, ``KeyLoad.lead_s``: how much of
it fair order places before ``V``, from the key's last finish tag): a newcomer starts after its
own key's work as fair order places it, not as if its key's credit were unspent, and a key over
its share is laid out where its tags lie, before ``V`` where they were dealt with its credit.
Both only make admission stricter than laying every key out from ``V`` less its credit; what
ended the calm key's refusals at a flood's start was the standing (the flood over its share
within its first requests, ``fairness.SentRates``' burst allowance), not this (docs/results.md).
Where it is unknown (a key summed over several owners) ``L_j = B_j``, the credit unspent.
Another key within its share is laid out with at least its whole credit (``max(L_j, B_j)``): a
newcomer dealt in before part of its work delays that part, whose deadlines admission does not
check again; laid out where their tags lay, the flood's newcomers were admitted ahead of a calm
key's waiting work, and 20 of its 200 requests missed (docs/results.md). The newcomer starts
after its key's work, at most its credit before ``V``, and finishes at ``f`` past ``V``; of
every other key j, what lies before ``f`` runs first, or at least ``r_j``, what of key j is
prefilling now (a newcomer of the tier, due later, does not preempt it). A key over its share of
the rate, or holding more than its share of the tier's capacity with work of its own already
committed (``c_k + own > share_k``, ``c_k > 0``), leaves the unused room of every other key
within its share free: that key may send it any time and, with its credit, run it first. A key's
room is its share, or what it asked to hold at once lately if more (``P_j``,
``fairness.HeldPeaks``), up to its credit: a calm key's Poisson bursts hold twice its share, and
with only its share kept, a flood filled the rest and those bursts missed (docs/results.md).

    f           = (max(c_k - L_k, -B_k) + own) / w_k
    committed_s = c_k + sum_j max(r_j, min(c_j, max(0, w_j * f + max(L_j, B_j))))
                      + (sum_j max(0, room_j - c_j)  over keys j within their share,
                         if k is over its share or c_k > 0 and c_k + own > share_k)
    room_j      = min(B_j, max(share_j, P_j))
    capacity_j  = W * (SLO - switch_s - error_j)
    share_j     = capacity_j * w_j / (sum of active w)

A key's share is reckoned with its own error ``error_j`` (what admission adds for it), not
the tier's: the tier's error is the flood's when one key floods, and reckoned with it a calm
key's share shrank to about one request (docs/results.md, "One key floods the critical tier").

A key that floods the tier fills at most what the others' committed work and unused rooms
leave of it, and a key within its share has its whole burst ahead of the flood's waiting work.
With one key the formula is the one above.

What a key over its share fills is the tier's spare capacity, and the tier runs before every
lower tier: borrowed up to the workers' whole time, it starved them (a flood kept 457-496
requests at critical in two runs of five, and standard's own requests met their SLO 95 and 46
times of 133, against 133 in the same runs' other scenario; docs/results.md). So a key over
its share is admitted only while the tier's prefills take less than the tier's
``borrow_limit`` of its workers' time (``busy_share``, as the owners measure and publish it);
a key within its share is not held to it.

A request downgraded to the next tier is judged there too: it is served at the lower tier only
if it can meet that tier's SLO, else refused. So a downgrade never turns a flood of the top
tier into an unbounded backlog of the next one. The higher tiers' committed work runs first, on
the same workers; and while they keep arriving they keep taking the workers, so the lower
tier's own work drains only at the share of the workers they leave (``share_left``: 1 less
each higher tier's ``busy_share``, the share of its workers' time its prefills took lately,
measured by its owner):

    wait_s = committed_above / W + committed_s / (W * left)     own prefill / left

and the lower tier's capacity for credits and shares is reckoned on ``W * left`` workers.
Without it, under a flood that the top tier's admission kept at its capacity (its prefills
took about 60 % of the worker), requests downgraded to standard were admitted on predictions
of 0.3-0.9 s and got their first token up to 20 s later, against the tier's SLO of 3 s, and
standard's own requests waited 15 s behind them (docs/results.md). At the top tier ``left`` is
1 and the formulas above are unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tierflow.tiers import TierPolicy


@dataclass(frozen=True)
class KeyLoad:
    """One key's part of a tier's committed work (an active key may have none)."""

    key_id: str
    weight: float
    committed_s: float
    error_s: float = 0.0  # what admission adds for the key (``admission_error``)
    # The part of ``committed_s`` prefilling on a worker now. Another key's newcomer waits for
    # it whatever fair order says: a same-tier request of a later deadline does not preempt it.
    running_s: float = 0.0
    # The key sent the tier more than its share lately (``fairness``): no burst credit.
    over_share: bool = False
    # How much of ``committed_s`` fair order places before the tier's virtual time ``V``
    # (prefill seconds: the committed work less how far past V, weighted, its last finish tag
    # lies, that at most its credit before V; so it may exceed ``committed_s``, and it is
    # negative where the work ends further past V than it is long). None where unknown (summed
    # over several owners, each with its own V): the key's burst credit is taken as unspent.
    lead_s: float | None = None


@dataclass(frozen=True)
class TierLoad:
    """One scheduling instance's committed work of one tier, and what it predicts with."""

    tier: str
    workers: int  # attached workers that run the tier's requests
    committed_s: float  # predicted prefill seconds left of the tier's unfinished requests
    switch_s: float  # how long a running prefill takes to give way (p95 observed)
    margin: float  # the prefill predictor's observed relative under-estimate
    coefficients: tuple[float, float, float]  # the prefill predictor's a, b, c
    calibrated: bool  # the predictor was fitted to measurements, not its fallback
    keys: tuple[KeyLoad, ...] = ()  # per key: the committed work, and the keys active lately
    error_s: float = 0.0  # what admission adds for a key it has no error of (the tier's)
    # The share of the workers' time the tier's prefills took lately (measured by its owner):
    # what a lower tier's work does not get (``share_left``).
    busy_share: float = 0.0
    # The predictor's coefficients at its first calibration, not as its online refit follows
    # the load (``PrefillTimePredictor.reference_coefficients``); None: unknown.
    reference_coefficients: tuple[float, float, float] | None = None


def predict_prefill_s(coefficients: tuple[float, float, float], prompt_tokens: int) -> float:
    """The prefill predictor's model (``predictor.PrefillTimePredictor.predict``) for a whole
    prompt, from its coefficients alone (another instance's)."""
    a, b, c = coefficients
    return a * prompt_tokens + b * prompt_tokens * prompt_tokens + c


def own_prefill_s(loads: Sequence[TierLoad], prompt_tokens: int) -> float:
    """A prompt's predicted prefill seconds: the most pessimistic of the loads' calibrated
    predictors (0 when none is)."""
    return _most_pessimistic(loads, prompt_tokens, lambda load: load.coefficients)


def reference_prefill_s(loads: Sequence[TierLoad], prompt_tokens: int) -> float:
    """A prompt's prefill seconds as the loads' predictors were first calibrated (the most
    pessimistic; each load's current coefficients where it has no reference): what a key's
    request counts against its share (``fairness.SentRates``). Under a flood the online
    refit followed prefills slowed by the flood's own load on the machine, and a calm key's
    prompts were predicted 1.6x longer than alone: its steady rate came to its share, and
    judged over it, it was refused for the last 6 s of a run (docs/results.md)."""
    return _most_pessimistic(
        loads, prompt_tokens, lambda load: load.reference_coefficients or load.coefficients
    )


def _most_pessimistic(
    loads: Sequence[TierLoad],
    prompt_tokens: int,
    coefficients: Callable[[TierLoad], tuple[float, float, float]],
) -> float:
    return max(
        (predict_prefill_s(coefficients(load), prompt_tokens) for load in loads if load.calibrated),
        default=0.0,
    )


@dataclass(frozen=True)
class Verdict:
    tier: str
    admit: bool
    predicted_ttft_s: float
    slo_s: float
    # Its parts, for the request log and a benchmark's timeline: predicted TTFT = switch_s +
    # wait_s + own_s + margin * inflated_s + error_s, wait_s the committed work ahead per
    # worker, inflated_s own_s (the key within its share) or wait_s + own_s (over it). Below
    # the top tier its own tier's work ahead and its own prefill are stretched by what the
    # higher tiers leave of the workers (``share_left``; 1 at the top).
    wait_s: float = 0.0
    own_s: float = 0.0
    margin: float = 0.0
    switch_s: float = 0.0
    error_s: float = 0.0
    inflated_s: float = 0.0
    share_left: float = 1.0
    # What the request's key would hold of the tier with it: its committed work and the
    # request's own prefill (``fairness.HeldPeaks``).
    held_s: float = 0.0
    # The tier's busy share, and whether it closed the tier's spare capacity to the request's
    # key (over its share, the tier at its ``borrow_limit``).
    busy_share: float = 0.0
    borrow_closed: bool = False

    @property
    def retry_after_s(self) -> int:
        """Whole seconds after which the committed work has drained by the excess (>= 1)."""
        return max(1, math.ceil(self.predicted_ttft_s - self.slo_s))

    def reason(self) -> str:
        if self.borrow_closed:
            return (
                f"the {self.tier} tier's spare capacity is taken: its key is over its share and "
                f"the tier's prefills take {self.busy_share:.0%} of its workers' time"
            )
        return (
            f"the {self.tier} tier is at capacity: predicted time to first token "
            f"{self.predicted_ttft_s:.2f} s against its SLO of {self.slo_s:g} s"
        )


def judge(
    tier: TierPolicy,
    loads: Sequence[TierLoad],
    prompt_tokens: int,
    pending: Sequence[Pending] = (),
    key_id: str = "",
    key_weight: float = 1.0,
    above: Sequence[TierLoad] = (),
    standings: Mapping[str, bool] | None = None,
    peaks: Mapping[str, float] | None = None,
) -> Verdict | None:
    """Whether a request of ``prompt_tokens`` from key ``key_id`` is admitted at ``tier`` on
    top of ``loads`` and of ``pending`` (requests admitted that no load counts yet), behind
    the committed work of the higher tiers (``above``: it runs first on the same workers);
    ``standings``: whether each key admission has seen is over its share, as it measures
    them now (a key not in it: as the loads say); ``peaks``: the most each key asked to hold
    of the tier at once lately (``fairness.HeldPeaks``; a key not in it: its share). None when
    the rule cannot be applied: no worker serves the tier, or no load has a calibrated
    predictor (the request then stands at its tier)."""
    workers = sum(load.workers for load in loads)
    calibrated = [load for load in loads if load.calibrated and load.workers > 0]
    if workers == 0 or not calibrated:
        return None

    def prefill_s(tokens: int) -> float:
        return own_prefill_s(calibrated, tokens)

    own_s = prefill_s(prompt_tokens)
    margin = max(load.margin for load in calibrated)
    switch_s = max(load.switch_s for load in loads)
    tier_error_s = max(load.error_s for load in loads)
    keys = key_loads(loads, pending, prefill_s, tier_error_s)
    mine = keys.get(key_id, KeyLoad(key_id, key_weight, 0.0, tier_error_s))
    keys[key_id] = dataclasses.replace(mine, weight=key_weight)
    for k, over in (standings or {}).items():
        if k in keys:
            keys[k] = dataclasses.replace(keys[k], over_share=over)
    standing = keys[key_id].over_share
    error_s = mine.error_s

    left = share_left(above)
    drain = workers * left  # prefill seconds a second the tier's own work gets

    def capacity_s(key: KeyLoad) -> float:  # with the key's own error: see the module's text
        return tier_capacity_s(drain, tier.ttft_slo_s, switch_s + key.error_s)

    ahead_s = _ahead_s(keys, key_id, own_s, capacity_s, peaks or {})
    held_s = mine.committed_s + own_s
    wait_s = sum(load.committed_s for load in above) / workers + ahead_s / drain
    own_s /= left
    inflated_s = own_s + (wait_s if standing else 0.0)  # the module's text says why
    ttft_s = switch_s + wait_s + own_s + margin * inflated_s + error_s
    busy = busy_share(loads)
    closed = standing and busy >= tier.borrow_limit
    return Verdict(
        tier.name, ttft_s <= tier.ttft_slo_s and not closed, ttft_s, tier.ttft_slo_s, wait_s,
        own_s, margin, switch_s, error_s, inflated_s, left, held_s, busy, closed,
    )  # fmt: skip


# A lower tier is judged with at least this share of the workers left to it: it then holds
# a twentieth of its SLO's worth of work, and keeps admitting the shortest and measuring.
MIN_SHARE_LEFT = 0.05


def share_left(above: Sequence[TierLoad]) -> float:
    """The share of the workers' time the higher tiers (``above``: their loads, every owner's)
    leave to a lower tier: 1 less each higher tier's busy share."""
    return max(MIN_SHARE_LEFT, 1.0 - busy_share(above))


def busy_share(loads: Sequence[TierLoad]) -> float:
    """The share of the workers' time the prefills of the tiers of ``loads`` took lately: each
    tier's owners' busy shares weighted by their workers, summed over the tiers."""
    busy: dict[str, float] = {}
    workers: dict[str, int] = {}
    for load in loads:
        busy[load.tier] = busy.get(load.tier, 0.0) + load.busy_share * load.workers
        workers[load.tier] = workers.get(load.tier, 0) + load.workers
    return sum(busy[t] / workers[t] for t in busy if workers[t])


@dataclass(frozen=True)
class Pending:
    """A request this instance admitted that no published load counts yet."""

    key_id: str
    weight: float
    prompt_tokens: int


def key_loads(
    loads: Sequence[TierLoad],
    pending: Sequence[Pending],
    prefill_s: Callable[[int], float],
    tier_error_s: float,
) -> dict[str, KeyLoad]:
    """Per key, the committed work of every instance and of the pending admissions summed,
    and the error admission adds for it: the largest any owner measured for it, or the
    tier's where no owner names the key. A load that names no keys (one from before keys
    were published) counts as key ""."""
    if len(loads) == 1 and not pending and loads[0].keys:
        # One instance's load (the scheduler judging on its own): its keys are the sums.
        (load,) = loads
        keys = {k.key_id: k for k in load.keys}
        named = sum(k.committed_s for k in load.keys)
        if load.committed_s <= named + 1e-9:
            return keys
    keys = {}

    def add(
        key_id: str,
        weight: float,
        seconds: float,
        running_s: float = 0.0,
        error_s: float = -1.0,
        over_share: bool = False,
        lead_s: float | None = None,
        pending: bool = False,
    ) -> None:
        before = keys.get(key_id)
        # A pending request's tags follow its key's committed work: where that starts is kept.
        # Two owners' leads are against two virtual times, and do not add up: unknown.
        lead = lead_s if before is None else before.lead_s if pending else None
        before = before or KeyLoad(key_id, 0.0, 0.0, -1.0)
        keys[key_id] = KeyLoad(
            key_id,
            max(weight, before.weight),
            before.committed_s + seconds,
            max(error_s, before.error_s),
            before.running_s + running_s,
            before.over_share or over_share,
            lead,
        )

    for load in loads:
        named = sum(k.committed_s for k in load.keys)
        for k in load.keys:
            add(k.key_id, k.weight, k.committed_s, k.running_s, k.error_s, k.over_share, k.lead_s)
        if load.committed_s > named + 1e-9:
            add("", 1.0, load.committed_s - named)
    for item in pending:
        add(item.key_id, item.weight, prefill_s(item.prompt_tokens), pending=True)
    unmeasured = [k for k in keys.values() if k.error_s < 0]  # no owner names it
    keys.update((k.key_id, dataclasses.replace(k, error_s=tier_error_s)) for k in unmeasured)
    return keys


def key_share_s(capacity_s: float, weight: float, weights: Sequence[float]) -> float:
    """A key's share of its tier's capacity (predicted prefill seconds in flight): what
    admission keeps free for a key within its share while another key's work waits past the
    virtual time (``_ahead_s``)."""
    return capacity_s * weight / sum(weights)


def tier_capacity_s(workers: float, slo_s: float, switch_s: float) -> float:
    """The predicted prefill seconds a tier can hold in flight and still meet its SLO
    (``switch_s``: with admission's error added; ``workers``: what the tier's work gets of
    them, ``share_left``)."""
    return workers * max(0.0, slo_s - switch_s)


def _ahead_s(
    keys: dict[str, KeyLoad],
    key_id: str,
    own_s: float,
    capacity_s: Callable[[KeyLoad], float],
    peaks: Mapping[str, float],
) -> float:
    """The committed work a newcomer of ``key_id`` waits for in fair order, with the room of
    the other keys within their share kept free while its key is over its own (``capacity_s``:
    the tier's capacity as a key's credit and share are reckoned; ``peaks``: what each key held
    at once lately)."""
    mine = keys[key_id]
    others = [k for k in keys.values() if k.key_id != key_id]
    weights = [k.weight for k in keys.values()]

    def credit_s(key: KeyLoad) -> float:
        return 0.0 if key.over_share else capacity_s(key)

    def share_s(key: KeyLoad) -> float:
        return key_share_s(capacity_s(key), key.weight, weights)

    def lead_s(key: KeyLoad) -> float:  # how much of the key's committed work lies before V
        return credit_s(key) if key.lead_s is None else key.lead_s

    def laid_out_s(key: KeyLoad) -> float:  # another key's work, as admission lays it out
        # A key within its share is laid out with its whole credit at least: fair order would
        # run a newcomer before the part of its work that lies later, and admission does not
        # check that part's deadlines again. Laid out where its tags lie, the flood's
        # newcomers were admitted ahead of a calm key's waiting work, and 20 of its 200
        # requests missed (docs/results.md).
        return max(lead_s(key), credit_s(key))

    # The newcomer's start tag: after its key's committed work, and at most its credit before V.
    start = max(mine.committed_s - lead_s(mine), -credit_s(mine))
    finish = (start + own_s) / mine.weight  # past V
    ahead = mine.committed_s + sum(
        max(min(k.committed_s, max(0.0, k.weight * finish + laid_out_s(k))), k.running_s)
        for k in others
    )

    def room_s(key: KeyLoad) -> float:  # its share, or what it held at its bursts, to its credit
        return min(credit_s(key), max(share_s(key), peaks.get(key.key_id, 0.0)))

    if mine.over_share or (mine.committed_s > 0 and mine.committed_s + own_s > share_s(mine)):
        ahead += sum(max(0.0, room_s(k) - k.committed_s) for k in others if not k.over_share)
    return ahead
