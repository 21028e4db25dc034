"""Scheduling policies: the order of waiting requests and when to preempt a running one.

A policy is pure rules over one request at a time; the scheduler owns the state, the clock,
the workers and the safety rules common to all policies (preemption bound, aging, shedding).

Each policy also says what the engine must do for it, so a benchmark configures the same
engine per policy from the policy object alone:
  ``engine_check``  where the engine polls the preemption flag: "block" (between row blocks
                    that each fit the worker's preemption budget, ``worker.row_blocks``),
                    "layer" (every layer boundary), "half" (also between a layer's attention
                    and MLP), "chunk" (only at chunk ends), "none" (never: runs to completion)
  ``engine_chunk_size``  the chunk size it runs at best (None: the worker's default); the
                    chunked baseline's C=512, as vLLM and SGLang chunk
  ``preempts``      whether the policy ever issues Preempt
  ``drop_state``    whether its Preempt asks the worker to drop the KV state (recompute later)

Policies (docs/design.md, "Scheduling"):
  fifo         arrival order, never preempts
  priority     strict tier rank, then arrival; never preempts
  chunked      tier order; preempts on any strictly higher waiting tier; the engine switches at
               the next chunk boundary (vLLM/Sarathi-style); state kept
  recompute    tier order; preempts on any strictly higher waiting tier, dropping the state
               (SGLang/vLLM recompute-style); the engine stops at the next row block (its
               best setting: the stop is as quick as flowprefill's, only the state is lost)
  flowprefill  EDF over deadlines, late work re-deadlined within its tier, and a tier guard
               (see ``FlowPrefill``); preempts a lower tier's prefill that can spare the time,
               or, when a waiting request outranks the running one, if it would miss its SLO
               by waiting (predictions inflated by the predictor's observed error), or is
               late already, or its wake-up fired; the engine stops at the next row block,
               within the preemption budget; state kept. A request that waits on a prediction
               gets a wake-up at the last moment a preemption still saves it
               (``latest_start_s``).

Ablations (``ABLATIONS``, benchmarks only: `tierflow bench --ablations`), each flowprefill or a
baseline with one part swapped, so that each part of the gain shows on the same arrivals:
  flowprefill-chunk      flowprefill's order and trigger, stopping only at chunk ends (C of the
                         chunked baseline)
  priority-layer         tier order with preemption on any higher waiting tier (chunked's
                         rules), stopping at the next layer, state kept
  flowprefill-recompute  flowprefill, dropping the victim's state (recomputed when it resumes)
  flowprefill-layer      flowprefill, stopping at layer boundaries only (its interruption
                         points bounded by the model's structure, not by time)
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from queue_service.scheduler.request import Request

EngineCheck = Literal["block", "half", "layer", "chunk", "none"]
SortKey = tuple[float, ...]


def slack_s(req: Request, now: float, remaining_s: float) -> float:
    """Seconds to spare before the TTFT deadline if the rest of the prefill ran from now."""
    return req.deadline_s - now - remaining_s


def misses_behind(
    req: Request, now: float, ahead_s: float, remaining_s: float, margin: float, switch_s: float
) -> bool:
    """Whether ``req`` misses its deadline when it starts after ``ahead_s`` of other work, with
    predicted times inflated by the predictor's error ``margin``."""
    return now + (ahead_s + remaining_s) * (1 + margin) + switch_s > req.deadline_s


@dataclass(frozen=True)
class Outlook:
    """What the planner predicts for one waiting request against one running request."""

    waiting_remaining_s: float  # predicted prefill left of the waiting request
    running_remaining_s: float  # predicted prefill left of the running request
    wait_s: float  # predicted time until the waiting one starts if nothing is preempted
    margin: float = 0.0  # relative error to allow on predicted times (predictor's p95)
    due: bool = False  # the waiting request's wake-up fired: predictions failed it once
    switch_s: float = 0.0  # observed time for a preemption to take effect (p95)


