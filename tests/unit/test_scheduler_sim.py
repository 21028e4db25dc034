"""End to end on a fake clock: a fake worker model turns the scheduler's commands into later
events, and every accepted request must complete, under every policy.

The fake workers follow the runner's contract (worker/batch_runner.py): one prefill at a time,
progress reported per chunk, and a Preempt honoured at the next boundary the policy's
``engine_check`` asks for (a row block, half or layer: a few ms; a chunk end; or never); past
its first token a request decodes in the worker's batch, beside the next prefill, until a
PauseDecode (or a Preempt that came after the prefill's last boundary) takes it out. They
assert the scheduler's side of the protocol: no Assign or Resume to a busy worker, no Resume
without the state, no second Preempt while one is pending.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

import pytest

from queue_service.scheduler import (
    POLICIES,
    Assign,
    Cancel,
    CancelTimer,
    PauseDecode,
    Preempt,
    PreemptionAcked,
    PrefillFinished,
    PrefillProgress,
    PrefillTimePredictor,
    Reject,
    RequestArrived,
    RequestCancelled,
    RequestDone,
    RequestState,
    Resume,
    Scheduler,
    SchedulerConfig,
    SetTimer,
    TimerFired,
    WorkerJoined,
    WorkerLeft,
    make_policy,
)
from tests.tiers import UNIT_TIERS

TIERS = UNIT_TIERS


@dataclass
class Job:
    request_id: str
    prompt: int
    new_tokens: int
    work_s: float = 0.0  # compute already done, prefill then decode, in seconds


@dataclass
class Run:
    job: Job
    started_at: float
    epoch: int
    stopping: bool = False
    pause_when_prefilled: bool | None = None  # a Preempt after the last boundary: drop_state


@dataclass
class FakeWorker:
    worker_id: str
    run: Run | None = None
    held: dict[str, Job] = field(default_factory=dict)  # suspended states
    decoding: dict[str, tuple[Job, float, int]] = field(default_factory=dict)  # since, epoch


@dataclass
class Record:
    arrival: float
    tier: str
    first_token: float | None = None
    done: float | None = None
    done_event: int | None = None  # how many events the scheduler had handled by then
    rejected: str | None = None
    cancelled: bool = False


class FakeCluster:
    """Workers and clients on a fake clock, driving one Scheduler."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        s_per_token: float = 1e-3,
        decode_s_per_token: float = 0.01,
        chunk_tokens: int = 512,
        layer_s: float = 0.004,
        slowdown: dict[str, float] | None = None,
        fire_timers: bool = True,
    ) -> None:
        self.sched = scheduler
        self.check = scheduler.policy.engine_check
        self.s_per_token = s_per_token
        self.decode_s = decode_s_per_token
        self.chunk_tokens = chunk_tokens
        self.layer_s = layer_s
        # Per request: how much slower than s_per_token its prefill really is (the predictor
        # does not know: its predictions for that request are this many times too optimistic).
        self.slowdown = slowdown or {}
        self.fire_timers = fire_timers  # False: a dispatcher that drops wake-ups
        self.workers: dict[str, FakeWorker] = {}
        self.records: dict[str, Record] = {}
        self.specs: dict[str, tuple[int, int]] = {}
        self.arrival_at: dict[str, float] = {}
        self.now = 0.0
        self.events = 0  # events handed to the scheduler
        self._heap: list = []
        self._seq = 0
        self._epoch = 0
        self.timers: dict[str, float] = {}  # armed wake-ups, as the dispatcher keeps them

    # -- scripting

    def _push(self, t: float, item: tuple) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, item))

    def arrive(self, t, rid, tier, prompt, new_tokens=0, admitted_at=None):
        """``admitted_at``: when the request was admitted, if earlier than its delivery ``t``."""
        self.specs[rid] = (prompt, new_tokens)
        self.arrival_at[rid] = t
        event = RequestArrived(rid, tier, prompt, new_tokens, arrival_s=admitted_at)
        self._push(t, ("client", event))

    def cancel(self, t, rid):
        self._push(t, ("client", RequestCancelled(rid)))

    def join(self, t, wid):
        self._push(t, ("join", wid))

    def leave(self, t, wid):
        self._push(t, ("leave", wid))

    # -- the worker model

    def _prefill_s(self, job: Job) -> float:
        return job.prompt * self.s_per_token * self.slowdown.get(job.request_id, 1.0)

    def _total_s(self, job: Job) -> float:
        return self._prefill_s(job) + job.new_tokens * self.decode_s

    def _start(self, worker: FakeWorker, job: Job) -> None:
        """A prefill run (to its first token), or a paused decode back into the batch."""
        if job.work_s >= self._prefill_s(job):
            self._decode(worker, job)
            return
        assert worker.run is None, f"{worker.worker_id} got work while busy"
        self._epoch += 1
        run = worker.run = Run(job, self.now, self._epoch)
        w0, prefill = job.work_s, self._prefill_s(job)
        chunk_s = self.chunk_tokens * self.s_per_token
        k = math.floor(w0 / chunk_s) + 1
        while k * chunk_s < prefill:
            event = PrefillProgress(job.request_id, worker.worker_id, k * self.chunk_tokens)
            self._push(self.now + k * chunk_s - w0, ("worker", event, worker.worker_id, run.epoch))
            k += 1
        event = PrefillFinished(job.request_id, worker.worker_id, job.prompt, prefill)
        self._push(self.now + prefill - w0, ("worker", event, worker.worker_id, run.epoch))

    def _decode(self, worker: FakeWorker, job: Job) -> None:
        """Into the batch: it finishes after its tokens' decode time, whatever else runs."""
        self._epoch += 1
        worker.decoding[job.request_id] = (job, self.now, self._epoch)
        left = self._total_s(job) - job.work_s
        event = RequestDone(job.request_id, worker.worker_id)
        self._push(self.now + left, ("decode", event, worker.worker_id, self._epoch))

    def _pause(self, worker: FakeWorker, rid: str, drop_state: bool) -> None:
        """Out of the batch between two steps; acknowledged like a preemption."""
        job, since, _ = worker.decoding.pop(rid)
        job.work_s += self.now - since
        if not drop_state:
            worker.held[rid] = job
        ack = PreemptionAcked(rid, worker.worker_id, job.prompt, state_dropped=drop_state)
        self._push(self.now + self.decode_s, ("ack", ack, worker.worker_id))

    def _stop_point(self, run: Run) -> float | None:
        """Compute done when the engine next checks the flag; None: the prefill ends first."""
        job = run.job
        done = job.work_s + (self.now - run.started_at)
        prefill = self._prefill_s(job)
        if self.check == "none":
            return None
        if self.check in ("block", "half", "layer"):  # a layer here (4 ms) fits the budget
            stop = done + self.layer_s
        else:  # chunk ends only; the last chunk ends where the first token comes
            step = self.chunk_tokens * self.s_per_token
            stop = min(math.ceil(done / step - 1e-9) * step, prefill)
        return stop if stop < prefill else None

    def _apply(self, command) -> None:
        if isinstance(command, Reject):
            self.records[command.request_id].rejected = command.reason
            return
        if isinstance(command, SetTimer):
            assert command.at_s >= self.now, "a wake-up in the past"
            self.timers[command.request_id] = command.at_s
            self._push(command.at_s, ("timer", command.request_id, command.at_s))
            return
        if isinstance(command, CancelTimer):
            # It may have fired already (the event in flight): a dispatcher ignores that.
            self.timers.pop(command.request_id, None)
            return
        worker = self.workers[command.worker_id]
        rid = command.request_id
        if isinstance(command, Assign):
            worker.held.pop(rid, None)
            self._start(worker, Job(rid, *self.specs[rid]))
        elif isinstance(command, Resume):
            assert rid in worker.held, f"Resume of {rid} on {worker.worker_id} without its state"
            self._start(worker, worker.held.pop(rid))
        elif isinstance(command, PauseDecode) or (
            isinstance(command, Preempt) and rid in worker.decoding
        ):
            if rid in worker.decoding:  # else it finished meanwhile: the runner ignores it
                self._pause(worker, rid, command.drop_state)
        elif isinstance(command, Preempt):
            run = worker.run
            assert run is not None and run.job.request_id == rid, f"Preempt of {rid}: not running"
            assert not run.stopping, f"second Preempt of {rid}"
            run.stopping = True
            stop = self._stop_point(run)
            if stop is None:  # its first token comes first: then it pauses (the runner's rule)
                run.pause_when_prefilled = command.drop_state
                return
            ack = PreemptionAcked(
                rid,
                worker.worker_id,
                min(run.job.prompt, int(stop / self.s_per_token + 1e-9)),
                state_dropped=command.drop_state,
            )
            when = run.started_at + stop - run.job.work_s
            self._push(when, ("worker", ack, worker.worker_id, run.epoch, stop))
        elif isinstance(command, Cancel):
            if worker.run is not None and worker.run.job.request_id == rid:
                worker.run = None  # its pending events become stale
            worker.held.pop(rid, None)
            worker.decoding.pop(rid, None)
        else:
            raise AssertionError(f"unexpected command {command!r}")

    # -- the loop

    def _deliver(self, event) -> None:
        self.events += 1
        for command in self.sched.handle(event, self.now):
            self._apply(command)

    def run(self, max_events: int = 200_000) -> None:
        while self._heap:
            assert self.events < max_events, "no progress: livelock?"
            self.now, _, item = heapq.heappop(self._heap)
            kind = item[0]
            if kind == "client":
                event = item[1]
                if isinstance(event, RequestArrived):
                    self.records[event.request_id] = Record(self.now, event.tier)
                else:
                    self.records[event.request_id].cancelled = True
                self._deliver(event)
            elif kind == "join":
                self.workers[item[1]] = FakeWorker(item[1])
                self._deliver(WorkerJoined(item[1], kv_slots=8))
            elif kind == "leave":
                del self.workers[item[1]]
                self._deliver(WorkerLeft(item[1]))
            elif kind == "timer":
                if self.timers.get(item[1]) == item[2]:  # not cancelled or moved since
                    del self.timers[item[1]]
                    if self.fire_timers:
                        self._deliver(TimerFired(item[1]))
            elif kind == "decode":
                self._decode_done(*item[1:])
            elif kind == "ack":
                if item[2] in self.workers:
                    self._deliver(item[1])
            else:
                self._worker_event(*item[1:])

    def _decode_done(self, event: RequestDone, wid: str, epoch: int) -> None:
        worker = self.workers.get(wid)
        rid = event.request_id
        if worker is None or worker.decoding.get(rid, (None, 0, None))[2] != epoch:
            return  # paused, cancelled, or its worker left
        del worker.decoding[rid]
        self.records[rid].done = self.now
        self.records[rid].done_event = self.events + 1
        self._deliver(event)

    def _worker_event(self, event, wid, epoch, stop=None) -> None:
        worker = self.workers.get(wid)
        if worker is None or worker.run is None or worker.run.epoch != epoch:
            return  # from a run that was cancelled, stopped, or a worker that left
        rid = event.request_id
        if isinstance(event, PrefillFinished):
            record = self.records[rid]
            record.first_token = record.first_token or self.now
            run, worker.run = worker.run, None  # the next prefill may start now
            run.job.work_s = self._prefill_s(run.job)
            self._decode(worker, run.job)
            if run.pause_when_prefilled is not None:
                self._pause(worker, rid, run.pause_when_prefilled)
            self._deliver(event)
            return
        elif isinstance(event, PreemptionAcked):
            job = worker.run.job
            worker.run = None
            job.work_s = 0.0 if event.state_dropped else stop
            if not event.state_dropped:
                worker.held[rid] = job
        self._deliver(event)

    # -- checks

    def assert_all_accepted_completed(self) -> None:
        for rid, record in self.records.items():
            state = self.sched.state_of(rid)
            if record.rejected is not None:
                assert state is RequestState.REJECTED
            elif record.cancelled and record.done is None:
                assert state is RequestState.CANCELLED
            else:
                assert record.done is not None, f"{rid} never completed ({state})"
                assert state is RequestState.DONE
        assert self.sched.live_requests() == 0
        assert all(r is None for r in self.sched.running().values())
        assert all(not held for held in self.sched.suspended().values())
        assert all(not w.held and not w.decoding and w.run is None for w in self.workers.values())
        assert not self.timers, "wake-ups left armed"
        assert self.sched.timers() == {} or not self.fire_timers

    def ttft(self, rid: str) -> float:
        record = self.records[rid]
        assert record.first_token is not None
        return record.first_token - record.arrival


