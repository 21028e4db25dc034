"""One policy, one workload, in one process: the real scheduler driving real engine threads.

The main thread is the scheduler's event loop, and it runs the queue service's own dispatch
path (``queue_service.core.dispatcher``): each engine runner is a ``WorkerHandle`` and what it
reports goes back as scheduler events. The loop blocks on one queue that the runners fill,
with a timeout that expires exactly when the next arrival or wake-up is due, so it wakes only
on events (arrival, progress, first token, preemption acknowledged, done, wake-up) and never
polls. A Preempt raises the engine's preemption channel from this thread.

Times: arrivals are replayed on the wall clock (``time.perf_counter``) and each one arrives at
its scheduled time (a late wake of this loop does not move its deadline); TTFT is the
first-token timestamp taken on the engine thread minus that time.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from bench.cpu_steal import steal_share
from bench.event_log import EventLog
from bench.workload import Arrival, Workload, prompt_ids
from queue_service.core.capacity_board import CapacityBoard, PublishedLoad
from queue_service.core.dispatcher import Dispatcher
from queue_service.scheduler import (
    DecodeStepDone,
    Event,
    PreemptionAcked,
    PrefillFinished,
    PrefillProgress,
    Reject,
    RequestArrived,
    RequestDone,
    Scheduler,
)
from tierflow.heap import frozen_heap
from worker import events as runner_events
from worker.batch_engine import BatchEngine
from worker.batch_runner import BatchRunner
from worker.events import (
    DecodeRejoined,
    Failed,
    Finished,
    FirstToken,
    Preempted,
    Progress,
    RunnerEvent,
)
from worker.request import GenerationRequest


@dataclass
class RequestRecord:
    arrival: Arrival
    arrived_at: float = 0.0  # wall clock (perf_counter)
    first_token_at: float | None = None
    done_at: float | None = None
    rejected: str | None = None
    served_tier: str | None = None  # the tier admission put it at (None: rejected there)
    failed: str | None = None
    preemptions: int = 0
    recomputes: int = 0
    busy_s: float = 0.0
    first_token: int | None = None
    token_times: list[float] = field(default_factory=list)  # every token's engine timestamp

    def token(self, index: int, at: float) -> None:
        """The ``index``-th output token came out at ``at``; one produced again (a recompute
        from token 0) is not counted twice."""
        if index == len(self.token_times):
            self.token_times.append(at)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrived_at

    @property
    def tbt_s(self) -> list[float]:
        """Times between consecutive tokens."""
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]


@dataclass
class RunResult:
    policy: str
    records: dict[str, RequestRecord]
    preemption_latencies_s: list[float] = field(default_factory=list)
    busy_s: float = 0.0
    makespan_s: float = 0.0
    decide_s: float = 0.0  # time spent in Scheduler.handle
    events: int = 0  # events handed to the scheduler
    progress_events: int = 0
    prediction_errors: dict = field(default_factory=dict)  # PredictionErrors.summary()
    admission_errors: dict = field(default_factory=dict)  # AdmissionErrors.summary()
    decode_steps: int = 0  # batched workers: decode steps, and rows over all of them
    decode_rows: int = 0
    slotted_steps: int = 0  # of them, run at a layer boundary of a prefill
    decode_step_s: list[float] = field(default_factory=list)  # each step's time
    counters: dict = field(default_factory=dict)  # the scheduler's (packs, pauses, ...)
    # The share of the machine's CPU time its hypervisor gave to others during the run (steal):
    # on a shared virtual machine it slows every policy's engine, unevenly over time.
    cpu_steal: float = 0.0
    # Requests that never finished: the run stopped after idling with them (``stop_when_idle``).
    stuck: list[dict] = field(default_factory=list)


class InProcessWorker:
    """A ``WorkerHandle`` over an engine runner in this process; each command is logged to
    ``log`` when one is given (``bench.event_log``)."""

    def __init__(
        self,
        runner: BatchRunner,
        request_for: Callable[[str], GenerationRequest],
        tbt_for: Callable[[str], float | None] = lambda request_id: None,
        log: EventLog | None = None,
    ):
        self.runner = runner
        self.request_for = request_for
        self.tbt_for = tbt_for
        self.log = log

    def _logged(self, command: str, *request_ids: str) -> None:
        if self.log is not None:
            self.log.command(command, list(request_ids))

    def assign(self, request_id: str) -> None:
        self._logged("assign", request_id)
        self.runner.assign(self.request_for(request_id), self.tbt_for(request_id))

    def assign_packed(self, request_ids: tuple[str, ...]) -> None:
        self._logged("assign_packed", *request_ids)
        requests = [self.request_for(rid) for rid in request_ids]
        self.runner.assign_packed(requests, [self.tbt_for(rid) for rid in request_ids])

    def pause_decode(self, request_id: str, drop_state: bool) -> None:
        self._logged("pause_decode", request_id)
        self.runner.pause_decode(request_id, drop_state=drop_state)

    def resume(self, request_id: str) -> None:
        self._logged("resume", request_id)
        self.runner.resume(request_id)

    def preempt(self, request_id: str, drop_state: bool) -> None:
        self._logged("preempt", request_id)
        self.runner.preempt(request_id, drop_state=drop_state)

    def cancel(self, request_id: str) -> None:
        self._logged("cancel", request_id)
        self.runner.cancel(request_id)

    def drain(self) -> None:
        # The scheduler sends Drain only after a WorkerDraining, which no benchmark sends.
        raise RuntimeError("a benchmark's in-process worker is never drained")


class HeapTimers:
    """The dispatcher's wake-ups for a loop that sleeps until the next one is due."""

    def __init__(self) -> None:
        self._armed: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []

    def set(self, request_id: str, at_s: float) -> None:
        self._armed[request_id] = at_s
        heapq.heappush(self._heap, (at_s, request_id))

    def cancel(self, request_id: str) -> None:
        self._armed.pop(request_id, None)

    def next_at(self) -> float | None:
        while self._heap and self._armed.get(self._heap[0][1]) != self._heap[0][0]:
            heapq.heappop(self._heap)  # cancelled or moved
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[str]:
        due = []
        while (at := self.next_at()) is not None and at <= now:
            _, request_id = heapq.heappop(self._heap)
            del self._armed[request_id]
            due.append(request_id)
        return due