class SchedulingPolicy(ABC):
    name: ClassVar[str]
    engine_check: ClassVar[EngineCheck]
    engine_chunk_size: ClassVar[int | None] = None
    preempts: ClassVar[bool] = False
    drop_state: ClassVar[bool] = False
    # After this many preemptions a request runs to completion (``SchedulerConfig`` may set
    # another bound). A preemption that keeps the state costs its victim one interruption
    # point (at most the preemption budget, 25 ms) and no work, so the bound only stops a
    # preempt/resume loop. Under a tier guard (``guards_tiers``) a preemption for a higher
    # tier is not counted at all: the guard protects the victim's own deadline. A count did
    # not: a batch prompt under the 3x critical flood of `tierflow bench --flood` reached 32
    # and then prefilled for 1.7 s with critical requests waiting behind it.
    max_preemptions: ClassVar[int] = 32
    # Whether the planner applies ``guarded`` on top of ``key`` (the tier guard).
    guards_tiers: ClassVar[bool] = False
    # Whether the policy's own rules read TTFT deadlines (so a different SLO changes what it
    # does, not only how its results are judged).
    reads_deadlines: ClassVar[bool] = False

    @abstractmethod
    def key(self, req: Request, now: float, remaining_s: float) -> SortKey:
        """Sort key of a waiting request, smallest first; ``remaining_s``: predicted prefill left.

        Keys end with the admission sequence number so that the order is total and repeatable.
        """

    def order_key(self, req: Request, remaining_s: float) -> SortKey:
        """A key that orders the waiting requests of one tier, all on time or all late, as
        ``key`` orders them at any ``now`` (the scheduler's ``waiting_index`` keeps them sorted
        by it). Never asked of a request past its first token. The default suits a ``key``
        that does not read ``now``."""
        return self.key(req, 0.0, remaining_s)

    def should_preempt(
        self, waiting: Request, running: Request, now: float, outlook: Outlook
    ) -> bool:
        """Whether ``waiting`` justifies preempting ``running``.

        The scheduler has already excluded running requests that may not be preempted, and
        the prefills of a tier above the waiting request's: no policy lets a lower tier stop
        a higher tier's prefill (``planner._pick_victim``).
        """
        return False

    def latest_start_s(
        self, req: Request, now: float, remaining_s: float, margin: float, switch_s: float
    ) -> float | None:
        """When a waiting request must be reconsidered at the latest (a wake-up), or None."""
        return None

    def guarded(
        self,
        req: Request,
        now: float,
        ahead_s: float,
        remaining_s: float,
        margin: float,
        switch_s: float,
    ) -> bool:
        """Whether ``req`` misses its deadline behind ``ahead_s`` of work while it could still
        make it: it must go before lower-tier work, whatever that work's needs. Only if
        ``guards_tiers``."""
        return False

    def holds_off(
        self,
        lower: Request,
        now: float,
        lower_left_s: float,
        higher_left_s: float,
        margin: float,
        switch_s: float,
    ) -> bool:
        """Whether lower-tier ``lower`` keeps its place before a higher-tier request that
        ``key`` ranks after it. Only if ``guards_tiers``."""
        return True

    def on_time(self, req: Request, now: float, remaining_s: float, switch_s: float) -> bool:
        """Whether ``req`` can still make its deadline if it started now."""
        return slack_s(req, now + switch_s, remaining_s) >= 0

    def victim_key(
        self, running: Request, now: float, remaining_s: float, delay_s: float
    ) -> SortKey:
        """Among eligible victims the smallest key is preempted: the one that loses least.

        ``delay_s``: roughly how long the victim will be held off (the newcomer's prefill).
        Default: lowest tier, then most slack (a decoding request has its first token already,
        so its TTFT cannot suffer), then least work done, then the newest.
        """
        slack = math.inf if running.prefilled else slack_s(running, now, remaining_s)
        return (-running.tier.rank, -slack, running.tokens_done, -running.seq)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Fifo(SchedulingPolicy):
    name = "fifo"
    engine_check = "none"

    def key(self, req: Request, now: float, remaining_s: float) -> SortKey:
        return (req.arrival_s, req.seq)


class Priority(SchedulingPolicy):
    name = "priority"
    engine_check = "none"

    def key(self, req: Request, now: float, remaining_s: float) -> SortKey:
        return (req.tier.rank, req.arrival_s, req.seq)


CHUNKED_C = 512  # the chunked baseline's chunk size


class Chunked(Priority):
    name = "chunked"
    engine_check = "chunk"
    engine_chunk_size = CHUNKED_C
    preempts = True

    def should_preempt(
        self, waiting: Request, running: Request, now: float, outlook: Outlook
    ) -> bool:
        return waiting.tier.rank < running.tier.rank