def scheduler(policy: str, **config) -> Scheduler:
    config.setdefault("max_pack_size", 1)  # the fake workers prefill one prompt at a time
    return Scheduler(
        make_policy(policy), TIERS, PrefillTimePredictor(1e-3, 0.0, 0.0), SchedulerConfig(**config)
    )


def random_workload(cluster: FakeCluster, n: int, seed: int, rate: float = 1.5) -> None:
    rng = random.Random(seed)
    t = 0.0
    sizes = {"critical": (20, 400), "standard": (100, 2500), "batch": (1000, 8000)}
    for i in range(n):
        t += rng.expovariate(rate)
        tier = rng.choices(["critical", "standard", "batch"], weights=[3, 3, 2])[0]
        cluster.arrive(t, f"r{i}", tier, rng.randint(*sizes[tier]), rng.choice([0, 0, 5, 30]))


# ------------------------------------------------------------------ every request completes


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_accepted_request_completes(policy, seed):
    cluster = FakeCluster(scheduler(policy))
    cluster.join(0.0, "w0")
    cluster.join(0.0, "w1")
    random_workload(cluster, 80, seed)
    cluster.run()
    cluster.assert_all_accepted_completed()
    assert all(r.rejected is None for r in cluster.records.values())
    if not cluster.sched.policy.preempts:
        assert cluster.sched.counters.get("preemptions", 0) == 0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_request_completes_with_cancels_and_worker_churn(policy):
    cluster = FakeCluster(scheduler(policy, max_suspended_per_worker=1))
    cluster.join(0.0, "w0")
    cluster.join(0.0, "w1")
    cluster.leave(6.0, "w1")  # holding whatever it holds
    cluster.join(9.0, "w2")
    cluster.leave(15.0, "w0")
    cluster.join(15.5, "w0")  # same id, fresh worker
    random_workload(cluster, 60, seed=7, rate=2.0)
    rng = random.Random(3)
    for rid in rng.sample(sorted(cluster.specs), 8):
        cluster.cancel(cluster.arrival_at[rid] + rng.uniform(0.0, 6.0), rid)
    cluster.run()
    cluster.assert_all_accepted_completed()
    assert cluster.sched.counters.get("RequestCancelled") == 8


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_overload_sheds_batch_only_and_the_rest_completes(policy):
    cluster = FakeCluster(scheduler(policy, max_queued_sheddable=3, max_predicted_wait_s=20.0))
    cluster.join(0.0, "w0")
    random_workload(cluster, 80, seed=11, rate=4.0)  # far more than one worker can serve
    cluster.run()
    cluster.assert_all_accepted_completed()
    shed = [r for r in cluster.records.values() if r.rejected is not None]
    assert shed and all(r.tier == "batch" and "overloaded" in r.rejected for r in shed)


