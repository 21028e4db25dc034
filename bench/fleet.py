"""A simulated GPU fleet: the real scheduler and dispatcher, simulated workers, simulated time.

``tierflow bench --scale`` asks what the scheduler costs when workers are GPUs: a layer takes
a millisecond or two, so events come far faster than on this project's CPUs, and the
scheduler's own time may set the pace. Nothing here runs a model. Workers follow a timing
model (``GpuTiming``); the queue-service instances are the real ``Scheduler`` behind the real
``Dispatcher``, each timed in wall-clock seconds on this machine.

What is modelled, and how:

- **An instance is one event loop.** It handles one event at a time; an event that arrives
  while it is deciding waits (``Instance.inbox``). A decision that took ``d`` wall seconds
  here takes ``d`` simulated seconds: its commands reach the workers ``d`` after it started.
  So an instance that cannot keep up shows it the way a real one would, as events waiting and
  first tokens late.
- **Partitions.** Each tier's topic has ``partitions`` partitions, spread over the instances as
  Kafka's range assignor does (per topic, in member order), and a request lands on one of its
  tier's partitions at random. An instance schedules only the requests of its partitions, on
  its own workers (worker N attaches to instance N mod I). Past ``max_live`` live requests an
  instance leaves the rest in its partitions (``queue_service/broker/bridge.py``), the top
  tier first when it takes more.
- **A worker** prefills one request at a time in chunks of ``chunk_tokens``, reporting progress
  after every layer (as ``worker/batch_runner.py`` does), and stops a prefill within
  ``interruption_s`` of a Preempt (the time-bounded interruption points), keeping its state or
  dropping it as asked. Past its first token a request decodes in the worker's batch, one step
  for every row each ``decode_step_s + rows * decode_row_s``, with one ``DecodeStepDone`` per
  step. Simplifications, stated: decode steps do not slow the prefill beside them; a pause or
  a stop is acknowledged after one interruption budget; no request is cancelled; admission
  against capacity (``CapacityBoard``) is not simulated.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.workload import Arrival
from queue_service.core.dispatcher import Dispatcher
from queue_service.scheduler import (
    DecodeStepDone,
    PreemptionAcked,
    PrefillFinished,
    PrefillProgress,
    PrefillTimePredictor,
    RequestArrived,
    RequestDone,
    Scheduler,
    SchedulerConfig,
    make_policy,
)
from tierflow.tiers import TierTable
from worker.config import EngineConfig


@dataclass(frozen=True)
class GpuTiming:
    """A simulated worker's speed: a stated assumption, not a measurement. The default is a
    GPU on which a 2048-token chunk takes about 1.9 ms a layer (32 layers): an 8B-class model
    at about 40,000 prompt tokens a second (the "millisecond or two" a layer of issue 33)."""

    name: str = "gpu-40k-tok-s"
    layers: int = 32
    chunk_tokens: int = 2048
    prefill_s_per_token: float = 25e-6
    prefill_s_per_token2: float = 2e-9  # attention's quadratic part
    prefill_fixed_s: float = 2e-3
    decode_step_s: float = 8e-3
    decode_row_s: float = 5e-5
    interruption_s: float = 2e-3  # the preemption budget on this hardware
    kv_slots: int = 64
    # A worker reports a chunk's layers at most this often, as the real engine does.
    progress_interval_s: float = EngineConfig().progress_interval_ms / 1000

    def prefill_s(self, tokens: int, done: int = 0) -> float:
        """Seconds to prefill tokens [done, tokens)."""
        linear = self.prefill_s_per_token * (tokens - done)
        quadratic = self.prefill_s_per_token2 * (tokens * tokens - done * done)
        return linear + quadratic + (self.prefill_fixed_s if done == 0 else 0.0)

    def predictor(self) -> PrefillTimePredictor:
        """The scheduler's predictor, calibrated to this timing exactly."""
        return PrefillTimePredictor(
            a=self.prefill_s_per_token, b=self.prefill_s_per_token2, c=self.prefill_fixed_s
        )

    def step_s(self, rows: int) -> float:
        return self.decode_step_s + rows * self.decode_row_s