class Recompute(Chunked):
    name = "recompute"
    engine_check = "block"
    drop_state = True
    max_preemptions = 8  # each preemption throws the victim's work away

    def victim_key(
        self, running: Request, now: float, remaining_s: float, delay_s: float
    ) -> SortKey:
        # The victim's computed tokens are thrown away: least work lost matters before slack.
        done = running.prompt_tokens if running.prefilled else running.tokens_done
        slack = math.inf if running.prefilled else slack_s(running, now, remaining_s)
        return (-running.tier.rank, done, -slack, -running.seq)


class FlowPrefill(SchedulingPolicy):
    """Deadline order that keeps tiers under overload, preempting only when it saves a deadline.

    Order (``key``): a request that can still make its TTFT deadline ranks by that deadline
    (EDF). A late one (predicted to miss it) is re-deadlined one SLO of its own tier from now:
    it goes after every on-time request of its tier (those can still be saved), but a late
    critical request (now + 0.3 s) still goes before batch work due in minutes, and a late
    standard request (now + 3 s) never before a critical request that can make its deadline.
    A decoding request (first token out) keeps its tier's urgency the same way.

    Tier guard (``holds_off``, ``guarded``): a request that can still make its deadline goes
    before lower-tier work that EDF ranks first, and preempts it if it runs, unless that work
    would miss its own deadline by waiting for it (then it keeps its turn) and the request can
    afford to wait (else it goes first anyway). Stopping a prefill costs it one row block and no
    work, while waiting on a prediction loses the deadline whenever the prediction is wrong.
    Lower tiers never preempt a higher tier's prefill, so the two rules cannot undo each other.

    Preemption (``should_preempt``): by the tier guard; otherwise only of a request ranked
    behind the waiting one, when the waiting request would miss its deadline by waiting, with
    predictions inflated by the predictor's observed error margin; when it is late already
    (waiting only adds to its TTFT) and the running request is of a lower tier; or when its
    wake-up fired (it waited on a prediction that turned out wrong).

    ``switch_s``: the least time assumed for a preemption to take effect; the scheduler
    passes the observed p95 (about the preemption budget) when that is longer.
    """

    name = "flowprefill"
    engine_check = "block"
    preempts = True
    guards_tiers = True
    reads_deadlines = True

    def __init__(self, switch_s: float = 0.0) -> None:
        if not switch_s >= 0:
            raise ValueError(f"switch_s must be >= 0, got {switch_s!r}")
        self.switch_s = switch_s

    def key(self, req: Request, now: float, remaining_s: float) -> SortKey:
        if req.prefilled:
            # Ties go to the newcomer: a decoding request yields to a prefill due as soon.
            return (now + req.tier.ttft_slo_s, math.inf, math.inf)
        if slack_s(req, now, remaining_s) >= 0:
            return (req.deadline_s, req.deadline_s, req.seq)
        return (now + req.tier.ttft_slo_s, req.deadline_s, req.seq)

    def order_key(self, req: Request, remaining_s: float) -> SortKey:
        # On time: (deadline, deadline, seq); late: (now + SLO, deadline, seq), the same SLO
        # for the whole tier. Either way, within a tier, by deadline.
        return (req.deadline_s, req.seq)

    def should_preempt(
        self, waiting: Request, running: Request, now: float, outlook: Outlook
    ) -> bool:
        if waiting.prefilled:
            return False  # its TTFT is behind it: no deadline to save
        if waiting.tier.rank > running.tier.rank and not running.prefilled:
            return False  # lower tiers never stop a higher tier's prefill
        switch = max(self.switch_s, outlook.switch_s)
        wait_left, run_left = outlook.waiting_remaining_s, outlook.running_remaining_s
        on_time = slack_s(waiting, now + switch, wait_left) >= 0
        if on_time and waiting.tier.rank < running.tier.rank and not running.prefilled:
            # The tier guard, whatever the deadlines' order (the same rule as the ranking).
            return not self.holds_off(
                running, now, run_left, wait_left, outlook.margin, switch
            ) or self.guarded(waiting, now, outlook.wait_s, wait_left, outlook.margin, switch)
        # Same order as the queue: a request preempted for another must not rank first again
        # once the worker is free (that would be a preempt/resume loop).
        if not self.key(waiting, now, wait_left) < self.key(running, now, run_left):
            return False
        if outlook.due:
            return True
        if not on_time:
            # Late: it may stop lower-tier work (waiting only adds to its TTFT), but not work
            # of its own tier or above, which is on time or, late too, due no later.
            return running.tier.rank > waiting.tier.rank and outlook.wait_s > switch
        return misses_behind(waiting, now, outlook.wait_s, wait_left, outlook.margin, switch)

    def holds_off(
        self,
        lower: Request,
        now: float,
        lower_left_s: float,
        higher_left_s: float,
        margin: float,
        switch_s: float,
    ) -> bool:
        """Whether lower-tier prefill ``lower``, on time now, would miss its deadline if held
        off for a higher-tier prefill of ``higher_left_s`` (inflated by the margin) and two
        switches: then, and only then, it keeps its turn before that request."""
        if lower.prefilled:
            return False
        held = higher_left_s * (1 + margin) + 2 * max(self.switch_s, switch_s)
        return slack_s(lower, now, lower_left_s) >= 0 > slack_s(lower, now + held, lower_left_s)

    def guarded(
        self,
        req: Request,
        now: float,
        ahead_s: float,
        remaining_s: float,
        margin: float,
        switch_s: float,
    ) -> bool:
        if req.prefilled or not self.on_time(req, now, remaining_s, switch_s):
            return False  # late: the late-work rule of ``key`` decides
        if req.due:
            return True  # its wake-up fired: the prediction it waited on was wrong
        switch = max(self.switch_s, switch_s)
        return misses_behind(req, now, ahead_s, remaining_s, margin, switch)

    def on_time(self, req: Request, now: float, remaining_s: float, switch_s: float) -> bool:
        return slack_s(req, now + max(self.switch_s, switch_s), remaining_s) >= 0

    def latest_start_s(
        self, req: Request, now: float, remaining_s: float, margin: float, switch_s: float
    ) -> float | None:
        if req.prefilled:
            return None
        switch = max(self.switch_s, switch_s)
        latest = req.deadline_s - remaining_s * (1 + margin) - switch
        return latest if latest > now else None  # late already: nothing left to wait for

    def victim_key(
        self, running: Request, now: float, remaining_s: float, delay_s: float
    ) -> SortKey:
        # Prefer a victim that does not lose its own deadline: one that misses anyway, one that
        # is decoding, or one with enough slack to absorb the delay.
        slack = math.inf if running.prefilled else slack_s(running, now, remaining_s)
        loses = 0.0 <= slack < delay_s
        return (float(loses), -slack, -running.tier.rank, running.tokens_done, -running.seq)

    def __repr__(self) -> str:
        return f"FlowPrefill(switch_s={self.switch_s})"


