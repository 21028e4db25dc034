"""The worker's one runner: the batched engine's loop on one thread, commands in, events out.

The scheduler (in-process in the benchmark, behind the control stream in the worker process)
calls ``assign`` / ``assign_packed`` / ``resume`` / ``preempt`` / ``pause_decode`` / ``cancel``
from its own thread; everything the engine does is reported through ``emit`` (called on the
engine thread) as ``worker.events`` dataclasses. A single-request worker is this runner with
one KV slot and a batch of one (``BatchConfig``), not another code path. What the engine
thread does between commands:

- a request's prefill runs (chunked, preemptible at layer boundaries); when its first token is
  out it joins the decode batch (or waits for a free row) and the next prefill may start at
  once: a worker holds one prefill *and* a batch of decoding requests;
- ``assign_packed`` prefills several short prompts in one forward (``worker.packed_prefill``);
  the pack is one unit of work: a preempt or resume naming any member applies to all of it,
  and each member gets its own events;
- whenever no prefill waits, the batch takes one decode step after another; while prefills
  wait, it steps only when a row is due: before a prefill starts and inside it, the
  ``DecodeSlotter`` slots a step in (at a layer boundary) whenever a row would otherwise miss
  its tier's TBT target (``tbt_slo_s``, passed with the request; a row without one gets a step
  between every two prefill runs). Fewer, fuller steps: a step of several rows costs far less
  than as many steps of one. A step that is running when a prefill of a TBT target at least
  as tight as every row's is assigned (after a preemption, the beneficiary's) stops at its
  next layer boundary and keeps its activations;
  the prefill goes first, and the step is finished when a row is due or the prefill ends, so
  the wait for an interruption point is one layer of a step, not the whole step. A step is
  reported as one ``DecodeStepDone`` carrying every row's token. A prefill's reported time
  (``FirstToken.prefill_busy_s``) leaves the steps slotted into it out: the scheduler's
  predictor learns the prefill's own time, and the scheduler counts the slotted steps apart
  (``decode_batch.slotting_slowdown``). Learnt inside the prefill's time, a flood's decode
  rows made a calm key's short prompts look a quarter longer (docs/results.md);
- ``pause_decode`` (or a ``preempt`` of a decoding request) pauses it between steps (KV kept,
  counted against the memory cap; past it, dropped), reported as ``Preempted``; ``resume``
  joins it again, and a dropped one recomputes when assigned again, reported as
  ``DecodeRejoined``. Tokens are emitted once each: a recompute does not repeat them;
- once the engine has been idle for ``BatchConfig.kv_release_idle_s``, freed KV slots' memory
  is handed back to the OS (``KVPool.release_free``: not as each request ends, so that a
  decode step never copies K/V into pages the OS has to fault in).

The engine thread is the caller's (``run``: the worker process runs it on its main thread,
the one that loaded the model) or one of the runner's own (``start``: tests, and a benchmark's
further workers). On a CPU this matters. torch's OpenMP runtime (libgomp) keeps a pool of
threads for every thread that runs parallel ops, and a pool lives as long as its thread. The
worker's main thread has one from the moment it builds the engine (some of that is parallel
work). An engine on a second thread then makes a second pool, the pools' threads
outnumber two cores, and libgomp stops spin-waiting between parallel regions, so each of a
prefill's hundreds of small ops waits for its threads to wake: a lone 85-token prefill took
1.5x as long (docs/results.md, "One OpenMP pool per worker"). With one pool its threads do
spin between regions, which takes CPU from other processes on the same cores; the local stack,
where every service shares the machine, starts its workers with ``OMP_WAIT_POLICY=PASSIVE``
(``launch.local_stack``).

Every engine call happens on the engine thread; other threads only queue work, except that a
preempt or cancel of the running prefill raises the preemption channel at once, from the
caller's thread, so the layer loop sees it at its next boundary without waiting for any queue.
A lock makes "is this request the one running?" and "raise the channel" one step, and the
engine thread reads and clears the channel under the same lock when a run returns: a signal
left there (it came after the last checked boundary) is acted on then, and can never stop the
next request.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
import torch

from worker.batch_engine import BatchEngine, StepResult
from worker.busy_clock import BusyClock
from worker.decode_slotting import DecodeSlotter
from worker.engine import RunOutcome, RunStatus
from worker.events import (
    Cancelled,
    DecodeRejoined,
    DecodeStepDone,
    Failed,
    Finished,
    FirstToken,
    Preempted,
    Progress,
    RunnerEvent,
)
from worker.kv_pool import PoolFullError
from worker.packed_prefill import PackedPrefill
from worker.preemption import PreemptionChannel, Signal
from worker.request import GenerationRequest, InvalidRequestError
from worker.task import Phase, Task

log = structlog.get_logger(__name__)

NO_TARGET = float("inf")


@dataclass
class _Progress:
    busy_s: float = 0.0  # engine time spent on this request's prefill, all runs
    run_started: float = 0.0
    # The decode steps of other rows slotted into those runs: inside ``busy_s``, but not the
    # prefill's own time, which the scheduler's predictor learns (module docstring).
    slotted_s: float = 0.0


@dataclass
class _Entry:
    task: Task
    progress: _Progress
    tbt_slo_s: float  # inf: no target
    pack: PackedPrefill | None = None  # the pack it is prefilled in, while that pack lives


Work = str | PackedPrefill  # one request's prefill, or a pack's


class _Listener:
    """Turns engine callbacks into events, on the engine thread. Decode tokens are not
    reported one by one: a step's tokens go out together (``DecodeStepDone``)."""

    def __init__(self, runner: BatchRunner) -> None:
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
        """Its prefill's engine time, and the pack's size when it was prefilled in one."""
        runner = self.runner
        entry = runner._entries.get(task.request_id)
        if entry is None:  # no longer held (cancelled while its pack ran): nothing to report
            return
        now = time.perf_counter()
        progress = entry.progress
        busy = progress.busy_s + now - progress.run_started - progress.slotted_s
        pack = entry.pack
        size = len(pack.tasks) if pack is not None else 0
        tokens = sum(t.prompt_len for t in pack.tasks) if pack is not None else 0
        runner.emit(FirstToken(task.request_id, token_id, now, busy, task.prompt_len, tokens, size))

    def on_token(self, task: Task, token_id: int) -> None:
        pass


