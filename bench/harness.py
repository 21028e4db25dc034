"""One policy, one workload, in one process: the real scheduler driving real engine threads.

The main thread is the scheduler's event loop. It blocks on one queue that the engine runners
fill with their events, with a timeout that expires exactly when the next arrival is due, so it
wakes only on events (arrival, chunk done, first token, preemption acknowledged, done) and never
polls. Each event goes through ``Scheduler.handle``; the commands that come back are applied to
the runners at once (a Preempt raises the engine's preemption channel from this thread).

Times: arrivals are replayed on the wall clock (``time.perf_counter``); TTFT is the first-token
timestamp taken on the engine thread minus the arrival time.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.workload import Arrival, Workload, prompt_ids
from queue_service.scheduler import (
    Assign,
    Cancel,
    Preempt,
    PreemptionAcked,
    PrefillFinished,
    PrefillProgress,
    Reject,
    RequestArrived,
    RequestDone,
    Resume,
    Scheduler,
    WorkerJoined,
)
from worker.engine import PrefillEngine
from worker.events import ChunkDone, Failed, Finished, FirstToken, Preempted
from worker.request import GenerationRequest
from worker.runner import EngineRunner


@dataclass
class RequestRecord:
    arrival: Arrival
    arrived_at: float = 0.0  # wall clock (perf_counter)
    first_token_at: float | None = None
    done_at: float | None = None
    rejected: str | None = None
    failed: str | None = None
    preemptions: int = 0
    recomputes: int = 0
    busy_s: float = 0.0
    first_token: int | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrived_at


@dataclass
class RunResult:
    policy: str
    records: dict[str, RequestRecord]
    preemption_latencies_s: list[float] = field(default_factory=list)
    busy_s: float = 0.0
    makespan_s: float = 0.0


def run_policy(
    scheduler: Scheduler,
    engines: list[PrefillEngine],
    workload: Workload,
    *,
    vocab_size: int,
    on_progress: Callable[[], None] = lambda: None,
    max_idle_s: float = 600.0,
) -> RunResult:
    events: queue.Queue = queue.Queue()
    runners = {
        f"w{i}": EngineRunner(engine, (lambda e, w=f"w{i}": events.put((w, e))), name=f"w{i}")
        for i, engine in enumerate(engines)
    }
    for r in runners.values():
        r.start()
    records = {a.request_id: RequestRecord(a) for a in workload.arrivals}
    result = RunResult(scheduler.policy.name, records)
    started_on: dict[str, set[str]] = {w: set() for w in runners}  # requests a runner knows
    pending = list(workload.arrivals)
    unfinished = len(pending)
    start = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - start

    def apply(commands) -> None:
        nonlocal unfinished
        for cmd in commands:
            if isinstance(cmd, Assign):
                runner = runners[cmd.worker_id]
                if cmd.request_id in started_on[cmd.worker_id]:
                    runner.resume(cmd.request_id)  # its state was dropped: recompute
                else:
                    started_on[cmd.worker_id].add(cmd.request_id)
                    arrival = records[cmd.request_id].arrival
                    runner.assign(
                        GenerationRequest(
                            cmd.request_id,
                            prompt_ids(arrival, vocab_size),
                            max_new_tokens=arrival.max_new_tokens,
                            stop_at_eos=False,
                        )
                    )
            elif isinstance(cmd, Resume):
                runners[cmd.worker_id].resume(cmd.request_id)
            elif isinstance(cmd, Preempt):
                runners[cmd.worker_id].preempt(cmd.request_id, drop_state=cmd.drop_state)
            elif isinstance(cmd, Cancel):
                runners[cmd.worker_id].cancel(cmd.request_id)
            elif isinstance(cmd, Reject):
                records[cmd.request_id].rejected = cmd.reason
                unfinished -= 1

    try:
        for worker_id in runners:
            apply(scheduler.handle(WorkerJoined(worker_id), now()))
        while unfinished > 0:
            timeout = max_idle_s if not pending else max(0.0, pending[0].at_s - now())
            try:
                worker_id, event = events.get(timeout=timeout)
            except queue.Empty:
                if not pending:
                    raise TimeoutError(f"{unfinished} requests unfinished after idling") from None
                arrival = pending.pop(0)
                records[arrival.request_id].arrived_at = time.perf_counter()
                apply(
                    scheduler.handle(
                        RequestArrived(
                            arrival.request_id,
                            arrival.tier,
                            arrival.prompt_tokens,
                            arrival.max_new_tokens,
                        ),
                        now(),
                    )
                )
                continue
            record = records[event.request_id]
            if isinstance(event, ChunkDone):
                scheduler_event = PrefillProgress(event.request_id, worker_id, event.tokens_done)
            elif isinstance(event, FirstToken):
                record.first_token_at = event.at
                record.first_token = event.token_id
                scheduler_event = PrefillFinished(
                    event.request_id, worker_id, event.prompt_tokens, event.prefill_busy_s
                )
            elif isinstance(event, Preempted):
                record.preemptions += 1
                record.recomputes += event.state_dropped
                result.preemption_latencies_s.append(event.at - event.signalled_at)
                scheduler_event = PreemptionAcked(
                    event.request_id,
                    worker_id,
                    event.resume_point.tokens_done,
                    event.state_dropped,
                )
            elif isinstance(event, Finished | Failed):
                if isinstance(event, Failed):
                    record.failed = event.error
                else:
                    record.busy_s = event.busy_s
                    result.busy_s += event.busy_s
                record.done_at = event.at
                unfinished -= 1
                on_progress()
                scheduler_event = RequestDone(event.request_id, worker_id)
            else:  # Cancelled / TokenOut: nothing for the scheduler to decide
                continue
            apply(scheduler.handle(scheduler_event, now()))
    finally:
        for r in runners.values():
            r.stop()
    result.makespan_s = time.perf_counter() - start
    return result