def scheduler_event(worker_id: str, event: RunnerEvent) -> Event | None:
    """What a runner event means to the scheduler; None: nothing to decide."""
    match event:
        case Progress():
            return PrefillProgress(
                event.request_id, worker_id, event.tokens_done,
                event.layers_done, event.num_layers, event.chunk_end,
            )  # fmt: skip
        case FirstToken():
            return PrefillFinished(
                event.request_id, worker_id, event.prompt_tokens, event.prefill_busy_s,
                event.pack_tokens,
            )  # fmt: skip
        case DecodeRejoined():
            # Decoding again after a recompute: the scheduler's "prefill done" (not timed).
            return PrefillFinished(event.request_id, worker_id, event.recomputed_tokens, 0.0)
        case runner_events.DecodeStepDone():
            return DecodeStepDone(worker_id, len(event.request_ids), event.seconds, event.slotted)
        case Preempted():
            return PreemptionAcked(
                event.request_id,
                worker_id,
                event.resume_point.tokens_done,
                event.state_dropped,
                event.at - event.signalled_at,
            )
        case Finished() | Failed():
            return RequestDone(event.request_id, worker_id)
    return None  # Cancelled


class _Run:
    """One replay: the records it fills and the loop that drives the dispatcher."""

    def __init__(
        self, scheduler, engines, workload, vocab_size, on_progress, log, admission
    ) -> None:
        self.log: EventLog | None = log
        self.events: queue.Queue = queue.Queue()
        self.records = {a.request_id: RequestRecord(a) for a in workload.arrivals}
        self.result = RunResult(scheduler.policy.name, self.records)
        self.pending = list(workload.arrivals)
        self.unfinished = len(self.pending)
        self.vocab_size = vocab_size
        self.on_progress = on_progress
        self.timers = HeapTimers()
        self.start = time.perf_counter()
        self._cpu_at_start = psutil.cpu_times()
        self.dispatcher = Dispatcher(
            scheduler, self.timers, clock=self.now, on_reject=self._rejected
        )
        self.tiers = scheduler.tiers
        # The service's admission, on this run's clock (``_place``); None: every request
        # stands at its tier.
        self.admission = CapacityBoard("bench", self.tiers, clock=self.now) if admission else None
        self.runners = {
            f"w{i}": BatchRunner(engine, (lambda e, w=f"w{i}": self.events.put((w, e))), f"w{i}")
            for i, engine in enumerate(engines)
        }

    def now(self) -> float:
        return time.perf_counter() - self.start

    def request(self, request_id: str) -> GenerationRequest:
        arrival = self.records[request_id].arrival
        return GenerationRequest(
            request_id,
            prompt_ids(arrival, self.vocab_size),
            max_new_tokens=arrival.max_new_tokens,
            stop_at_eos=False,
        )

    def tbt_slo_s(self, request_id: str) -> float | None:
        return self.tiers[self.records[request_id].arrival.tier].tbt_slo_s

    def _rejected(self, reject: Reject) -> None:
        self.records[reject.request_id].rejected = reject.reason
        self.unfinished -= 1

    def loop(self, max_idle_s: float) -> None:
        """The dispatcher's loop, on its own thread (``run_policy``)."""
        for worker_id, runner in self.runners.items():
            handle = InProcessWorker(runner, self.request, self.tbt_slo_s, self.log)
            engine = runner.engine.config
            budget_ms = engine.preempt_budget_ms if engine.check == "block" else None
            self.dispatcher.worker_joined(
                worker_id, handle, runner.engine.pool.num_slots, (budget_ms or 0) / 1000
            )
        while self.unfinished > 0:
            try:
                worker_id, event = self.events.get(timeout=self._timeout(max_idle_s))
            except queue.Empty:
                self._due(max_idle_s)
                continue
            if event is None:
                raise RuntimeError(f"the engine of {worker_id} failed")
            self._record(event)
            scheduler_event_ = scheduler_event(worker_id, event)
            if scheduler_event_ is not None:
                self.result.progress_events += isinstance(event, Progress)
                self.dispatcher.handle(scheduler_event_)

    def _timeout(self, max_idle_s: float) -> float:
        due = [t for t in (self.timers.next_at(),) if t is not None]
        if self.pending:
            due.append(self.pending[0].at_s)
        return max(0.0, min(due) - self.now()) if due else max_idle_s

    def _due(self, max_idle_s: float) -> None:
        """Nothing came from the engines before the next due time: arrivals and wake-ups."""
        now = self.now()
        if not self.pending and self.timers.next_at() is None:
            raise TimeoutError(f"{self.unfinished} requests unfinished after idling")
        for request_id in self.timers.pop_due(now):
            self.dispatcher.fire_timer(request_id)
        while self.pending and self.pending[0].at_s <= now:
            self._arrive(self.pending.pop(0))

    def _arrive(self, arrival: Arrival) -> None:
        record = self.records[arrival.request_id]
        record.arrived_at = self.start + arrival.at_s
        tier, predicted_ttft_s, over_share = self._place(arrival)
        record.served_tier = tier
        if tier is None:
            self.unfinished -= 1  # refused at admission: record.rejected says why
            return
        if self.log is not None:
            self.log.arrival(arrival.request_id, tier, arrival.prompt_tokens, record.arrived_at)
        self.dispatcher.handle(
            RequestArrived(
                arrival.request_id,
                tier,
                arrival.prompt_tokens,
                arrival.max_new_tokens,
                arrival_s=arrival.at_s,
                key_id=arrival.key_id,
                admission_ttft_s=predicted_ttft_s,
                key_over_share=over_share,
            )
        )

    def _place(self, arrival: Arrival) -> tuple[str | None, float | None, bool]:
        """The tier the request is served at (None: refused), the TTFT admission predicted
        for it there (None: not judged) and whether its key asked more than its share: the
        overflow rules of ``config/tiers.toml`` applied by the service's own
        ``CapacityBoard``, fed the scheduler's exact loads."""
        if self.admission is None:
            return arrival.tier, None, False
        now = self.now()
        scheduler = self.dispatcher.scheduler
        for tier in self.tiers.judged():
            load = scheduler.tier_load(tier, now)
            self.admission.update(PublishedLoad("bench", now, load, {}))
        placement = self.admission.place(arrival.tier, arrival.prompt_tokens, arrival.key_id)
        if self.log is not None:
            self.log.admission(arrival.request_id, placement)
        if placement.served_tier is None:
            self.records[arrival.request_id].rejected = placement.refusal.reason()
        return placement.served_tier, placement.predicted_ttft_s, placement.over_share

    def _record(self, event: RunnerEvent) -> None:
        if self.log is not None:
            self.log.event(event)
        if isinstance(event, runner_events.DecodeStepDone):
            self._record_step(event)
            return
        record = self.records[event.request_id]
        match event:
            case FirstToken():
                if record.first_token_at is None:  # a recompute's does not count again
                    record.first_token_at = event.at
                    record.first_token = event.token_id
                record.token(0, event.at)
            case Preempted():
                record.preemptions += 1
                record.recomputes += event.state_dropped
                self.result.preemption_latencies_s.append(event.at - event.signalled_at)
            case Finished() | Failed():
                if isinstance(event, Failed):
                    record.failed = event.error
                else:
                    record.busy_s = event.busy_s
                    self.result.busy_s += event.busy_s
                record.done_at = event.at
                self.unfinished -= 1
                self.on_progress()

    def _record_step(self, step: runner_events.DecodeStepDone) -> None:
        for rid, index in zip(step.request_ids, step.indexes, strict=True):
            self.records[rid].token(index, step.at)
        self.result.decode_steps += 1
        self.result.decode_rows += len(step.request_ids)
        self.result.slotted_steps += step.slotted
        self.result.decode_step_s.append(step.seconds)

    def stuck(self) -> list[dict]:
        """The requests still unfinished, with the scheduler's view of each."""
        scheduler = self.dispatcher.scheduler
        return [
            {"request_id": rid, "state": str(getattr(scheduler.state_of(rid), "value", None))}
            for rid, r in self.records.items()
            if r.rejected is None and r.done_at is None and r.arrived_at
        ]

    def finish(self) -> RunResult:
        for runner in self.runners.values():
            runner.stop()
        stats = self.dispatcher.stats
        self.result.makespan_s = time.perf_counter() - self.start
        self.result.cpu_steal = steal_share(self._cpu_at_start, psutil.cpu_times())
        self.result.decide_s, self.result.events = stats.decide_s, stats.events
        self.result.prediction_errors = self.dispatcher.scheduler.prediction_errors.summary()
        self.result.admission_errors = self.dispatcher.scheduler.admission_errors.summary()
        self.result.counters = self.dispatcher.scheduler.counters
        return self.result


