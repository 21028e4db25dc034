"""Scheduling policies: the order of waiting requests and when to preempt a running one.

A policy is pure rules over one request at a time; the scheduler owns the state, the clock,
the workers and the safety rules common to all policies (preemption bound, aging, shedding).

Each policy also says what the engine must do for it, so a benchmark configures the same
engine per policy from the policy object alone:
  ``engine_check``  where the engine polls the preemption flag: "layer" (every layer
                    boundary), "chunk" (only at chunk ends), "none" (never: runs to completion)
  ``preempts``      whether the policy ever issues Preempt
  ``drop_state``    whether its Preempt asks the worker to drop the KV state (recompute later)

Policies (DESIGN.md, "Baseline policies"):
  fifo         arrival order, never preempts
  priority     strict tier rank, then arrival; never preempts
  chunked      tier order; preempts on any strictly higher waiting tier; the engine switches at
               the next chunk boundary (vLLM/Sarathi-style); state kept
  recompute    tier order; preempts on any strictly higher waiting tier, dropping the state
               (SGLang/vLLM recompute-style); the engine stops at the next layer
  flowprefill  slack-aware EDF; preempts only when a waiting request outranks the running one
               AND would miss its SLO by waiting AND can still make it if started now; the
               engine stops at the next layer; state kept
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal

from queue_service.scheduler.request import Request

EngineCheck = Literal["layer", "chunk", "none"]
SortKey = tuple[float, ...]


def slack_s(req: Request, now: float, remaining_s: float) -> float:
    """Seconds to spare before the TTFT deadline if the rest of the prefill ran from now."""
    return req.deadline_s - now - remaining_s


class SchedulingPolicy(ABC):
    name: ClassVar[str]
    engine_check: ClassVar[EngineCheck]
    preempts: ClassVar[bool] = False
    drop_state: ClassVar[bool] = False

    @abstractmethod
    def key(self, req: Request, now: float, remaining_s: float) -> SortKey:
        """Sort key of a waiting request, smallest first; ``remaining_s``: predicted prefill left.

        Keys end with the admission sequence number so that the order is total and repeatable.
        """

    def should_preempt(
        self,
        waiting: Request,
        running: Request,
        now: float,
        *,
        waiting_remaining_s: float,
        running_remaining_s: float,
        wait_s: float,
    ) -> bool:
        """Whether ``waiting`` justifies preempting ``running``.

        ``wait_s``: predicted time until ``waiting`` would start if nothing were preempted.
        The scheduler has already excluded running requests that may not be preempted.
        """
        return False

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


class Chunked(Priority):
    name = "chunked"
    engine_check = "chunk"
    preempts = True

    def should_preempt(
        self,
        waiting: Request,
        running: Request,
        now: float,
        *,
        waiting_remaining_s: float,
        running_remaining_s: float,
        wait_s: float,
    ) -> bool:
        return waiting.tier.rank < running.tier.rank


class Recompute(Chunked):
    name = "recompute"
    engine_check = "layer"
    drop_state = True

    def victim_key(
        self, running: Request, now: float, remaining_s: float, delay_s: float
    ) -> SortKey:
        # The victim's computed tokens are thrown away: least work lost matters before slack.
        done = running.prompt_tokens if running.prefilled else running.tokens_done
        slack = math.inf if running.prefilled else slack_s(running, now, remaining_s)
        return (-running.tier.rank, done, -slack, -running.seq)


class FlowPrefill(SchedulingPolicy):
    """Slack-aware EDF with preemption only when it saves a deadline.

    ``switch_s``: expected time for a preemption to take effect (about one layer); a newcomer
    that could not make its deadline even after that is not worth a preemption.
    """

    name = "flowprefill"
    engine_check = "layer"
    preempts = True

    def __init__(
        self, switch_s: float = 0.0, wait_margin: float = 0.2, late_grace: float = 1.0
    ) -> None:
        if not switch_s >= 0:
            raise ValueError(f"switch_s must be >= 0, got {switch_s!r}")
        if not 0 <= wait_margin < 1:
            raise ValueError(f"wait_margin must be in [0, 1), got {wait_margin!r}")
        self.switch_s = switch_s
        # A request only waits (instead of preempting) when it is predicted to be done
        # within (1 - wait_margin) of its SLO: predictions err, and more urgent arrivals may
        # cut in while it waits. The spare part of the SLO absorbs that.
        self.wait_margin = wait_margin
        if not late_grace >= 0:
            raise ValueError(f"late_grace must be >= 0, got {late_grace!r}")
        # Only a request that will be late by more than late_grace x its SLO counts as hopeless
        # and goes behind the others: one that misses by a few milliseconds still goes first
        # (behind a batch document, "will miss anyway" would turn 20 ms late into seconds).
        self.late_grace = late_grace

    def key(self, req: Request, now: float, remaining_s: float) -> SortKey:
        # Requests that can still make their deadline go first, earliest deadline first; those
        # that will miss it by far go after them, still in deadline order, and still complete.
        if req.prefilled:
            # Decoding (its first token is out): it yields to any request whose TTFT deadline
            # falls within one of its own tier's SLOs from now (ties go to the newcomer), but
            # not to lower-tier work with time to spare, such as a fresh batch document.
            return (0.0, now + req.tier.ttft_slo_s, math.inf)
        hopeless = slack_s(req, now, remaining_s) < -self.late_grace * req.tier.ttft_slo_s
        return (float(hopeless), req.deadline_s, req.seq)

    def should_preempt(
        self,
        waiting: Request,
        running: Request,
        now: float,
        *,
        waiting_remaining_s: float,
        running_remaining_s: float,
        wait_s: float,
    ) -> bool:
        if waiting.prefilled:
            return False  # its TTFT is behind it: no deadline to save
        if slack_s(waiting, now + self.switch_s, waiting_remaining_s) < 0:
            return False  # misses even if started now: preempting would not help
        margin = self.wait_margin * waiting.tier.ttft_slo_s
        if now + wait_s + waiting_remaining_s <= waiting.deadline_s - margin:
            return False  # makes its SLO by waiting, with margin: never preempt for it
        # Same order as the queue: a request preempted for another must not rank first again
        # once the worker is free (that would be a preempt/resume loop).
        return self.key(waiting, now, waiting_remaining_s) < self.key(
            running, now, running_remaining_s
        )

    def victim_key(
        self, running: Request, now: float, remaining_s: float, delay_s: float
    ) -> SortKey:
        # Prefer a victim that does not lose its own deadline: one that misses anyway, one that
        # is decoding, or one with enough slack to absorb the delay.
        slack = math.inf if running.prefilled else slack_s(running, now, remaining_s)
        loses = 0.0 <= slack < delay_s
        return (float(loses), -slack, -running.tier.rank, running.tokens_done, -running.seq)

    def __repr__(self) -> str:
        return (
            f"FlowPrefill(switch_s={self.switch_s}, wait_margin={self.wait_margin}, "
            f"late_grace={self.late_grace})"
        )


POLICIES: dict[str, type[SchedulingPolicy]] = {
    cls.name: cls for cls in (Fifo, Priority, Chunked, Recompute, FlowPrefill)
}


def make_policy(name: str, **options: Any) -> SchedulingPolicy:
    """The policy called ``name``; ``options`` go to its constructor (flowprefill: switch_s)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown scheduling policy {name!r}; choose one of: {', '.join(POLICIES)}"
        ) from None
    try:
        return cls(**options)
    except TypeError:
        raise ValueError(f"policy {name!r} does not take options {sorted(options)}") from None