# ---------------------------------------------------------------------------- no starvation


@pytest.mark.parametrize("policy", ["priority", "chunked", "recompute", "flowprefill"])
def test_batch_request_does_not_starve_under_a_stream_of_critical_requests(policy):
    starvation_s = 10.0
    cluster = FakeCluster(scheduler(policy, starvation_s=starvation_s))
    cluster.join(0.0, "w0")
    # Critical work arrives twice as fast as one worker serves it, for 60 s.
    for i in range(240):
        cluster.arrive(i * 0.25, f"c{i}", "critical", 500)
    cluster.arrive(0.1, "b", "batch", 2000)
    cluster.run()
    cluster.assert_all_accepted_completed()
    done = cluster.records["b"].done
    # Aged at 10.1 s; it waits at most for the critical request on the worker, then runs its
    # 2 s unpreempted: long before the ~120 s the critical backlog takes.
    assert done is not None and done < 0.1 + starvation_s + 0.5 + 2.0 + 0.1
    # In events: ~13 s of arrivals (4/s) and completions (2/s), a few preemptions, acks and
    # wake-ups of waiting critical requests.
    assert cluster.records["b"].done_event < 160
    last_critical = max(r.done for rid, r in cluster.records.items() if rid != "b")
    assert last_critical > 100.0


