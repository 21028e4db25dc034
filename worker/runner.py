"""One engine on its own thread: commands in, events out.

The scheduler (in-process in the benchmark, behind the control stream in the worker process)
calls ``assign``/``resume``/``preempt``/``cancel`` from its own thread. ``assign`` and ``resume``
queue work for the engine thread; ``preempt`` and ``cancel`` of the running request raise the
preemption channel at once, from the caller's thread, so the layer loop sees it at its next
boundary without waiting for any queue. Everything the engine does is reported through
``emit`` (called on the engine thread) as ``worker.events`` dataclasses.

A lock makes "is this request the one running?" and "raise the channel" one step, and the
engine thread clears the channel under the same lock when a run returns, so a preemption that
arrives just after its target finished can never stop the next request.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.busy_clock import BusyClock
from worker.engine import PrefillEngine, RunOutcome, RunStatus
from worker.events import (
    Cancelled,
    Failed,
    Finished,
    FirstToken,
    Preempted,
    Progress,
    RunnerEvent,
    TokenOut,
)
from worker.preemption import PreemptionChannel, Signal
from worker.request import GenerationRequest, InvalidRequestError
from worker.task import Task


@dataclass
class _Progress:
    busy_s: float = 0.0  # engine time spent so far, all runs
    run_started: float = 0.0


class _Listener:
    """Turns engine callbacks into events; carries per-run timing."""

    def __init__(self, runner: EngineRunner) -> None:
        self.runner = runner

    def on_chunk_done(self, task: Task, tokens_done: int) -> None:
        self.runner.emit(
            Progress(task.request_id, tokens_done, task.prompt_len, time.perf_counter())
        )

    def on_layers_done(self, task: Task, chunk: int, layers_done: int) -> None:
        start, end = task.chunks[chunk]
        n_layers = len(self.runner.engine.layers)
        self.runner.emit(
            Progress(
                task.request_id, start, task.prompt_len, time.perf_counter(),
                layers_done, n_layers, end,
            )
        )  # fmt: skip

    def on_first_token(self, task: Task, token_id: int, logits: torch.Tensor) -> None:
        now = time.perf_counter()
        progress = self.runner._progress[task.request_id]
        busy = progress.busy_s + now - progress.run_started
        self.runner.emit(FirstToken(task.request_id, token_id, now, busy, task.prompt_len))

    def on_token(self, task: Task, token_id: int) -> None:
        index = len(task.output_ids) - 1  # the engine appended it before telling
        self.runner.emit(TokenOut(task.request_id, token_id, time.perf_counter(), index))


class EngineRunner:
    def __init__(
        self, engine: PrefillEngine, emit: Callable[[RunnerEvent], None], name: str = "engine"
    ) -> None:
        self.engine = engine
        self.emit = emit
        self.channel = PreemptionChannel()
        # ("run", request_id) or ("cancel", task) for the engine thread; None stops it.
        self._work: queue.Queue[tuple[str, object] | None] = queue.Queue()
        self._tasks: dict[str, Task] = {}  # assigned and not yet finished/cancelled
        self._progress: dict[str, _Progress] = {}
        self._lock = threading.Lock()
        self._running: str | None = None
        self._signalled_at = 0.0
        self.busy = BusyClock()
        self._listener = _Listener(self)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    # ------------------------------------------------------------ commands (any thread)

    def start(self) -> EngineRunner:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            if self._running is not None:
                self.channel.cancel()
        self._work.put(None)
        self._thread.join()

    def assign(self, request: GenerationRequest) -> None:
        """Queue a new request; one this runner holds already (its state was dropped for
        recompute) runs again from token 0."""
        with self._lock:
            known = request.request_id in self._tasks
        if known:
            self._work.put(("run", request.request_id))
            return
        try:
            task = self.engine.new_task(request)
        except InvalidRequestError as exc:
            self.emit(Failed(request.request_id, str(exc), True, time.perf_counter()))
            return
        with self._lock:
            self._tasks[request.request_id] = task
            self._progress[request.request_id] = _Progress()
        self._work.put(("run", request.request_id))

    def resume(self, request_id: str) -> None:
        self._work.put(("run", request_id))

    def preempt(self, request_id: str, *, drop_state: bool = False) -> bool:
        """Stop ``request_id`` at its next boundary. False if it is not running now."""
        with self._lock:
            if self._running != request_id:
                return False
            self._signalled_at = time.perf_counter()
            self.channel.preempt(drop_state=drop_state)
            return True

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if self._running == request_id:
                self.channel.cancel()
                return
            task = self._tasks.pop(request_id, None)  # a queued "run" of it is now skipped
            self._progress.pop(request_id, None)
        if task is not None:
            # Queued or suspended: the engine thread frees it, as it alone touches the engine.
            self._work.put(("cancel", task))

    @property
    def listener(self) -> _Listener:
        """The engine listener this runner passes to every run (it emits the events)."""
        return self._listener

    @property
    def running_request_id(self) -> str | None:
        return self._running

    @property
    def suspended_bytes(self) -> int:
        return self.engine.suspended_bytes

    # ------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        while (item := self._work.get()) is not None:
            kind, arg = item
            if kind == "cancel":
                assert isinstance(arg, Task)
                self.engine.cancel(arg)
                self.emit(Cancelled(arg.request_id, time.perf_counter()))
            else:
                assert isinstance(arg, str)
                self._run(arg)

    def _run(self, request_id: str) -> None:
        with self._lock:
            task = self._tasks.get(request_id)
            if task is None:  # cancelled while queued
                return
            self._running = request_id
            progress = self._progress[request_id]
        progress.run_started = time.perf_counter()
        self.busy.start(progress.run_started)
        try:
            outcome = self.engine.run(task, self.channel, self._listener)
        except Exception as exc:  # a model error fails this request, not the worker
            outcome = None
            error = f"{type(exc).__name__}: {exc}"
        now = time.perf_counter()
        progress.busy_s += now - progress.run_started
        self.busy.stop(now)
        with self._lock:
            self._running = None
            # A cancel that arrived after the engine stopped (for a preemption) but before this
            # point found the request still "running" and only raised the channel: honour it.
            late_cancel = self.channel.signal is Signal.CANCEL
            self.channel.clear()
            signalled_at = self._signalled_at
            if late_cancel and outcome is not None and outcome.status is RunStatus.PREEMPTED:
                self.engine.cancel(task)
                outcome = RunOutcome(RunStatus.CANCELLED)
            if outcome is None or outcome.status is not RunStatus.PREEMPTED:
                self._tasks.pop(request_id, None)
                self._progress.pop(request_id, None)
        if outcome is None:
            self.emit(Failed(request_id, error, False, now))
        elif outcome.status is RunStatus.PREEMPTED:
            assert outcome.resume_point is not None
            self.emit(
                Preempted(
                    request_id,
                    outcome.resume_point,
                    outcome.held_bytes,
                    outcome.state_dropped,
                    now,
                    signalled_at,
                )
            )
        elif outcome.status is RunStatus.CANCELLED:
            self.emit(Cancelled(request_id, now))
        else:
            self.emit(
                Finished(request_id, tuple(task.output_ids), progress.busy_s, task.preemptions, now)
            )