class BatchRunner:
    def __init__(
        self, engine: BatchEngine, emit: Callable[[RunnerEvent], None], name: str = "engine"
    ) -> None:
        self.engine = engine
        self.emit = emit
        self.channel = PreemptionChannel()
        self._commands: queue.Queue[tuple[str, object] | None] = queue.Queue()
        self._entries: dict[str, _Entry] = {}  # written on the engine thread only
        self._prefills: list[Work] = []  # ready to (continue to) prefill, in order
        self._waiting_rows: list[str] = []  # prefilled or resumed, waiting for a batch row
        self._lock = threading.Lock()
        self._running: frozenset[str] = frozenset()  # the prefill (or pack) on the engine now
        self._preempt_named: set[str] = set()  # the members of it that a Preempt named
        self._head: str | None = None  # its first request
        self._signalled_at = 0.0
        self._stopping = False
        # The tightest TBT target of the prefill work assigned since the engine thread last
        # read the commands: a decode step none of whose rows has a tighter target stops at its
        # next layer boundary for it (``_stops_for``, ``BatchEngine.decode_step``), so a
        # prefill of a tier at least as high waits one layer of the step, not all of it; the
        # step is finished when a row is due or the prefill ends.
        self._arrived_target = NO_TARGET
        self.busy = BusyClock()
        self._listener = _Listener(self)  # it reads self.engine and self._entries
        self.slotter = DecodeSlotter(engine, self._tbt_target, self._on_step)
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)
        self._loop_ended = threading.Event()
        self.engine_thread: threading.Thread | None = None  # the thread that runs the loop

    # ------------------------------------------------------------ commands (any thread)

    def start(self) -> BatchRunner:
        """Run the engine loop on a thread of its own (``run`` runs it on the caller's)."""
        self._thread.start()
        return self

    def run(self) -> None:
        """Run the engine loop on the calling thread until ``stop``. The worker process calls
        this from its main thread, which holds torch's only OpenMP pool (module docstring);
        ``start`` runs it on a thread of its own."""
        self.engine_thread = threading.current_thread()
        try:
            self._loop()
        finally:
            self._loop_ended.set()

    @property
    def alive(self) -> bool:
        """Whether the engine loop runs (it ends on stop(), or on a bug that killed it)."""
        return self.engine_thread is not None and not self._loop_ended.is_set()

    def stop(self) -> None:
        """End the engine loop after the commands queued before this; returns once it has
        ended (at once when called on the engine thread, or before the loop ever started:
        then the loop ends as soon as it starts)."""
        with self._lock:
            self._stopping = True
            if self._running:
                self.channel.cancel()
        self._commands.put(None)
        engine_thread = self.engine_thread
        if engine_thread is not None and threading.current_thread() is not engine_thread:
            self._loop_ended.wait()

    def assign(self, request: GenerationRequest, tbt_slo_s: float | None = None) -> None:
        """Queue a request; one this runner holds already (its state was dropped) recomputes."""
        target = NO_TARGET if tbt_slo_s is None else tbt_slo_s
        self._commands.put(("assign", (request, target)))
        self._arrived(target)

    def assign_packed(
        self, requests: Sequence[GenerationRequest], tbt_slo_s: Sequence[float | None]
    ) -> None:
        """Queue several whole prompts to prefill in one forward (one TBT target each)."""
        targets = [NO_TARGET if t is None else t for t in tbt_slo_s]
        self._commands.put(("assign_packed", (tuple(requests), tuple(targets))))
        self._arrived(min(targets, default=NO_TARGET))

    def resume(self, request_id: str) -> None:
        self._commands.put(("resume", request_id))
        # A suspended prefill's target, or a paused row's; read from this thread: one dict
        # lookup, at worst of an entry the engine thread is just removing (then no target).
        self._arrived(self._target_of(request_id))

    def _arrived(self, target: float) -> None:
        with self._lock:
            self._arrived_target = min(self._arrived_target, target)

    def preempt(self, request_id: str, *, drop_state: bool = False) -> bool:
        """Stop the running prefill (or pack) at its next boundary, or pause a decoding request
        between steps. Always True: a request that is neither is ignored by the engine thread."""
        with self._lock:
            self._signalled_at = time.perf_counter()
            if request_id in self._running:
                self.channel.preempt(drop_state=drop_state)
                self._preempt_named.add(request_id)
                return True
        self._commands.put(("pause", (request_id, drop_state)))
        return True

    def pause_decode(self, request_id: str, *, drop_state: bool = False) -> None:
        """Take a decoding request out of the batch between steps (``preempt`` does the same
        for a request that is not prefilling now)."""
        self.preempt(request_id, drop_state=drop_state)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if self._running == {request_id}:
                self.channel.cancel()
                return
        # Queued, suspended, decoding, or one member of a running pack (the pack goes on for
        # the others; this one is freed when it ends).
        self._commands.put(("cancel", request_id))

    @property
    def listener(self) -> _Listener:
        """The engine listener this runner passes to every run (it emits the events)."""
        return self._listener

    @property
    def running_request_id(self) -> str | None:
        return self._head

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
                self._run_work(self._prefills.pop(0))
                self._admit_rows()
            if self._step_before_next_prefill():
                # A prefill of a tier at least as high assigned meanwhile (after a preemption,
                # the beneficiary's) stops the step at its next layer boundary.
                rows = min(map(self._tbt_target, self.engine.rows), default=NO_TARGET)
                self.slotter.step(stop=lambda rows=rows: self._stops_for(rows))
                self._admit_rows()

    def _stops_for(self, rows_target: float) -> bool:
        """Whether the prefill work assigned since the commands were last read goes before
        the rest of a step whose tightest row target is ``rows_target``: it has a TBT target
        (the tier order the worker knows), at least as tight. Without one, nothing ranks it
        above the rows, and stopping could hold a row's next token for a whole prefill."""
        arrived = self._arrived_target
        return arrived < NO_TARGET and arrived <= rows_target

    def _step_before_next_prefill(self) -> bool:
        """Always when no prefill waits. While prefills wait, the slotter steps rows when they
        are due; only a row without a TBT target (nothing would ever make it due) gets a step
        between every two prefill runs."""
        if not self.engine.rows or self._stopping:
            return False
        if not self._prefills:
            return True
        return any(self._tbt_target(task) == NO_TARGET for task in self.engine.rows)

    def _apply_commands(self, *, block: bool) -> bool:
        """Apply queued commands (``block``: waiting for the first); False when the runner is
        stopping."""
        while True:
            try:
                item = self._next_command() if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            # Reset once a command is taken: a put after this sets it again, and a put before
            # it is taken by this loop, which reads the queue until it is empty.
            with self._lock:
                self._arrived_target = NO_TARGET
            if item is None:
                self._cancel_all()
                return False
            kind, arg = item
            getattr(self, f"_on_{kind}")(arg)
            block = False

    def _next_command(self) -> tuple[str, object] | None:
        """Wait for a command; an engine idle for ``kv_release_idle_s`` meanwhile hands its
        freed KV memory back first (``KVPool.release_free``)."""
        pool = self.engine.pool
        if pool.retained_slots:
            try:
                return self._commands.get(timeout=self.engine.batch_config.kv_release_idle_s)
            except queue.Empty:
                pool.release_free()
        return self._commands.get()

    def _on_assign(self, arg) -> None:
        request, target = arg
        task = self._task_for(request, target)
        if task is not None:
            self._prefills.append(request.request_id)

    def _task_for(self, request: GenerationRequest, target: float) -> Task | None:
        """The request's task: the one held (its state was dropped) or a new one; None when
        the request is invalid (reported as Failed)."""
        rid = request.request_id
        known = self._entries.get(rid)
        if known is not None:
            known.pack = None
            return known.task
        try:
            task = self.engine.new_task(request)
        except InvalidRequestError as exc:
            self.emit(Failed(rid, str(exc), True, time.perf_counter()))
            return None
        self._entries[rid] = _Entry(task, _Progress(), target)
        return task

    def _on_assign_packed(self, arg) -> None:
        requests, targets = arg
        tasks = [self._task_for(r, t) for r, t in zip(requests, targets, strict=True)]
        packable = [t for t in tasks if t is not None and t.phase is Phase.QUEUED]
        alone = [t for t in tasks if t is not None and t.phase is not Phase.QUEUED]
        if len(packable) > 1:
            pack = PackedPrefill(tuple(packable))
            for task in packable:
                self._entries[task.request_id].pack = pack
            self._prefills.append(pack)
        else:
            alone = packable + alone
        self._prefills.extend(t.request_id for t in alone)

    def _on_resume(self, rid: str) -> None:
        entry = self._entries.get(rid)
        if entry is None:
            return
        if entry.task.phase is Phase.DECODE:
            if self.engine.in_batch(entry.task) or rid in self._waiting_rows:
                # Never paused here (the scheduler's view was behind): it decodes already.
                log.warning("resume of a request that is decoding ignored", request_id=rid)
                return
            self._waiting_rows.append(rid)
            self._admit_rows()
        elif entry.pack is not None:
            if entry.pack not in self._prefills:  # a Resume of any member resumes the pack
                self._prefills.append(entry.pack)
        else:
            self._prefills.append(rid)

    def _on_pause(self, arg) -> None:
        rid, drop_state = arg
        entry = self._entries.get(rid)
        if entry is None:
            return
        task = entry.task
        if task.phase is not Phase.DECODE:
            work = entry.pack or rid
            if work in self._prefills:  # queued behind a decode step: stopped before it ran
                self._stop_queued(work, drop_state)
            return
        if rid in self._waiting_rows:
            self._waiting_rows.remove(rid)
        kept = self.engine.pause(task, drop_state=drop_state)
        self.slotter.forget(task)
        now = time.perf_counter()
        held = task.held_bytes()
        self.emit(Preempted(rid, task.resume_point(), held, not kept, now, self._signalled_at))

    def _stop_queued(self, work: Work, drop_state: bool) -> None:
        """Acknowledge a preemption of a prefill (or pack) that waited for the engine thread."""
        self._prefills.remove(work)
        pack = work if isinstance(work, PackedPrefill) else None
        tasks = self._live(pack.tasks) if pack is not None else [self._entries[work].task]
        if drop_state and pack is not None and pack.state is not None:
            pack.state = None
            for task in tasks:
                self._drop(task)
        elif drop_state and pack is None and tasks[0].state is not None:
            self.engine.memory.release(tasks[0].request_id)
            self._drop(tasks[0])
        now = time.perf_counter()
        for task in tasks:
            task.preemptions += 1
            dropped = task.state is None  # nothing held: it starts from token 0 when assigned
            if dropped:
                self._entries[task.request_id].pack = None
            held = task.held_bytes()
            rid = task.request_id
            self.emit(Preempted(rid, task.resume_point(), held, dropped, now, self._signalled_at))

    def _drop(self, task: Task) -> None:
        self.engine._free(task)
        task.phase = Phase.QUEUED
        task.chunks = self.engine.chunks_of(len(task.prefill_ids))
        task.recomputes += 1

    def _on_cancel(self, rid: str) -> None:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return
        for pending in (self._prefills, self._waiting_rows):
            while rid in pending:
                pending.remove(rid)
        pack = entry.pack
        if pack is not None and not self._live(pack.tasks) and pack in self._prefills:
            self._prefills.remove(pack)  # nobody left in it
        self.engine.cancel(entry.task)
        self.slotter.forget(entry.task)
        self.emit(Cancelled(rid, time.perf_counter()))

    def _cancel_all(self) -> None:
        for rid in list(self._entries):
            self._on_cancel(rid)

    def _live(self, tasks: Sequence[Task]) -> list[Task]:
        """The tasks still held (not cancelled or failed since the pack was formed)."""
        return [t for t in tasks if self._entries.get(t.request_id, None) is not None]

    def _admit_rows(self) -> None:
        """Waiting rows join the batch, the tightest TBT target first (in arrival order among
        equal targets). A full batch makes room for a row whose target is tighter than some
        row's in it: a critical request must not wait for lower-tier rows to finish."""
        limit = self.engine.batch_config.max_batch_size
        self._waiting_rows.sort(key=self._target_of)
        while self._waiting_rows:
            entry = self._entries.get(self._waiting_rows[0])
            if entry is None or entry.task.phase is not Phase.DECODE:
                self._waiting_rows.pop(0)
                continue
            if len(self.engine.rows) >= limit and not self._make_room(entry.tbt_slo_s):
                return
            self._waiting_rows.pop(0)
            self.engine.join(entry.task)
            self.slotter.joined(entry.task)

    def _make_room(self, target: float) -> bool:
        """Take the row with the loosest TBT target out of the batch if that target is looser
        than ``target``. It keeps its cache and waits first among the rows of its target (a
        full batch's waiting rows are not paused: nothing is freed or counted anew)."""
        loosest = max(reversed(self.engine.rows), key=self._tbt_target)
        if self._tbt_target(loosest) <= target:
            return False
        self.engine.leave(loosest)
        self.slotter.forget(loosest)
        self._waiting_rows.insert(1, loosest.request_id)  # after the row it makes room for
        return True

    def _tbt_target(self, task: Task) -> float:
        return self._target_of(task.request_id)

    def _target_of(self, rid: str) -> float:
        entry = self._entries.get(rid)
        return entry.tbt_slo_s if entry is not None else NO_TARGET

    def _on_step(self, result: StepResult) -> None:
        if not result.slotted:
            self.busy.add(result.seconds)
        for rid in self._running if result.slotted else ():
            if (entry := self._entries.get(rid)) is not None:
                entry.progress.slotted_s += result.seconds
        if result.tasks:
            self.emit(
                DecodeStepDone(
                    tuple(t.request_id for t in result.tasks),
                    result.tokens,
                    tuple(len(t.output_ids) - 1 for t in result.tasks),
                    result.step_seconds,
                    result.slotted,
                    time.perf_counter(),
                )
            )
        for task in result.finished:
            self._finish(task)

    def _finish(self, task: Task) -> None:
        entry = self._entries.pop(task.request_id)
        self.emit(
            Finished(
                task.request_id, tuple(task.output_ids), entry.progress.busy_s,
                task.preemptions, time.perf_counter(),
            )
        )  # fmt: skip

    # ------------------------------------------------------------ one prefill run

    def _run_work(self, work: Work) -> None:
        """One prefill run of ``work``, to its first tokens or until a preemption or cancel."""
        pack = work if isinstance(work, PackedPrefill) else None
        tasks = self._live(pack.tasks) if pack is not None else self._live_one(work)
        if not tasks:
            return
        ids = [t.request_id for t in tasks]
        recompute = pack is None and bool(tasks[0].output_ids)  # a dropped decode, again
        with self._lock:
            self._running, self._head = frozenset(ids), ids[0]
            self._preempt_named = set()
        started = time.perf_counter()
        for rid in ids:
            self._entries[rid].progress.run_started = started
        self.busy.start(started)
        # Inside it, only rows as urgent as its most urgent member get a step slotted in.
        self.slotter.prefill_started(min(self._target_of(rid) for rid in ids))
        outcome, error = self._run_engine(pack, tasks[0])
        now = time.perf_counter()
        self.busy.stop(now)  # the decode steps slotted into this run are inside it
        for rid in ids:
            progress = self._entries[rid].progress
            progress.busy_s += now - progress.run_started
        with self._lock:
            self._running, self._head = frozenset(), None
            signal = self.channel.signal
            named = self._preempt_named
            self.channel.clear()
        stopped = outcome is not None and outcome.status is RunStatus.PREEMPTED
        if signal is Signal.CANCEL:
            # Left on the channel: the Cancel came after the engine stopped for a preemption,
            # or after the prefill's last checked boundary (its first token is out). Either
            # way the scheduler has freed the request's slot; it must not join the batch.
            for rid in ids:
                self._on_cancel(rid)
            return
        for task in self._live(tasks):
            self._report(task, pack, outcome, error, now, recompute)
        if signal in (Signal.PREEMPT, Signal.PREEMPT_DROP) and outcome is not None and not stopped:
            # The Preempt came after the last checked boundary (at chunk ends only, or just as
            # the prefill ended): the first tokens are out, so it pauses those requests, as a
            # PauseDecode would; the scheduler waits for that acknowledgement. Only the members
            # the Preempt named: the scheduler may already count another member of a pack as
            # decoding (its first token came first), and would never hear of it again.
            drop = signal is Signal.PREEMPT_DROP
            for task in self._live(tasks):
                if task.phase is Phase.DECODE and task.request_id in named:
                    self._on_pause((task.request_id, drop))

    def _live_one(self, rid: str) -> list[Task]:
        entry = self._entries.get(rid)
        return [entry.task] if entry is not None else []

    def _run_engine(self, pack: PackedPrefill | None, task: Task):
        """(outcome, None) or (None, error): a model error fails the request, not the worker."""
        try:
            args = (self.channel, self._listener, self.slotter)
            if pack is not None:
                return self.engine.run_packed(pack, *args), None
            return self.engine.prefill(task, *args), None
        except PoolFullError as exc:
            return None, f"{exc}; retry when a request finishes"
        except Exception as exc:
            return None, f"{type(exc).__name__}: {exc}"

    def _report(
        self,
        task: Task,
        pack: PackedPrefill | None,
        outcome: RunOutcome | None,
        error: str | None,
        now: float,
        recompute: bool,
    ) -> None:
        rid = task.request_id
        entry = self._entries[rid]
        if outcome is None:
            self._entries.pop(rid, None)
            self.emit(Failed(rid, error or "failed", False, now))
        elif outcome.status is RunStatus.PREEMPTED:
            held, point = outcome.held_bytes, outcome.resume_point
            if pack is not None:
                held = 0 if outcome.state_dropped else pack.held_bytes()[rid]
                if outcome.state_dropped:
                    entry.pack = None
            dropped = outcome.state_dropped
            self.emit(Preempted(rid, point, held, dropped, now, self._signalled_at))
        elif outcome.status is RunStatus.CANCELLED:
            self._entries.pop(rid, None)
            self.emit(Cancelled(rid, now))
        elif task.phase is Phase.FINISHED:  # its first token was its last
            self._finish(task)
        else:  # PREFILLED: decode with the batch
            entry.pack = None
            if recompute:
                self.emit(DecodeRejoined(rid, len(task.prefill_ids), now))
            self._waiting_rows.append(rid)