def run_policy(
    scheduler: Scheduler,
    engines: list[BatchEngine],  # one worker (a BatchRunner) each
    workload: Workload,
    *,
    vocab_size: int,
    on_progress: Callable[[], None] = lambda: None,
    max_idle_s: float = 600.0,
    event_log: EventLog | None = None,
    admission: bool = False,
    stop_when_idle: bool = False,
) -> RunResult:
    """``event_log``: where to write the run's timeline (``bench.event_log``), if anywhere.
    ``admission``: apply the tiers' overflow rules at arrival, as the queue service does.
    Nothing happening for ``max_idle_s`` with requests unfinished raises TimeoutError, or, with
    ``stop_when_idle``, ends the run with those requests in ``RunResult.stuck`` (lost)."""
    # The heap as the worker and the queue service keep theirs once started (tierflow.heap):
    # here a full collection walked the ~430,000 objects of torch, transformers and the
    # model, held the engine thread about 200 ms, and a critical request waited for a decode
    # step or a preemption that long (docs/results.md, "Collections in the bench process").
    # Frozen before the run's clock starts: the freeze's own collection takes as long.
    with frozen_heap():
        run = _Run(scheduler, engines, workload, vocab_size, on_progress, event_log, admission)
        try:
            _drive(run, max_idle_s)
        except TimeoutError:
            if not stop_when_idle:
                raise
            run.result.stuck = run.stuck()
        finally:
            result = run.finish()
    return result


def _drive(run: _Run, max_idle_s: float) -> None:
    """The first worker's engine on this thread, as the worker process runs it on its main
    thread, which holds the OpenMP pool of the bench's own measurements (``BatchRunner``'s
    module docstring: on a second thread a short prefill took 1.5x as long); the dispatcher's
    loop, and any further worker, on threads of their own. The loop's error, if any, is
    raised here."""
    (first_id, first), *others = run.runners.items()
    for _, runner in others:
        runner.start()
    failure: list[BaseException] = []

    def dispatch() -> None:
        try:
            run.loop(max_idle_s)
        except BaseException as exc:  # raised on the calling thread below
            failure.append(exc)
        finally:
            first.stop()  # ends first.run()

    dispatcher = threading.Thread(target=dispatch, name="dispatcher", daemon=True)
    dispatcher.start()
    try:
        first.run()
    finally:
        run.events.put((first_id, None))  # wakes the loop if the engine failed
        dispatcher.join()
    if failure:
        raise failure[0]