class Clock:
    """Simulated time: callbacks in time order (ties in the order they were scheduled)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), action))

    def run(self, until_s: float, wall_limit_s: float) -> bool:
        """Runs until ``until_s`` or nothing is left; False if ``wall_limit_s`` ran out."""
        deadline = time.monotonic() + wall_limit_s
        while self._heap and self._heap[0][0] <= until_s:
            self.now, _, action = heapq.heappop(self._heap)
            action()
            if time.monotonic() > deadline:
                return False
        return True


@dataclass
class _Prefill:
    request_id: str
    work_s: float  # the whole prefill's compute
    done_s: float  # compute done when this run started (a resume keeps what was done)
    started_s: float
    stopping: bool = False


@dataclass
class SimWorker:
    """One simulated worker (a ``dispatcher.WorkerHandle``)."""

    worker_id: str
    timing: GpuTiming
    clock: Clock
    report: Callable[[object], None]  # an event back to its instance
    prompts: dict[str, int]  # request id -> prompt tokens
    outputs: dict[str, int]  # request id -> tokens it still has to decode
    prefill: _Prefill | None = None
    held: dict[str, float] = field(default_factory=dict)  # suspended: compute done
    decoding: dict[str, int] = field(default_factory=dict)  # request -> tokens left
    paused: dict[str, int] = field(default_factory=dict)  # paused decodes: tokens left
    _stepping: bool = False

    # -- commands (dispatcher.WorkerHandle)

    def assign(self, request_id: str) -> None:
        self._start(request_id, 0.0)  # a request seen before recomputes from token 0

    def assign_packed(self, request_ids: tuple[str, ...]) -> None:
        raise NotImplementedError("the scale bench runs with packing off")

    def resume(self, request_id: str) -> None:
        if request_id in self.paused:
            self.decoding[request_id] = self.paused.pop(request_id)
            self._step_soon()
        else:
            self._start(request_id, self.held.pop(request_id))

    def preempt(self, request_id: str, drop_state: bool) -> None:
        if request_id in self.decoding:
            self.pause_decode(request_id, drop_state)
            return
        run = self.prefill
        if run is None or run.request_id != request_id or run.stopping:
            return  # finished meanwhile: the runner ignores it
        run.stopping = True
        stop_at = self.clock.now + self.timing.interruption_s
        if run.done_s + (stop_at - run.started_s) >= run.work_s:
            return  # its first token comes first; then the runner pauses its decode
        latency_s = self.timing.interruption_s
        self.clock.at(stop_at, lambda: self._stopped(run, drop_state, latency_s))

    def pause_decode(self, request_id: str, drop_state: bool) -> None:
        left = self.decoding.pop(request_id, None)
        if left is None:
            return
        if drop_state:
            self.outputs[request_id] = left  # what a recompute still has to decode
        else:
            self.paused[request_id] = left
        ack = PreemptionAcked(request_id, self.worker_id, self.prompts[request_id], drop_state)
        self.clock.at(self.clock.now + self.timing.interruption_s, lambda: self.report(ack))

    def cancel(self, request_id: str) -> None:
        if self.prefill is not None and self.prefill.request_id == request_id:
            self.prefill = None
        for states in (self.held, self.decoding, self.paused):
            states.pop(request_id, None)

    def drain(self) -> None:
        raise NotImplementedError("the scale bench does not drain workers")

    # -- the engine

    def _timeline(self, request_id: str) -> list[tuple[float, object]]:
        """(compute offset, progress event) after every layer of every chunk."""
        tokens, layers = self.prompts[request_id], self.timing.layers
        points: list[tuple[float, object]] = []
        offset, start = 0.0, 0
        while start < tokens:
            end = min(tokens, start + self.timing.chunk_tokens)
            layer_s = self.timing.prefill_s(end, start) / layers
            for layer in range(1, layers + 1):
                offset += layer_s
                if layer < layers:
                    event = PrefillProgress(request_id, self.worker_id, start, layer, layers, end)
                elif end < tokens:
                    event = PrefillProgress(request_id, self.worker_id, end)
                else:
                    event = None  # the first token
                points.append((offset, event))
            start = end
        return points

    def _start(self, request_id: str, done_s: float) -> None:
        assert self.prefill is None, f"{self.worker_id}: a prefill while busy"
        points = self._timeline(request_id)
        run = _Prefill(request_id, points[-1][0], done_s, self.clock.now)
        self.prefill = run
        reported = done_s  # as the engine: a chunk's layers at most every progress interval
        for offset, event in points:
            if offset <= done_s:
                continue
            within_chunk = event is not None and event.layers_done > 0
            if within_chunk and offset - reported < self.timing.progress_interval_s:
                continue
            reported = offset
            at = self.clock.now + offset - done_s
            if event is None:
                self.clock.at(at, lambda: self._first_token(run))
            else:
                self.clock.at(at, lambda event=event: self._progress(run, event))

    def _progress(self, run: _Prefill, event) -> None:
        if self.prefill is run:
            self.report(event)

    def _stopped(self, run: _Prefill, drop: bool, latency_s: float) -> None:
        if self.prefill is not run:
            return
        self.prefill = None
        done_s = run.done_s + (self.clock.now - run.started_s)
        if not drop:
            self.held[run.request_id] = done_s
        tokens = self._tokens_at(run.request_id, done_s)
        self.report(PreemptionAcked(run.request_id, self.worker_id, tokens, drop, latency_s))

    def _tokens_at(self, request_id: str, done_s: float) -> int:
        """Prompt tokens whose every layer is done after ``done_s`` of compute (what the
        engine reports; a resume still continues mid-chunk, from the layers it kept)."""
        tokens, start, spent = self.prompts[request_id], 0, 0.0
        while start < tokens:
            end = min(tokens, start + self.timing.chunk_tokens)
            spent += self.timing.prefill_s(end, start)
            if spent > done_s:
                return start
            start = end
        return tokens

    def _first_token(self, run: _Prefill) -> None:
        if self.prefill is not run:
            return
        self.prefill = None
        busy_s = run.work_s
        tokens = self.prompts[run.request_id]
        self.report(PrefillFinished(run.request_id, self.worker_id, tokens, busy_s))
        self.decoding[run.request_id] = max(0, self.outputs[run.request_id] - 1)
        if run.stopping:  # a Preempt after the last boundary pauses the decode (kept)
            self.pause_decode(run.request_id, False)
        self._step_soon()

    def _step_soon(self) -> None:
        if not self._stepping and self.decoding:
            self._stepping = True
            self.clock.at(self.clock.now + self.timing.step_s(len(self.decoding)), self._step)

    def _step(self) -> None:
        self._stepping = False
        rows = len(self.decoding)
        if rows == 0:
            return
        self.report(DecodeStepDone(self.worker_id, rows, self.timing.step_s(rows)))
        for request_id in list(self.decoding):
            self.decoding[request_id] -= 1
            if self.decoding[request_id] <= 0:
                del self.decoding[request_id]
                self.report(RequestDone(request_id, self.worker_id))
        self._step_soon()


class _Timers:
    """``dispatcher.Timers`` on the simulated clock."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self.armed: dict[str, float] = {}

    def set(self, request_id: str, at_s: float) -> None:
        self.armed[request_id] = at_s

        def fire() -> None:
            if self.armed.get(request_id) == at_s:
                del self.armed[request_id]
                self.instance.deliver(lambda: self.instance.dispatcher.fire_timer(request_id))

        self.instance.clock.at(at_s, fire)

    def cancel(self, request_id: str) -> None:
        self.armed.pop(request_id, None)