def test_without_aging_the_same_batch_request_waits_for_the_whole_stream():
    cluster = FakeCluster(scheduler("priority", starvation_s=math.inf))
    cluster.join(0.0, "w0")
    for i in range(240):
        cluster.arrive(i * 0.25, f"c{i}", "critical", 500)
    cluster.arrive(0.1, "b", "batch", 2000)
    cluster.run()
    assert cluster.records["b"].done > 100.0  # the test above is not passing by accident


# ---------------------------------------------------------------------------- what it buys


def premium_behind_long_batch(policy: str) -> FakeCluster:
    # The batch document is preempted 4 times here: allow it (the default bound is 3).
    cluster = FakeCluster(scheduler(policy, max_preemptions=4))
    cluster.join(0.0, "w0")
    cluster.arrive(0.0, "doc", "batch", 8000, 20)  # 8 s of prefill
    for i, t in enumerate((1.0, 3.0, 5.0)):
        cluster.arrive(t, f"c{i}", "critical", 100, 5)
    cluster.arrive(2.0, "s", "standard", 300)
    cluster.run()
    cluster.assert_all_accepted_completed()
    return cluster


def test_flowprefill_meets_critical_slos_behind_a_long_prefill_and_fifo_does_not():
    flow = premium_behind_long_batch("flowprefill")
    fifo = premium_behind_long_batch("fifo")
    for rid in ("c0", "c1", "c2"):
        assert flow.ttft(rid) < 1.0
    assert flow.ttft("s") < 5.0
    assert fifo.ttft("c0") > 5.0
    # One preemption per newcomer (the standard one would wait ~6 s for the batch: a miss).
    assert flow.sched.counters["preemptions"] == 4


