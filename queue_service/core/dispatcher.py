"""The one path between the scheduler and the workers, used by the queue service and the benchmark.

The scheduler (``queue_service.scheduler``) decides; this applies its decisions. Every worker is
reached through a ``WorkerHandle``: the queue service's proxy for a remote worker sends control
messages on its stream (``queue_service.workers.api``), the benchmark's handle drives an
in-process engine runner (``bench.harness``). Both hand what their worker reports back as
scheduler events to ``Dispatcher.handle``, so the benchmark measures the code path the service
runs, and the rules of the protocol live here once:

- Assign / Resume / Preempt / Cancel go to the handle of the worker they name. An Assign of a
  request the worker has seen before means "recompute from token 0" (its state was dropped);
  handles implement ``assign`` that way.
- Workers (each joined with its ``kv_slots``) also get AssignPacked (several prompts
  prefilled in one forward; a Preempt or Resume of any member applies to the whole pack) and
  PauseDecode (a decoding request leaves the batch between steps, acknowledged like a Preempt;
  Resume puts it back). What they report includes one ``DecodeStepDone`` per decode step.
- SetTimer / CancelTimer arm and disarm the request's one wake-up on a ``Timers`` service; when
  it is due, the owner calls ``Dispatcher.fire_timer`` (a stale one is ignored by the scheduler).
- Reject goes to the owner (``on_reject``), which answers the client.
- A worker that is shutting down says so (``worker_draining``); the scheduler then sends it
  nothing new but Drain, and it leaves (``worker_left``) once it holds nothing.

The dispatcher owns no thread and no I/O of its own: it is called on the owner's loop, one call
at a time, like the scheduler it wraps. It also keeps the cost of deciding (seconds spent in
``Scheduler.handle``), which the benchmark reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from queue_service.scheduler import (
    Assign,
    AssignPacked,
    Cancel,
    CancelTimer,
    Command,
    Drain,
    Event,
    PauseDecode,
    Preempt,
    Reject,
    Resume,
    Scheduler,
    SetTimer,
    TimerFired,
    WorkerDraining,
    WorkerJoined,
    WorkerLeft,
)


class WorkerHandle(Protocol):
    """One worker, as the scheduler's commands reach it."""

    def assign(self, request_id: str) -> None:
        """Start the request from token 0 (a request seen before: recompute it)."""

    def assign_packed(self, request_ids: tuple[str, ...]) -> None:
        """Batched workers: prefill these requests together in one forward."""

    def pause_decode(self, request_id: str, drop_state: bool) -> None:
        """Batched workers: take a decoding request out of the batch between two steps."""

    def resume(self, request_id: str) -> None:
        """Continue the request from the state this worker holds."""

    def preempt(self, request_id: str, drop_state: bool) -> None:
        """Stop the request at the engine's next checked boundary."""

    def cancel(self, request_id: str) -> None:
        """Stop the request, running or suspended, and free what it holds."""

    def drain(self) -> None:
        """No new request follows: the worker leaves once it holds nothing."""


class Timers(Protocol):
    """Wake-ups on the owner's clock: at ``at_s`` the owner calls ``Dispatcher.fire_timer``."""

    def set(self, request_id: str, at_s: float) -> None:
        """Arm the request's one timer, replacing an armed one."""

    def cancel(self, request_id: str) -> None:
        """Disarm it; a timer that is not armed (or fired already) is no error."""


@dataclass
class DispatchStats:
    events: int = 0
    decide_s: float = 0.0  # time spent in Scheduler.handle
    commands: int = 0


class Dispatcher:
    def __init__(
        self,
        scheduler: Scheduler,
        timers: Timers,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_reject: Callable[[Reject], None] = lambda reject: None,
        on_start: Callable[[str, str, bool], None] = lambda rid, wid, resumed: None,
    ) -> None:
        self.scheduler = scheduler
        self.timers = timers
        self.clock = clock
        self.on_reject = on_reject
        # (request id, worker id, resumed) before the command goes out: the owner's records.
        self.on_start = on_start
        self.handles: dict[str, WorkerHandle] = {}
        self.stats = DispatchStats()

    # ------------------------------------------------------------------ events in

    def handle(self, event: Event) -> None:
        """Hand one event to the scheduler and carry out what it decides."""
        started = time.perf_counter()
        commands = self.scheduler.handle(event, self.clock())
        self.stats.decide_s += time.perf_counter() - started
        self.stats.events += 1
        self.apply(commands)

    def worker_joined(
        self, worker_id: str, handle: WorkerHandle, kv_slots: int, interruption_s: float = 0.0
    ) -> None:
        """A worker with ``kv_slots`` KV slots (>= 1; its decode batch does not hold its
        prefill) that stops a prefill within ``interruption_s`` (0: not bounded in time)."""
        self.handles[worker_id] = handle
        self.handle(WorkerJoined(worker_id, kv_slots, interruption_s))

    def worker_left(self, worker_id: str) -> None:
        """The worker and every state it held are gone; its requests are placed again."""
        if self.handles.pop(worker_id, None) is not None:
            self.handle(WorkerLeft(worker_id))

    def worker_draining(self, worker_id: str) -> None:
        """The worker is shutting down: it finishes what it holds and gets nothing new."""
        if worker_id in self.handles:
            self.handle(WorkerDraining(worker_id))

    def fire_timer(self, request_id: str) -> None:
        self.handle(TimerFired(request_id))

    # ------------------------------------------------------------------ commands out

    def apply(self, commands: Iterable[Command]) -> None:
        for command in commands:
            self.stats.commands += 1
            self._apply_one(command)

    def _apply_one(self, command: Command) -> None:
        match command:
            case SetTimer(request_id=rid, at_s=at_s):
                self.timers.set(rid, at_s)
            case CancelTimer(request_id=rid):
                self.timers.cancel(rid)
            case Reject():
                self.on_reject(command)
            case Assign(request_id=rid, worker_id=wid):
                self.on_start(rid, wid, False)
                self.handles[wid].assign(rid)
            case AssignPacked(request_ids=rids, worker_id=wid):
                for rid in rids:
                    self.on_start(rid, wid, False)
                self.handles[wid].assign_packed(rids)
            case PauseDecode(request_id=rid, worker_id=wid, drop_state=drop):
                self.handles[wid].pause_decode(rid, drop)
            case Resume(request_id=rid, worker_id=wid):
                self.on_start(rid, wid, True)
                self.handles[wid].resume(rid)
            case Preempt(request_id=rid, worker_id=wid, drop_state=drop):
                self.handles[wid].preempt(rid, drop)
            case Cancel(request_id=rid, worker_id=wid):
                self.handles[wid].cancel(rid)
            case Drain(worker_id=wid):
                self.handles[wid].drain()
            case _:
                raise TypeError(f"not a scheduler command: {command!r}")
