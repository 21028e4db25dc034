"""The batched engine on its own thread: prefills one at a time, decode for all at once.

Same commands and events as ``worker.runner.EngineRunner`` (assign / resume / preempt /
cancel in; ``worker.events`` out), so the dispatcher's handles can drive either, plus
``pause_decode``. What changes is what the engine thread does between commands:

- a request's prefill runs (chunked, preemptible at layer boundaries, as before); when its
  first token is out it joins the decode batch (or waits for a free row) and the next prefill
  may start at once: a worker now holds one prefill *and* a batch of decoding requests;
- between two prefill runs, and whenever no prefill waits, the batch takes one decode step;
  inside a long prefill the ``DecodeSlotter`` slots a step in at a layer boundary whenever a
  row would otherwise miss its tier's TBT target (``tbt_slo_s``, passed with the request);
- ``preempt`` of a decoding request pauses it between steps (KV kept, counted against the
  memory cap; past it, dropped), reported as ``Preempted``; ``resume`` joins it again, and a
  dropped one recomputes first. Tokens are emitted once each: a recompute does not repeat them.

Every engine call happens on the engine thread; other threads only queue work, except that a
preempt or cancel of the running prefill raises the channel at once (as in ``EngineRunner``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from worker.batch_engine import BatchEngine, StepResult
from worker.decode_slotting import DecodeSlotter
from worker.engine import RunStatus
from worker.events import (
    Cancelled,
    Failed,
    Finished,
    Preempted,
    RunnerEvent,
)
from worker.kv_pool import PoolFullError
from worker.preemption import PreemptionChannel, Signal
from worker.request import GenerationRequest, InvalidRequestError
from worker.runner import _Listener, _Progress
from worker.task import Phase, Task


@dataclass
class _Entry:
    task: Task
    progress: _Progress
    tbt_slo_s: float  # inf: no target


class BatchRunner:
    def __init__(
        self, engine: BatchEngine, emit: Callable[[RunnerEvent], None], name: str = "engine"
    ) -> None:
        self.engine = engine
        self.emit = emit
        self.channel = PreemptionChannel()
        self._commands: queue.Queue[tuple[str, object] | None] = queue.Queue()
        self._entries: dict[str, _Entry] = {}  # engine thread only
        self._prefills: list[str] = []  # ready to (continue to) prefill, in order
        self._waiting_rows: list[str] = []  # prefilled or resumed, waiting for a batch row
        self._lock = threading.Lock()
        self._running: str | None = None  # the prefill on the engine now
        self._signalled_at = 0.0
        self._stopping = False
        self._listener = _Listener(self)  # it reads self.engine and self._progress
        self._progress: dict[str, _Progress] = {}
        self.slotter = DecodeSlotter(engine, self._tbt_target, self._on_step, self._listener)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    # ------------------------------------------------------------ commands (any thread)

    def start(self) -> BatchRunner:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            if self._running is not None:
                self.channel.cancel()
        self._commands.put(None)
        self._thread.join()

    def assign(self, request: GenerationRequest, tbt_slo_s: float | None = None) -> None:
        target = float("inf") if tbt_slo_s is None else tbt_slo_s
        self._commands.put(("assign", (request, target)))

    def resume(self, request_id: str) -> None:
        self._commands.put(("resume", request_id))

    def preempt(self, request_id: str, *, drop_state: bool = False) -> bool:
        """Stop the running prefill at its next boundary, or pause a decoding request
        between steps. Always True: a request that is neither is ignored by the engine thread."""
        with self._lock:
            self._signalled_at = time.perf_counter()
            if self._running == request_id:
                self.channel.preempt(drop_state=drop_state)
                return True
        self._commands.put(("pause", (request_id, drop_state)))
        return True

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if self._running == request_id:
                self.channel.cancel()
                return
        self._commands.put(("cancel", request_id))

    @property
    def running_request_id(self) -> str | None:
        return self._running

    @property
    def suspended_bytes(self) -> int:
        return self.engine.suspended_bytes

    # ------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        while True:
            busy = bool(self._prefills or self.engine.rows)
            if not self._apply_commands(block=not busy):
                return
            if self._prefills:
                self._run_prefill(self._prefills.pop(0))
                self._admit_rows()
            if self.engine.rows and not self._stopping:
                self.slotter.step()
                self._admit_rows()

    def _apply_commands(self, *, block: bool) -> bool:
        """Apply queued commands; False when the runner is stopping."""
        while True:
            try:
                item = self._commands.get(block=block)
            except queue.Empty:
                return True
            if item is None:
                self._cancel_all()
                return False
            kind, arg = item
            getattr(self, f"_on_{kind}")(arg)
            block = False

    def _on_assign(self, arg) -> None:
        request, target = arg
        rid = request.request_id
        known = self._entries.get(rid)
        if known is not None:  # its state was dropped: prefill again (tokens are not repeated)
            self._prefills.append(rid)
            return
        try:
            task = self.engine.new_task(request)
        except InvalidRequestError as exc:
            self.emit(Failed(rid, str(exc), True, time.perf_counter()))
            return
        self._entries[rid] = _Entry(task, _Progress(), target)
        self._progress[rid] = self._entries[rid].progress
        self._prefills.append(rid)

    def _on_resume(self, rid: str) -> None:
        entry = self._entries.get(rid)
        if entry is None:
            return
        if entry.task.phase is Phase.DECODE:
            self._waiting_rows.append(rid)
            self._admit_rows()
        else:
            self._prefills.append(rid)

    def _on_pause(self, arg) -> None:
        rid, drop_state = arg
        entry = self._entries.get(rid)
        if entry is None:
            return
        task = entry.task
        if task.phase is not Phase.DECODE:
            if rid in self._prefills:  # queued behind a decode step: stopped before it ran
                self._stop_queued_prefill(task, drop_state)
            return
        if rid in self._waiting_rows:
            self._waiting_rows.remove(rid)
        kept = self.engine.pause(task, drop_state=drop_state)
        self.slotter.forget(task)
        now = time.perf_counter()
        held = task.held_bytes()
        self.emit(Preempted(rid, task.resume_point(), held, not kept, now, self._signalled_at))

    def _stop_queued_prefill(self, task: Task, drop_state: bool) -> None:
        """Acknowledge a preemption of a prefill that was waiting for the engine thread."""
        rid = task.request_id
        self._prefills.remove(rid)
        task.preemptions += 1
        if drop_state and task.state is not None:
            self.engine.memory.release(rid)
            self.engine._free(task)
            task.phase = Phase.QUEUED
            task.chunks = self.engine.chunks_of(len(task.prefill_ids))
            task.recomputes += 1
        now = time.perf_counter()
        dropped = task.state is None  # nothing held: it starts from token 0 when assigned
        held = task.held_bytes()
        self.emit(Preempted(rid, task.resume_point(), held, dropped, now, self._signalled_at))

    def _on_cancel(self, rid: str) -> None:
        entry = self._entries.pop(rid, None)
        self._progress.pop(rid, None)
        if entry is None:
            return
        for pending in (self._prefills, self._waiting_rows):
            while rid in pending:
                pending.remove(rid)
        self.engine.cancel(entry.task)
        self.slotter.forget(entry.task)
        self.emit(Cancelled(rid, time.perf_counter()))

    def _cancel_all(self) -> None:
        for rid in list(self._entries):
            self._on_cancel(rid)

    def _admit_rows(self) -> None:
        limit = self.engine.batch_config.max_batch_size
        while self._waiting_rows and len(self.engine.rows) < limit:
            rid = self._waiting_rows.pop(0)
            entry = self._entries.get(rid)
            if entry is None or entry.task.phase is not Phase.DECODE:
                continue
            self.engine.join(entry.task)
            self.slotter.joined(entry.task)

    def _tbt_target(self, task: Task) -> float:
        entry = self._entries.get(task.request_id)
        return entry.tbt_slo_s if entry is not None else float("inf")

    def _on_step(self, result: StepResult) -> None:
        for task in result.finished:
            self._finish(task)

    def _finish(self, task: Task) -> None:
        entry = self._entries.pop(task.request_id)
        self._progress.pop(task.request_id, None)
        self.emit(
            Finished(
                task.request_id, tuple(task.output_ids), entry.progress.busy_s,
                task.preemptions, time.perf_counter(),
            )
        )  # fmt: skip

    def _run_prefill(self, rid: str) -> None:
        entry = self._entries.get(rid)
        if entry is None:
            return
        with self._lock:
            self._running = rid
        entry.progress.run_started = time.perf_counter()
        self.slotter.prefill_started()
        try:
            outcome = self.engine.prefill(entry.task, self.channel, self._listener, self.slotter)
            error = None
        except PoolFullError as exc:
            outcome, error = None, f"{exc}; retry when a request finishes"
        except Exception as exc:  # a model error fails this request, not the worker
            outcome, error = None, f"{type(exc).__name__}: {exc}"
        now = time.perf_counter()
        entry.progress.busy_s += now - entry.progress.run_started
        with self._lock:
            self._running = None
            late_cancel = self.channel.signal is Signal.CANCEL
            self.channel.clear()
        if late_cancel and outcome is not None and outcome.status is RunStatus.PREEMPTED:
            self._on_cancel(rid)
            return
        self._report(rid, entry, outcome, error, now)

    def _report(self, rid: str, entry: _Entry, outcome, error: str | None, now: float) -> None:
        if outcome is None:
            self._entries.pop(rid, None)
            self._progress.pop(rid, None)
            self.emit(Failed(rid, error or "failed", False, now))
        elif outcome.status is RunStatus.PREEMPTED:
            self.emit(
                Preempted(
                    rid,
                    outcome.resume_point,
                    outcome.held_bytes,
                    outcome.state_dropped,
                    now,
                    self._signalled_at,
                )
            )
        elif outcome.status is RunStatus.CANCELLED:
            self._entries.pop(rid, None)
            self._progress.pop(rid, None)
            self.emit(Cancelled(rid, now))
        elif outcome.status is RunStatus.FINISHED:
            self._finish(entry.task)
        else:  # PREFILLED: decode with the batch
            self._waiting_rows.append(rid)