POLICIES: dict[str, type[SchedulingPolicy]] = {
    cls.name: cls for cls in (Fifo, Priority, Chunked, Recompute, FlowPrefill)
}


class FlowPrefillChunkStops(FlowPrefill):
    name = "flowprefill-chunk"
    engine_check = "chunk"
    engine_chunk_size = CHUNKED_C


class PriorityLayerStops(Chunked):
    name = "priority-layer"
    engine_check = "layer"


class FlowPrefillRecompute(FlowPrefill):
    name = "flowprefill-recompute"
    drop_state = True
    max_preemptions = 8  # as recompute: each preemption throws the victim's work away


class FlowPrefillLayerStops(FlowPrefill):
    name = "flowprefill-layer"
    engine_check = "layer"


ABLATIONS: dict[str, type[SchedulingPolicy]] = {
    cls.name: cls
    for cls in (
        FlowPrefillChunkStops,
        PriorityLayerStops,
        FlowPrefillRecompute,
        FlowPrefillLayerStops,
    )
}


def make_policy(name: str, **options: Any) -> SchedulingPolicy:
    """The policy called ``name``; ``options`` go to its constructor (flowprefill: switch_s)."""
    try:
        cls = {**POLICIES, **ABLATIONS}[name]
    except KeyError:
        raise ValueError(
            f"unknown scheduling policy {name!r}; choose one of: {', '.join(POLICIES)} "
            f"(ablations: {', '.join(ABLATIONS)})"
        ) from None
    try:
        return cls(**options)
    except TypeError:
        raise ValueError(f"policy {name!r} does not take options {sorted(options)}") from None