@dataclass
class Decision:
    wall_s: float  # the scheduler's and dispatcher's time, measured on this machine
    waited_s: float  # simulated time the event waited for the instance to be free
    live: int  # requests the scheduler held when it decided


class Instance:
    """One queue-service instance: an event loop whose decisions take their measured time."""

    def __init__(
        self,
        name: str,
        clock: Clock,
        tiers: TierTable,
        timing: GpuTiming,
        policy: str,
        max_live: int,
        charge_decisions: bool = True,
        plan_window: int | None = SchedulerConfig.plan_window,
    ) -> None:
        self.name = name
        # False: decisions take no simulated time (tests of the fleet's own behaviour, which
        # must not depend on how loaded the machine that runs them is).
        self.charge_decisions = charge_decisions
        self.clock = clock
        self.tiers = tiers
        self.max_live = max_live
        config = SchedulerConfig(refit_predictor=False, max_pack_size=1, plan_window=plan_window)
        self.scheduler = Scheduler(make_policy(policy), tiers, timing.predictor(), config)
        self.dispatcher = Dispatcher(self.scheduler, _Timers(self), clock=lambda: clock.now)
        self.inbox: deque[tuple[float, Callable[[], None]]] = deque()
        self.busy = False
        self.decisions: list[Decision] = []
        self.backlog: dict[str, deque[Arrival]] = {t.name: deque() for t in tiers}
        self._outbox: list[Callable[[], None]] = []
        self._in_flight_arrivals = 0  # taken from the partitions, not yet handed over

    def deliver(self, action: Callable[[], None]) -> None:
        """An event for this instance (``action`` hands it to the dispatcher)."""
        self.inbox.append((self.clock.now, action))
        if not self.busy:
            self._next()

    def later(self, action: Callable[[], None]) -> None:
        """A command's effect on a worker: it happens when the decision is over."""
        self._outbox.append(action)

    def offer(self, arrival: Arrival) -> None:
        """A request written to one of this instance's partitions."""
        self.backlog[arrival.tier].append(arrival)
        self._take()

    def _take(self) -> None:
        """Takes requests from its partitions while it holds fewer than ``max_live``, the
        top tier first (the bridge's rule)."""
        room = self.max_live - self.scheduler.live_requests() - self._in_flight_arrivals
        for tier in self.tiers:  # best rank first
            queue = self.backlog[tier.name]
            while room > 0 and queue:
                arrival = queue.popleft()
                room -= 1
                self._in_flight_arrivals += 1
                event = RequestArrived(
                    arrival.request_id, arrival.tier, arrival.prompt_tokens,
                    arrival.max_new_tokens, arrival_s=arrival.at_s,
                )  # fmt: skip

                def arrive(event=event) -> None:
                    self._in_flight_arrivals -= 1
                    self.dispatcher.handle(event)

                self.deliver(arrive)

    def _next(self) -> None:
        if not self.inbox:
            self.busy = False
            return
        self.busy = True
        queued_at, action = self.inbox.popleft()
        live = self.scheduler.live_requests()
        started = time.perf_counter()
        action()
        wall_s = time.perf_counter() - started
        self.decisions.append(Decision(wall_s, self.clock.now - queued_at, live))
        effects, self._outbox = self._outbox, []

        def done() -> None:
            for effect in effects:
                effect()
            self._take()
            self._next()

        self.clock.at(self.clock.now + (wall_s if self.charge_decisions else 0.0), done)