def test_chunked_switches_at_chunk_ends_and_flowprefill_within_a_layer():
    chunked = premium_behind_long_batch("chunked")
    flow = premium_behind_long_batch("flowprefill")
    # A chunk is 0.512 s here; a layer 4 ms.
    assert max(flow.ttft(f"c{i}") for i in range(3)) < 0.1 + 0.004 + 0.05
    assert max(chunked.ttft(f"c{i}") for i in range(3)) > 0.1 + 0.1


# ---------------------------------------------------------------------------- wrong predictions


def behind_a_mispredicted_prefill(fire_timers: bool) -> FakeCluster:
    # The document's prefill really takes 2x its prediction (4 s, predicted 2 s), and one chunk
    # holds the whole prompt, so no progress report corrects the estimate in time. It is a
    # standard request admitted long before (deadline 2.05 s): stopping it would cost it its
    # deadline, so flowprefill lets a newcomer wait on the prediction instead.
    cluster = FakeCluster(
        scheduler("flowprefill"),
        chunk_tokens=4096,
        slowdown={"doc": 2.0},
        fire_timers=fire_timers,
    )
    cluster.join(0.0, "w0")
    cluster.arrive(0.0, "doc", "standard", 2000, admitted_at=-2.95)
    # At 1.5 s the document is predicted to end at 2.0 s: the critical request (0.1 s of
    # prefill, deadline 2.5 s) waits, with a wake-up at its latest start.
    cluster.arrive(1.5, "c", "critical", 100)
    cluster.run()
    cluster.assert_all_accepted_completed()
    return cluster


def test_a_prediction_2x_too_optimistic_still_meets_the_deadline_thanks_to_the_wake_up():
    cluster = behind_a_mispredicted_prefill(fire_timers=True)
    assert cluster.ttft("c") <= 1.0  # the critical SLO
    assert cluster.sched.counters["timers_fired"] == 1
    assert cluster.sched.counters["preemptions"] == 1


def test_without_the_wake_up_the_same_critical_request_misses_its_deadline():
    cluster = behind_a_mispredicted_prefill(fire_timers=False)
    assert cluster.ttft("c") > 2.0  # it waited for the whole document
    assert cluster.sched.counters.get("preemptions", 0) == 0


def test_late_critical_requests_run_before_waiting_batch_work():
    """After a stall (a backlog behind one long request), the critical requests that are
    already late still go before the batch requests that wait with time to spare."""
    # No preemptions allowed: a stalled worker, as far as the waiting requests can tell.
    cluster = FakeCluster(scheduler("flowprefill", max_preemptions=0))
    cluster.join(0.0, "w0")
    cluster.arrive(0.0, "s_long", "standard", 4900)  # holds the worker for 4.9 s
    for i in range(3):
        cluster.arrive(0.1 + i * 0.1, f"b{i}", "batch", 3000)
    cluster.arrive(0.5, "c", "critical", 100)  # deadline 1.5 s: late long before s_long ends
    cluster.run()
    cluster.assert_all_accepted_completed()
    order = sorted(cluster.records, key=lambda rid: cluster.records[rid].first_token)
    assert order.index("c") < min(order.index(f"b{i}") for i in range(3))
