"""The event-driven scheduler: a pure state machine, events in, commands out.

``Scheduler.handle(event, now)`` is the only entry point that changes state, and the only place
decisions are made: no threads, no sleeping, no clock of its own (``now`` is passed in), no I/O.
So the same object runs in-process in benchmarks (a simulated or real clock) and behind the
gRPC/Kafka I/O of the queue service, which translates wire messages to events and commands
back to wire messages.

Contracts with the worker side:
- A worker runs one request at a time, prefill then decode; a request holds its worker from
  Assign/Resume until RequestDone, PreemptionAcked or Cancel.
- Commands to one worker are applied in the order they are sent: after Cancel the scheduler
  treats the worker as free at once, and the worker starts the next Assign when it has stopped.
- Events naming a worker that no longer holds the request are stale and ignored (races
  between a Preempt and the end of a prefill, a worker that left, a cancelled request).

Contract with the dispatcher: ``SetTimer(rid, at_s)`` arms (or moves) the request's one timer,
``CancelTimer(rid)`` disarms it; the dispatcher hands ``TimerFired(rid)`` back at or after
``at_s``. Timers are how a request that chose to wait on a prediction is reconsidered at the
last moment a preemption still saves its deadline, even if no other event comes.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from queue_service.scheduler import decode_batch, fairness, packing, planner
from queue_service.scheduler.admission_error import AdmissionErrors
from queue_service.scheduler.capacity import (
    KeyLoad,
    TierLoad,
    tier_capacity_s,
)
from queue_service.scheduler.events import (
    Assign,
    AssignPacked,
    Cancel,
    CancelTimer,
    Command,
    DecodeStepDone,
    Drain,
    Event,
    PauseDecode,
    Preempt,
    PreemptionAcked,
    PrefillFinished,
    PrefillProgress,
    Reject,
    RequestArrived,
    RequestCancelled,
    RequestDone,
    Resume,
    SetTimer,
    TimerFired,
    WorkerDraining,
    WorkerJoined,
    WorkerLeft,
)
from queue_service.scheduler.policies import SchedulingPolicy, make_policy, slack_s
from queue_service.scheduler.prediction_error import PredictionErrors
from queue_service.scheduler.predictor import PrefillSample, PrefillTimePredictor
from queue_service.scheduler.request import ON_WORKER, Request, RequestState, WorkerSlot
from queue_service.scheduler.waiting_index import WaitingIndex
from tierflow.recent import RecentMap
from tierflow.tiers import TierPolicy, TierTable


@dataclass(frozen=True)
class SchedulerConfig:
    # Anti-thrash: after this many preemptions a request runs to completion. None: the
    # policy's own bound (``SchedulingPolicy.max_preemptions``: 32 where a preemption keeps the
    # state, 8 where it throws the work away).
    max_preemptions: int | None = None
    # No starvation: waited this long since arrival -> first in line and never preempted. Above
    # the largest TTFT SLO so that it only overrides the policy for work already late.
    starvation_s: float = 300.0
    # Overload: a new request of a sheddable tier is rejected when this many sheddable requests
    # already wait, or when the predicted wait (backlog per worker) exceeds the second limit.
    max_queued_sheddable: int = 1000
    max_predicted_wait_s: float = 300.0
    # Suspended states kept per worker (KV memory); the worker also caps bytes itself.
    max_suspended_per_worker: int = 4
    # Refit the prefill predictor from every PrefillFinished.
    refit_predictor: bool = True
    # Relative margin on predicted times until the predictor's own error is known (20
    # measured prefills); after that the margin is the p95 of its under-estimates.
    default_prediction_margin: float = 0.2
    # A wake-up is moved only when its time changes by more than this.
    timer_resolution_s: float = 0.001
    # Progress reports update the estimate every time, but decide at most this often: on a GPU
    # layers take a millisecond, and a decision costs about as much with 100 requests waiting.
    # Wake-ups keep deadlines precise in between.
    progress_decision_interval_s: float = 0.02
    # Terminal request ids remembered so that a redelivered arrival is ignored.
    remember_finished: int = 100_000
    # Packed prefill on batched workers (``packing``): at most this many short prompts, of
    # this many tokens together, in one forward, and only when the pack still meets the
    # tightest deadline in it. A max_pack_size below 2 turns packing off.
    max_pack_size: int = 8
    max_pack_tokens: int = 512
    # A key keeps its share of its tier reserved at admission (``capacity.judge``) this long
    # after its last request: a key that sends now and then finds its share free when it
    # comes back. At most ``remember_keys`` keys are remembered.
    key_active_s: float = 60.0
    remember_keys: int = 10_000
    # A decision plans over the head of the waiting queues only (``waiting_index``): per tier
    # this many of each order, and a pack's worth more per free worker. None: over every
    # waiting request, the full planner (the reference of tests/unit/test_scheduler_window.py).
    # 1: the head of each order suffices to decide (the scale bench: a larger window only made
    # decisions dearer, docs/results.md), and the rest wait on their wake-ups.
    plan_window: int | None = 1

    def __post_init__(self) -> None:
        if self.max_preemptions is not None and self.max_preemptions < 0:
            raise ValueError("max_preemptions must be >= 0")
        for name in (
            "max_queued_sheddable",
            "max_suspended_per_worker",
            "max_pack_size",
            "max_pack_tokens",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in (
            "starvation_s",
            "max_predicted_wait_s",
            "default_prediction_margin",
            "timer_resolution_s",
            "progress_decision_interval_s",
            "key_active_s",
        ):
            value = getattr(self, name)
            if math.isnan(value) or value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if self.remember_finished < 1:
            raise ValueError("remember_finished must be >= 1")
        if self.remember_keys < 0:
            raise ValueError("remember_keys must be >= 0")
        if self.plan_window is not None and self.plan_window < 1:
            raise ValueError("plan_window must be >= 1 (or None: every waiting request)")


class Scheduler:
    def __init__(
        self,
        policy: SchedulingPolicy | str,
        tiers: TierTable,
        predictor: PrefillTimePredictor | None = None,
        config: SchedulerConfig | None = None,
    ) -> None:
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.tiers = tiers
        self.predictor = predictor if predictor is not None else PrefillTimePredictor()
        self.config = config if config is not None else SchedulerConfig()
        self._init_measurements()
        self._init_limits()
        self._init_state()
        self._handlers: dict[type, Callable[[Any, float], list[Command]]] = {
            RequestArrived: self._on_arrived,
            PrefillProgress: self._on_progress,
            PrefillFinished: self._on_prefill_finished,
            RequestDone: self._on_done,
            PreemptionAcked: self._on_preemption_acked,
            RequestCancelled: self._on_cancelled,
            TimerFired: self._on_timer_fired,
            DecodeStepDone: self._on_decode_step,
            WorkerJoined: self._on_worker_joined,
            WorkerLeft: self._on_worker_left,
            WorkerDraining: self._on_worker_draining,
        }

    def _init_measurements(self) -> None:
        """What the scheduler learns as it runs: how wrong its predictions are, per tier too,
        admission's own error, and the share of the workers each tier's prefills take."""
        self.prediction_errors = PredictionErrors(
            default_margin=self.config.default_prediction_margin
        )
        self._estimator = planner.Estimator(self.predictor, self.prediction_errors)
        # The same errors per tier, for admission's margin (``tier_load``): a tier's prefills
        # err as its prompts do, and the batch tier's long prompts and recomputes and the
        # standard tier's packs are not the critical tier's short prompts. Under a flood the
        # margin over every prefill was 0.37-0.66 (p10-p90) at the calm key's admissions, its
        # own prefills' p95 error 0.29, and its borderline requests were refused on the
        # difference (docs/results.md).
        self._tier_prediction_errors = {
            name: PredictionErrors(default_margin=self.config.default_prediction_margin)
            for name in self.tiers.names
        }
        # Admission's own TTFT error, per tier that admission judges (``admission_error``).
        self.admission_errors = AdmissionErrors(
            {name: self.tiers[name].ttft_slo_s for name in self.tiers.judged()},
            remember_keys=self.config.remember_keys,
        )
        # The prefill seconds each tier's requests took of the workers lately (the same
        # decayed average as what keys ask, ``fairness.SentRates``): what a higher tier leaves
        # of the workers is what a lower tier's work drains at (``capacity``, ``busy_share``).
        # Over a tier's first second its share is that of the time since its first prefill
        # ended (at least a quarter second), not of a whole second: averaged over a second, a
        # flood that took 80 % of the worker from its start left standard 0.63-0.85 of it on
        # paper for half a second, and 11 requests downgraded then waited 9 s (docs/results.md).
        # The first prefill's own time lies before that, so the share reads high at first (a
        # downgrade then waits for it to settle); it is at most 1 (``tier_load``).
        self._served = fairness.SentRates(min_age_s=0.25)

    def _init_limits(self) -> None:
        """The rules and bounds its decisions keep, from the policy, the config and the tiers."""
        self._rules = planner.Rules(
            starvation_s=self.config.starvation_s,
            max_preemptions=(
                self.policy.max_preemptions
                if self.config.max_preemptions is None
                else self.config.max_preemptions
            ),
            max_suspended_per_worker=self.config.max_suspended_per_worker,
        )
        self._pack_cost = packing.PackCost(self.predictor)
        self._tier_bounds = decode_batch.TierBounds(
            tightest_tbt_s=min((t.tbt_slo_s for t in self.tiers if t.tbt_slo_s), default=0.0),
            lowest_rank=max((t.rank for t in self.tiers), default=decode_batch.NO_RANK),
        )
        self._pack_limits = packing.PackLimits(
            self.config.max_pack_size, self.config.max_pack_tokens
        )

    def _init_state(self) -> None:
        """The live requests, the workers, the keys and the bookkeeping of decisions."""
        self._requests: dict[str, Request] = {}  # live: not yet terminal
        # The live requests that wait for a prefill, sorted (``waiting_index``).
        self._index = WaitingIndex(
            self.policy, self.predictor, self.config.starvation_s, self._pack_limits
        )
        # Tier -> key -> (live requests, the key's weight): who holds work in a tier.
        self._live_keys: dict[str, dict[str, list]] = {name: {} for name in self.tiers.names}
        self._finished: RecentMap[str, RequestState] = RecentMap(self.config.remember_finished)
        self._keys = fairness.KeyBook(self.config.remember_keys)
        self._workers: dict[str, WorkerSlot] = {}  # in join order
        self._timers: dict[str, float] = {}  # request id -> armed wake-up time
        self._decided_at = -math.inf  # when the last decision was made
        # The waiting requests the last decision planned over, and whether that was all.
        self._planned: tuple[dict[str, float], bool] = ({}, True)
        self._seq = 0
        self._worker_seq = 0
        self._counters: Counter[str] = Counter()

    # ------------------------------------------------------------------ entry point

    def handle(self, event: Event, now: float) -> list[Command]:
        """Apply one event at time ``now`` (seconds, any epoch); return the commands to send."""
        try:
            handler = self._handlers[type(event)]
        except KeyError:
            raise TypeError(f"not a scheduler event: {event!r}") from None
        self._counters[type(event).__name__] += 1
        try:
            return handler(event, now)
        finally:
            self._estimator.release()

    # ------------------------------------------------------------------ events

    def _on_arrived(self, ev: RequestArrived, now: float) -> list[Command]:
        rid = ev.request_id
        if rid in self._requests or rid in self._finished:
            self._counters["duplicate_arrivals"] += 1
            return []  # redelivered (Kafka at-least-once, client retry): already handled
        if ev.tier not in self.tiers:
            return self._reject(
                rid, f"unknown tier {ev.tier!r}; known: {', '.join(self.tiers.names)}"
            )
        if ev.prompt_tokens < 1 or ev.max_new_tokens < 0:
            return self._reject(
                rid,
                f"invalid request: prompt_tokens={ev.prompt_tokens}, "
                f"max_new_tokens={ev.max_new_tokens}",
            )
        if not (ev.key_weight > 0 and math.isfinite(ev.key_weight)):
            return self._reject(rid, f"invalid key weight {ev.key_weight!r}: must be > 0")
        tier = self.tiers[ev.tier]
        # An arrival changes no live request's estimate: admission, fair order and the
        # decision share one computation of each (``planner.Estimator``).
        self._estimator.hold(now)
        if tier.sheddable:
            reason = self._overload_reason(now)
            if reason is not None:
                return self._reject(rid, reason, overload=True)
        self._seq += 1
        arrival_s = now if ev.arrival_s is None else min(ev.arrival_s, now)
        req = Request(
            request_id=rid,
            tier=tier,
            arrival_s=arrival_s,
            prompt_tokens=ev.prompt_tokens,
            max_new_tokens=ev.max_new_tokens,
            seq=self._seq,
            key_id=ev.key_id,
            key_weight=ev.key_weight,
            progress_at_s=now,
        )
        req.admission_ttft_s = ev.admission_ttft_s  # admission's own (None: not judged)
        req.key_over_share = ev.key_over_share
        req.fair_tag = self._keys.arrive(
            req,
            self.predictor.predict(req.prompt_tokens),
            self._fair_peers(tier.name, now),
            credit_s=lambda: self._burst_credit_s(tier, req.key_id, req.key_over_share),
        )
        self._requests[rid] = req
        held = self._live_keys[tier.name].setdefault(req.key_id, [0, req.key_weight])
        held[0] += 1
        held[1] = req.key_weight
        self._index.touch(req)
        return self._schedule(now)

    def _fair_peers(self, tier: str, now: float) -> list[Request]:
        """The tier's request still to prefill that can make its deadline with the smallest
        fair start tag (``fairness.KeyBook.arrive`` reads the smallest), if any: among the
        first such waiting request by tag, those always in the planning window, and those
        prefilling on a worker. Judged in tag order, so that only the first on-time one is
        predicted."""
        peers = [r for r in self._index.special() if r.tier.name == tier]
        peers += [r for r in self._prefilling() if r.tier.name == tier]
        first = next((r for r in self._index.by_tag(tier) if self._on_time(r, now)), None)
        peers += [first] if first is not None else []
        peers.sort(key=lambda r: r.fair_tag)
        return next(([r] for r in peers if not r.prefilled and self._on_time(r, now)), [])

    def _prefilling(self) -> list[Request]:
        """The requests on the workers' prefills (running, packed or being preempted)."""
        return [r for members in self._prefills() for r in members]

    def _prefills(self) -> Iterator[list[Request]]:
        """Per worker prefilling, its request, or its pack's members."""
        requests = self._requests
        for worker in self._workers.values():
            members = [requests[worker.active]] if worker.active in requests else []
            if worker.riders:
                members += [requests[rid] for rid in worker.riders if rid in requests]
            if members:
                yield members

    def _prefill_work_left(self, now: float) -> Iterator[tuple[Request, float]]:
        """Each request on the workers' prefills with its part of the work left there (a pack
        pays one fixed cost: ``packing.work_left``)."""
        for members in self._prefills():
            if len(members) == 1:
                yield members[0], self._estimator.prefill_left(members[0], now)
            else:
                left = packing.work_left(members, self._pack_cost, now)
                yield from zip(members, left, strict=True)

    def _worker_prefill_left(self, now: float) -> dict[str, float]:
        """Per worker prefilling, the predicted work left of its prefill (a pack's whole)."""
        left: dict[str, float] = {}
        for req, left_s in self._prefill_work_left(now):
            assert req.worker_id is not None
            left[req.worker_id] = left.get(req.worker_id, 0.0) + left_s
        return left

    def _on_time(self, req: Request, now: float) -> bool:
        """Whether ``req`` can still make its deadline, as fair order judges it (``fairness``)."""
        return slack_s(req, now, self._estimator.prefill_left(req, now)) >= 0

    def _burst_credit_s(self, tier: TierPolicy, key_id: str, over_share: bool) -> float:
        """What fair order lets the key run ahead of the keys over their share: the tier's
        capacity as admission reckons it (``capacity.tier_capacity_s``, with the key's own
        error) while admission finds the key within its share, else nothing (``fairness``)."""
        if over_share:
            return 0.0
        return tier_capacity_s(
            self._serving_workers(),
            tier.ttft_slo_s,
            self.switch_s() + self.admission_errors.error_s(tier.name, key_id, within_share=True),
        )

    def _on_progress(self, ev: PrefillProgress, now: float) -> list[Command]:
        # The estimate of what is left gets sharper, and a request that chose to wait on the
        # old estimate may now need a preemption after all.
        req = self._on_worker(ev.request_id, ev.worker_id)
        if req is None or req.prefilled:
            return []
        req.tokens_done = max(req.tokens_done, min(ev.tokens_done, req.prompt_tokens))
        within_chunk = ev.layers_done > 0 and ev.chunk_end > req.tokens_done
        req.chunk_end = ev.chunk_end if within_chunk else 0
        req.chunk_fraction = ev.layers_done / max(1, ev.num_layers) if within_chunk else 0.0
        req.progress_at_s = now
        if now - self._decided_at < self.config.progress_decision_interval_s:
            return []  # decided a moment ago; the estimate is fresher for the next decision
        beside = any(w.decoding or w.suspended for w in self._workers.values())
        if not beside and not len(self._index):
            return []  # nobody waits or decodes beside it: nothing to decide
        return self._schedule(now)

    def _decides(self, now: float) -> bool:
        """Whether an event that frees a prefill or a KV slot makes a decision: unless nothing
        waits for either (no prefill, no paused decode) and the last decision was made a
        moment ago. What such a decision could still do is pause decodes for a prefill that
        time put at risk, which the next progress report decides as soon (its interval)."""
        if len(self._index) or any(w.suspended for w in self._workers.values()):
            return True
        return now - self._decided_at >= self.config.progress_decision_interval_s

    def _on_prefill_finished(self, ev: PrefillFinished, now: float) -> list[Command]:
        req = self._on_worker(ev.request_id, ev.worker_id)
        if req is None or req.prefilled:
            return []
        req.prefilled = True
        req.tokens_done = req.prompt_tokens
        if req.first_token_s is None:
            req.first_token_s = now
            if req.admission_ttft_s is not None:
                ttft_s = now - req.arrival_s
                self.admission_errors.observe(
                    req.tier.name, req.key_id, req.admission_ttft_s, ttft_s
                )
        if req.state is RequestState.RUNNING:
            # A PREEMPTING one stays so: the engine also stops decode at its next check.
            req.state = RequestState.DECODING
            req.progress_at_s = now
            worker = self._workers[ev.worker_id]
            # It joins the batch: the worker may prefill the next one.
            packing.leave(req, worker)
            worker.decoding[req.request_id] = None
        if ev.pack_tokens:
            self._learn_pack(req, ev)
        else:
            self._learn_prefill(req, ev)
        if not ev.pack_tokens or req.pack[:1] == (req.request_id,):  # a pack's time once
            self._served.add(req.tier.name, "", ev.prefill_s, now)
        req.pack = ()  # the pack's state is gone: each member holds its own KV now
        # Its first token is out, so it is now a cheap victim: a decision point.
        return self._schedule(now) if self._decides(now) else []

    def _learn_prefill(self, req: Request, ev: PrefillFinished) -> None:
        if req.predicted_prefill_s is not None and not req.restarted:
            # Out of sample: the prediction was made before this run refits the predictor.
            self._observe_error(req, ev.prefill_s)
        if self.config.refit_predictor and ev.tokens >= 1 and ev.prefill_s > 0:
            self.predictor.observe(PrefillSample(ev.tokens, 0, ev.prefill_s))

    def _learn_pack(self, req: Request, ev: PrefillFinished) -> None:
        """Once per pack (its first member's report): the pack's time, for the pack cost."""
        if not req.pack or req.pack[0] != req.request_id:
            return
        if req.predicted_prefill_s is not None and not req.restarted:
            self._observe_error(req, ev.prefill_s)
        if self.config.refit_predictor:
            self._pack_cost.observe(ev.pack_tokens, ev.prefill_s)

    def _observe_error(self, req: Request, prefill_s: float) -> None:
        self.prediction_errors.observe(req.predicted_prefill_s, prefill_s)
        self._tier_prediction_errors[req.tier.name].observe(req.predicted_prefill_s, prefill_s)

    def _admission_margin(self, tier: str) -> float:
        """The margin admission inflates the tier's predictions by: its own prefills' error
        once it has enough of them, else every prefill's."""
        errors = self._tier_prediction_errors.get(tier)
        if errors is not None and len(errors) >= errors.min_samples:
            return errors.margin()
        return self.prediction_errors.margin()

    def _on_decode_step(self, ev: DecodeStepDone, now: float) -> list[Command]:
        worker = self._workers.get(ev.worker_id)
        if worker is not None and ev.rows > 0:
            worker.decode_step_s = decode_batch.learn_step(worker.decode_step_s, ev.seconds)
        return []  # the step changes no decision by itself: the next event sees its time

    def _on_done(self, ev: RequestDone, now: float) -> list[Command]:
        req = self._requests.get(ev.request_id)
        if req is None or req.worker_id != ev.worker_id:
            return []
        worker = self._workers.get(ev.worker_id)
        if worker is not None:
            worker.suspended.pop(req.request_id, None)
            worker.decoding.pop(req.request_id, None)
            packing.leave(req, worker, pack_goes_on=True)
        self._finish(req, RequestState.DONE)
        return self._schedule(now) if self._decides(now) else []

    def _on_preemption_acked(self, ev: PreemptionAcked, now: float) -> list[Command]:
        req = self._on_worker(ev.request_id, ev.worker_id)
        if req is None or req.state is not RequestState.PREEMPTING:
            return []  # it finished or was cancelled before the worker saw the Preempt
        worker = self._workers[ev.worker_id]
        packing.leave(req, worker)  # a paused decode never held the prefill
        worker.decoding.pop(req.request_id, None)
        self._estimator.switch.observe(ev.latency_s)
        if ev.state_dropped:
            req.restart_from_scratch()
            self._counters["restarts"] += 1
        else:
            req.state = RequestState.SUSPENDED
            if not req.prefilled:
                req.tokens_done = max(0, min(ev.tokens_done, req.prompt_tokens))
            worker.suspended[req.request_id] = None
        self._index.touch(req)
        return self._schedule(now)

    def _on_cancelled(self, ev: RequestCancelled, now: float) -> list[Command]:
        req = self._requests.get(ev.request_id)
        if req is None:
            return []
        commands: list[Command] = []
        if req.worker_id is not None and req.worker_id in self._workers:
            worker = self._workers[req.worker_id]
            commands.append(Cancel(req.request_id, worker.worker_id))
            worker.suspended.pop(req.request_id, None)
            worker.decoding.pop(req.request_id, None)
            packing.leave(req, worker, pack_goes_on=True)
        self._finish(req, RequestState.CANCELLED)
        return commands + self._schedule(now)

    def _on_timer_fired(self, ev: TimerFired, now: float) -> list[Command]:
        req = self._requests.get(ev.request_id)
        if ev.request_id not in self._timers or req is None or not req.waiting:
            return []  # cancelled or moved meanwhile: stale
        del self._timers[ev.request_id]
        left_s = self._estimator.prefill_left(req, now)
        margin, switch_s = self.prediction_errors.margin(), self.switch_s()
        at = self.policy.latest_start_s(req, now, left_s, margin, switch_s)
        if at is not None and at - now > self.config.timer_resolution_s:
            # Armed on an older error margin (a waiting request outside the planning window
            # keeps the wake-up it got when it was indexed): not due yet, so aim it again.
            self._timers[req.request_id] = at
            self._counters["timers_reaimed"] += 1
            return [SetTimer(req.request_id, at)]
        req.due = True  # from now on it preempts whenever its rank allows
        self._counters["timers_fired"] += 1
        self._index.touch(req)
        return self._schedule(now)

    def _on_worker_joined(self, ev: WorkerJoined, now: float) -> list[Command]:
        if ev.worker_id in self._workers:
            return []
        self._worker_seq += 1
        self._workers[ev.worker_id] = WorkerSlot(
            ev.worker_id, self._worker_seq, kv_slots=ev.kv_slots
        )
        self._estimator.switch.expect(ev.interruption_s)
        return self._schedule(now)

    def _on_worker_left(self, ev: WorkerLeft, now: float) -> list[Command]:
        worker = self._workers.pop(ev.worker_id, None)
        if worker is None:
            return []
        # Its states are gone with it: everything it held starts again, elsewhere.
        active = [worker.active] if worker.active else []
        held = [*active, *worker.riders, *worker.suspended, *worker.decoding]
        for rid in held:
            self._requests[rid].restart_from_scratch()
            self._index.touch(self._requests[rid])
            self._counters["restarts"] += 1
        return self._schedule(now)

    def _on_worker_draining(self, ev: WorkerDraining, now: float) -> list[Command]:
        worker = self._workers.get(ev.worker_id)
        if worker is None or worker.draining:
            return []
        # From here on it gets no Assign (``WorkerSlot.has_kv_slot``) and no preemption for a
        # new request; what it holds runs to the end there (suspended states included: they
        # resume on it, which costs less than a recompute elsewhere). Drain tells the worker
        # that no new request follows, so it may leave once it holds nothing.
        worker.draining = True
        self._counters["drains"] += 1
        return [Drain(worker.worker_id), *self._schedule(now)]

    def _serving_workers(self) -> int:
        """Workers that take new requests (a draining one does not)."""
        return sum(1 for w in self._workers.values() if not w.draining)

    # ------------------------------------------------------------------ decisions

    def _schedule(self, now: float) -> list[Command]:
        self._estimator.hold(now)  # the event's news is in: estimates stay put while deciding
        self._decided_at = now
        self._counters["decisions"] += 1
        touched = self._index.sync(now, self._waits)
        workers = list(self._workers.values())
        commands: list[Command] = [
            self._resume_decode(req, worker, now)
            for req, worker in decode_batch.decode_resumes(
                workers, self._requests, self._estimator, now, self._tier_bounds
            )
        ]
        free = [w for w in workers if w.free]
        window, left, ranked, placements = self._rank_and_place(now, workers, free)
        self._planned = (left, len(window) == len(self._index))  # its keys: the window
        for worker in free:
            worker.reserved_for = None  # the preemption it was marked for is over
        placed = {req.request_id for req, _ in placements}
        commands += [self._place(req, worker, ranked, placed, now) for req, worker in placements]
        # Pack members started too: only what still waits may cause a preemption, find a slot
        # or need a wake-up (a preemption or a pause changes no waiting request's state).
        still_waiting = [r for r in ranked if r.waiting]
        if self.policy.preempts and still_waiting:  # (what choose_preemptions reads costs)
            for chosen in planner.choose_preemptions(
                still_waiting,
                workers,
                self._requests,
                self.policy,
                self._estimator,
                self._rules,
                now,
                self._worker_prefill_left(now),
            ):
                commands += self._preempt(chosen.victim, chosen.beneficiary, chosen.drop_state)
                if chosen.evict is not None:
                    commands.append(self._pause_decode(chosen.evict, True))
        commands += self._decode_pressure(still_waiting, workers, now)
        touched += self._index.sync(now, self._waits)  # what this decision started
        return commands + self._reconcile_timers([*window, *touched], left, now)

    def _rank_and_place(self, now: float, workers: list[WorkerSlot], free: list[WorkerSlot]):
        """The planning window (``waiting_index``), its predicted prefill left, its ranking,
        and the requests to start on the ``free`` workers. A free worker that could take a
        request from outside the window widens it to every waiting request."""
        pinned = [self._requests[rid] for w in free for rid in w.suspended]
        served = [w.reserved_for for w in workers if w.reserved_for and not w.free]
        per_free = max(1, self.config.max_pack_size)  # a pack's candidates for each free worker
        k = (
            None
            if self.config.plan_window is None
            else self.config.plan_window + per_free * len(free)
        )
        while True:
            window = self._index.window(now, k, pinned, served)
            left = planner.waiting_left(window, self._estimator, now)
            ranked = planner.rank_waiting(
                window, self.policy, self._estimator, self._rules, now, workers, left
            )
            placements = planner.place_on_free_workers(ranked, workers, self._requests)
            if k is None or len(window) == len(self._index):
                return window, left, ranked, placements
            used = {w.worker_id for _, w in placements}
            if not any(w.has_kv_slot and w.worker_id not in used for w in free):
                return window, left, ranked, placements
            k = None

    def _waits(self, req: Request) -> bool:
        """Whether ``req`` waits for a prefill (the waiting index's members): live, queued or
        suspended, and not a paused decode (those resume by ``decode_batch.decode_resumes``)."""
        live = self._requests.get(req.request_id) is req
        return live and req.waiting and not self._paused_decode(req)

    def _paused_decodes(self) -> list[Request]:
        """Decodes paused on their workers (waiting, yet outside the waiting index)."""
        held = (self._requests[rid] for w in self._workers.values() for rid in w.suspended)
        return [r for r in held if r.prefilled]

    def _paused_decode(self, req: Request) -> bool:
        if not (req.prefilled and req.state is RequestState.SUSPENDED):
            return False
        return req.worker_id in self._workers

    def _decode_pressure(self, still_waiting, workers, now: float) -> list[Command]:
        pauses = [
            self._pause_decode(victim, self.policy.drop_state)
            for victim in decode_batch.decode_pauses(
                workers,
                self._requests,
                self.policy,
                self._estimator,
                self._rules,
                now,
                self._tier_bounds,
            )
        ]
        drops = [
            self._pause_decode(victim, True)
            for victim in decode_batch.slot_evictions(
                still_waiting, workers, self._requests, self.policy, self._rules, now
            )
        ]
        return pauses + drops

    def _pause_decode(self, victim: Request, drop_state: bool) -> Command:
        assert victim.worker_id is not None
        victim.state = RequestState.PREEMPTING
        victim.preemptions += 1
        self._counters["decode_drops" if drop_state else "decode_pauses"] += 1
        return PauseDecode(victim.request_id, victim.worker_id, drop_state=drop_state)

    def _resume_decode(self, req: Request, worker: WorkerSlot, now: float) -> Command:
        del worker.suspended[req.request_id]
        worker.decoding[req.request_id] = None
        req.state = RequestState.DECODING
        req.progress_at_s = now
        self._counters["decode_resumes"] += 1
        return Resume(req.request_id, worker.worker_id)

    def _reconcile_timers(
        self, considered: list[Request], left: dict[str, float], now: float
    ) -> list[Command]:
        """Arm, move or disarm the wake-ups of the ``considered`` requests (the planning window
        and those whose state changed) so that the waiting requests that wait on a prediction
        have one, at the policy's latest start; in admission order."""
        by_id = {r.request_id: r for r in considered}
        waiting = [r for r in by_id.values() if r.request_id in self._index]
        new = [r for r in waiting if r.request_id not in left]
        left = {**left, **planner.waiting_left(new, self._estimator, now)}
        wanted = planner.wakeups(waiting, self.policy, self._estimator, now, left)
        commands: list[Command] = []
        for req in sorted(by_id.values(), key=lambda r: r.seq):
            rid, armed = req.request_id, self._timers.get(req.request_id)
            at = wanted.get(rid)
            if at is None and armed is not None:
                del self._timers[rid]
                commands.append(CancelTimer(rid))
            elif at is not None and (
                armed is None or abs(armed - at) > self.config.timer_resolution_s
            ):
                self._timers[rid] = at
                commands.append(SetTimer(rid, at))
        return commands

    def _place(
        self, req: Request, worker: WorkerSlot, ranked: list[Request], placed: set[str], now: float
    ) -> Command:
        """Start ``req`` on the free ``worker``: alone, with the requests it packs with, or, a
        member of a suspended pack, with the rest of that pack."""
        if req.state is RequestState.SUSPENDED and req.pack:
            siblings = packing.suspended_siblings(req, worker, self._requests)
            command = self._start(req, worker, now)
            for sibling in siblings:
                self._start(sibling, worker, now)
            packing.start([req, *siblings], worker)
            return command  # one Resume resumes the whole pack
        members = packing.choose_pack(
            req, worker, ranked, placed, self._pack_cost, self._estimator, self._pack_limits, now
        )
        if not members:
            return self._start(req, worker, now)
        pack = [req, *members]
        predicted = self._pack_cost.predict(sum(r.prompt_tokens for r in pack))
        for member in pack:
            member.predicted_prefill_s = predicted
            self._start(member, worker, now)
        packing.start(pack, worker)
        self._counters["packs"] += 1
        self._counters["packed_requests"] += len(pack)
        return AssignPacked(tuple(r.request_id for r in pack), worker.worker_id)

    def _start(self, req: Request, worker: WorkerSlot, now: float) -> Command:
        resume = req.state is RequestState.SUSPENDED
        if resume:
            del worker.suspended[req.request_id]
        req.state = RequestState.DECODING if req.prefilled else RequestState.RUNNING
        req.worker_id = worker.worker_id
        req.progress_at_s = now
        req.due = False
        worker.active = req.request_id
        self._index.touch(req)
        if resume:
            self._counters["resumes"] += 1
            return Resume(req.request_id, worker.worker_id)
        if req.predicted_prefill_s is None:
            req.predicted_prefill_s = self.predictor.predict(req.prompt_tokens)
        self._counters["assigns"] += 1
        return Assign(req.request_id, worker.worker_id)

    def _preempt(self, victim: Request, beneficiary: Request, drop_state: bool) -> list[Command]:
        """Preempt ``victim``'s prefill: with a pack, every member (one Preempt each: the first
        to arrive stops the pack; each is acknowledged on its own)."""
        assert victim.worker_id is not None
        worker = self._workers[victim.worker_id]
        worker.reserved_for = beneficiary.request_id
        self._counters["preemptions"] += 1
        commands: list[Command] = []
        for req in (victim, *packing.riders(worker, self._requests)):
            req.state = RequestState.PREEMPTING
            # Under a tier guard a preemption for a higher tier is not bounded: the guard
            # keeps the victim's turn when waiting would miss its own deadline (``policies``).
            guarded = self.policy.guards_tiers and beneficiary.tier.rank < req.tier.rank
            req.preemptions += 0 if guarded else 1
            commands.append(Preempt(req.request_id, worker.worker_id, drop_state))
        return commands

    def shed_reason(self, tier: str, now: float) -> str | None:
        """Why a new request of ``tier`` would be shed at ``now`` (None: it would not be).
        Admission asks before the request is queued, so that its client hears
        RESOURCE_EXHAUSTED instead of Queued; arrival applies the same rule again."""
        policy = self.tiers[tier] if tier in self.tiers else None  # noqa: SIM401 (get raises)
        return self._overload_reason(now) if policy is not None and policy.sheddable else None

    def _overload_reason(self, now: float) -> str | None:
        queued = sum(self._index.count(t.name) for t in self.tiers if t.sheddable)
        queued += sum(1 for r in self._paused_decodes() if r.tier.sheddable)
        limit = self.config.max_queued_sheddable
        if queued >= limit:
            return (
                f"overloaded: {queued} requests of sheddable tiers already waiting (limit {limit})"
            )
        # The prefill backlog per serving worker (decoding holds no worker's prefill).
        backlog_s = self._index.backlog_s()
        backlog_s += sum(left_s for _, left_s in self._prefill_work_left(now))
        wait = backlog_s / max(1, self._serving_workers())
        if wait > self.config.max_predicted_wait_s:
            return (
                f"overloaded: predicted wait {wait:.1f} s exceeds "
                f"{self.config.max_predicted_wait_s:.1f} s"
            )
        return None

    # ------------------------------------------------------------------ bookkeeping

    def _on_worker(self, request_id: str, worker_id: str) -> Request | None:
        """The request if ``worker_id`` holds it on its compute now; None for stale events."""
        req = self._requests.get(request_id)
        if req is None or req.worker_id != worker_id or req.state not in ON_WORKER:
            return None
        return req

    def _reject(self, request_id: str, reason: str, *, overload: bool = False) -> list[Command]:
        self._remember(request_id, RequestState.REJECTED)
        self._counters["rejected"] += 1
        return [Reject(request_id, reason, overload)]

    def _finish(self, req: Request, state: RequestState) -> None:
        req.state = state
        del self._requests[req.request_id]
        self._index.touch(req)
        keys = self._live_keys[req.tier.name]
        keys[req.key_id][0] -= 1
        if not keys[req.key_id][0]:
            del keys[req.key_id]
        self._remember(req.request_id, state)
        self._counters[state.value] += 1

    def _remember(self, request_id: str, state: RequestState) -> None:
        self._finished[request_id] = state

    # ------------------------------------------------------------------ read-only views

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(self._workers)

    def queue_depth(self) -> dict[str, int]:
        """Waiting requests (queued or suspended) per tier, every tier listed."""
        depth = dict.fromkeys(self.tiers.names, 0)
        for req in self._requests.values():
            if req.waiting:
                depth[req.tier.name] += 1
        return depth

    def running(self) -> dict[str, str | None]:
        """Worker -> the request on its compute (running, decoding or being preempted)."""
        return {wid: w.active for wid, w in self._workers.items()}

    def suspended(self) -> dict[str, tuple[str, ...]]:
        """Worker -> the requests whose suspended state it holds."""
        return {wid: tuple(w.suspended) for wid, w in self._workers.items()}

    def state_of(self, request_id: str) -> RequestState | None:
        """Current state; terminal states are remembered for ``remember_finished`` requests."""
        req = self._requests.get(request_id)
        if req is not None:
            return req.state
        return self._finished.get(request_id)

    def request(self, request_id: str) -> Request | None:
        """A copy of a live request's record (changing it does not change the scheduler)."""
        req = self._requests.get(request_id)
        return dataclasses.replace(req) if req is not None else None

    def live_requests(self) -> int:
        return len(self._requests)

    def switch_s(self) -> float:
        """The observed p95 time for a preemption to take effect."""
        return self._estimator.switch.p95()

    def tier_load(self, tier: str, now: float) -> TierLoad:
        """The tier's committed work here, for admission against its capacity
        (``capacity.judge``): the predicted prefill time left of its live requests, in all and
        per key, with every key that sent the tier a request in the last ``key_active_s``; and
        the share of the workers' time its prefills took lately."""
        weights = dict(self._keys.active(tier, now - self.config.key_active_s))
        weights.update((key, held[1]) for key, held in self._live_keys[tier].items())
        by_key = dict.fromkeys(weights, 0.0)
        running = dict.fromkeys(weights, 0.0)
        for key, waiting_s in self._index.committed_s(tier).items():
            by_key[key] += waiting_s
        for r, left_s in self._prefill_work_left(now):
            if r.tier.name == tier:
                by_key[r.key_id] += left_s
                if r.state is RequestState.RUNNING:
                    running[r.key_id] += left_s
        over = {k: self._keys.over_share(tier, k) for k in by_key}
        virtual = self._keys.virtual(tier, self._fair_peers(tier, now))
        policy = self.tiers[tier]
        lead = {
            k: self._keys.lead_s(
                tier, k, by_key[k], virtual, self._burst_credit_s(policy, k, over[k])
            )
            for k in by_key
        }
        workers = self._serving_workers()
        return TierLoad(
            tier=tier,
            workers=workers,
            committed_s=sum(by_key.values()),
            keys=tuple(
                KeyLoad(
                    k,
                    weights[k],
                    by_key[k],
                    self.admission_errors.error_s(tier, k, within_share=not over[k]),
                    running[k],
                    over[k],
                    lead[k],
                )
                for k in sorted(by_key)
            ),
            error_s=self.admission_errors.error_s(tier),
            switch_s=self.switch_s(),
            margin=self._admission_margin(tier),
            coefficients=self.predictor.coefficients,
            calibrated=self.predictor.calibrated,
            reference_coefficients=self.predictor.reference_coefficients,
            busy_share=min(1.0, self._served.rate(tier, "", now) / workers) if workers else 0.0,
        )

    def planned(self) -> tuple[frozenset[str], bool]:
        """The waiting requests the last decision planned over (its window, ``waiting_index``),
        and whether they were every waiting request."""
        return frozenset(self._planned[0]), self._planned[1]

    def timers(self) -> dict[str, float]:
        """Request id -> the wake-up armed for it."""
        return dict(self._timers)

    @property
    def counters(self) -> dict[str, int]:
        """Events seen by type, and assigns, resumes, preemptions, restarts, rejections, ..."""
        return dict(self._counters)