class _DeferredHandle:
    """A worker's handle as the dispatcher sees it: each command takes effect when the
    decision that sent it is over."""

    def __init__(self, worker: SimWorker, instance: Instance) -> None:
        self.worker = worker
        self.instance = instance

    def __getattr__(self, name: str):
        method = getattr(self.worker, name)
        return lambda *args: self.instance.later(lambda: method(*args))


def range_assignment(partitions: int, instances: int) -> list[int]:
    """Partition -> instance index, as Kafka's range assignor gives one topic's partitions to
    the members of a group (the first ``partitions % instances`` members get one more)."""
    per, extra = divmod(partitions, instances)
    owners: list[int] = []
    for member in range(instances):
        owners += [member] * (per + (1 if member < extra else 0))
    return owners


@dataclass
class Outcome:
    """What one request met."""

    tier: str
    prompt_tokens: int
    arrival_s: float
    first_token_s: float | None = None
    done_s: float | None = None


class Fleet:
    """Instances, their workers and the arrivals, on one simulated clock."""

    def __init__(
        self,
        tiers: TierTable,
        timing: GpuTiming,
        *,
        workers: int,
        instances: int,
        partitions: int,
        policy: str = "flowprefill",
        max_live: int = 256,
        seed: int = 0,
        charge_decisions: bool = True,
        plan_window: int | None = SchedulerConfig.plan_window,
    ) -> None:
        self.clock = Clock()
        self.timing = timing
        self.rng = random.Random(seed)
        self.instances = [
            Instance(
                f"qs-{i}",
                self.clock,
                tiers,
                timing,
                policy,
                max_live,
                charge_decisions,
                plan_window,
            )
            for i in range(instances)
        ]
        self.owners = range_assignment(partitions, instances)
        self.prompts: dict[str, int] = {}
        self.outputs: dict[str, int] = {}
        self.outcomes: dict[str, Outcome] = {}
        for n in range(workers):
            instance = self.instances[n % instances]
            self._attach(f"w{n}", instance)

    def _attach(self, worker_id: str, instance: Instance) -> None:
        def report(event) -> None:
            if isinstance(event, PrefillFinished):
                outcome = self.outcomes[event.request_id]
                if outcome.first_token_s is None:
                    outcome.first_token_s = self.clock.now
            elif isinstance(event, RequestDone):
                self.outcomes[event.request_id].done_s = self.clock.now
            instance.deliver(lambda: instance.dispatcher.handle(event))

        worker = SimWorker(worker_id, self.timing, self.clock, report, self.prompts, self.outputs)
        handle = _DeferredHandle(worker, instance)
        instance.deliver(
            lambda: instance.dispatcher.worker_joined(
                worker_id, handle, self.timing.kv_slots, self.timing.interruption_s
            )
        )

    def submit(self, arrivals: list[Arrival]) -> None:
        for arrival in arrivals:
            self.prompts[arrival.request_id] = arrival.prompt_tokens
            self.outputs[arrival.request_id] = max(1, arrival.max_new_tokens)
            self.outcomes[arrival.request_id] = Outcome(
                arrival.tier, arrival.prompt_tokens, arrival.at_s
            )
            owner = self.instances[self.owners[self.rng.randrange(len(self.owners))]]
            self.clock.at(arrival.at_s, lambda a=arrival, o=owner: o.offer(a))

    def run(self, until_s: float, wall_limit_s: float) -> bool:
        """Runs the simulation; False if it was cut at ``wall_limit_s`` of this machine's
        time (an instance that cannot keep up makes the simulation slow as well).

        The garbage collector is off meanwhile: most of what the simulation allocates is its
        own (each simulated prefill's scheduled reports), which no queue service holds, and a
        full collection over it took 100-140 ms, charged to whichever decision it fell in
        (a top-tier TTFT p99 of 70 ms where the bound is 6.4). A queue service freezes its
        startup heap (``tierflow.heap``), and a full collection of its scheduler's state is
        measured apart (``bench.scale``: 0.2 ms at 256 live requests)."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self.clock.run(until_s, wall_limit_s)
        finally:
            if enabled:
                gc.enable()
