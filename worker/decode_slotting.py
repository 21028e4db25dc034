"""Decode steps slotted into a long prefill at its boundaries, when a row would miss its TBT.

While one long prefill runs, the decode batch would otherwise wait for all of it: the time
between tokens (TBT) of every decoding request becomes the prefill's time. The slotter is the
prefill's ``between_layers`` hook: at each boundary (a row block, a half, a layer; the engine's
row blocks each fit its preemption budget, ``worker.row_blocks``) it checks whether waiting one
more block plus one decode step would push any row past its last token + its tier's TBT
target, and if so runs one decode step there, of the rows whose target is as tight as the
prefill's and no others (``BatchEngine.decode_step(rows=...)``). TBT is then bounded by about
one block plus one decode step, whatever the chunk size, and the prefill pays only for the
steps that a target actually needed, of the rows that needed them.

The block and step times are learnt as it runs (a fast-rising, slowly-falling average, so
one slow block is not forgotten at once). The clock is passed in, for tests.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch

from worker.batch_engine import BatchEngine, StepResult
from worker.engine import _NO_LISTENER, EngineListener
from worker.task import Task


def _learn(estimate: float, sample: float) -> float:
    return sample if sample > estimate else estimate + 0.2 * (sample - estimate)


class DecodeSlotter:
    def __init__(
        self,
        engine: BatchEngine,
        tbt_target_s: Callable[[Task], float],
        on_step: Callable[[StepResult], None] = lambda result: None,
        listener: EngineListener = _NO_LISTENER,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.engine = engine
        self.tbt_target_s = tbt_target_s
        self.on_step = on_step
        self.listener = listener
        self.clock = clock
        self.operator_s = 0.0  # one prefill block (time between two boundaries)
        self.step_s = 0.0  # one decode step of the current batch
        self.slotted_steps = 0
        self._last_token_at: dict[str, float] = {}
        self._boundary_at: float | None = None
        self._prefill_target_s = float("inf")  # the running prefill's own TBT target
        self._stopped_s = 0.0  # the part of a stopped step already run

    def joined(self, task: Task, at: float | None = None) -> None:
        """``task`` joined the batch; its TBT counts from its last token (now by default)."""
        self._last_token_at[task.request_id] = self.clock() if at is None else at

    def prefill_started(self, target_s: float) -> None:
        """A prefill run is about to start: step first if its first block would be too late;
        the time before this call is no block's. ``target_s`` is the prefill's own TBT target
        (its tier's): inside it, only rows whose target is as tight get a step. A slotted step
        delays the prefill by its time, and a lower tier's rows must never cost a higher
        tier's prefill its TTFT deadline (the worker does not know that deadline; the tier
        order it knows, from the targets). Those rows step when the prefill ends."""
        self._boundary_at = None
        self._prefill_target_s = target_s
        self()

    def step(
        self,
        *,
        slotted: bool = False,
        stop: Callable[[], bool] | None = None,
        rows: Sequence[Task] | None = None,
    ) -> StepResult:
        """One decode step of the batch (or of ``rows``, some of its rows; or the rest of one
        that stopped), timed; rows that finished are forgotten. ``slotted``: it runs at a
        boundary of a prefill (said so in the result). ``stop``: asked at the step's layer
        boundaries (``BatchEngine.decode_step``); a step it stops yields a result without
        rows, and the next call finishes it. Each result's ``seconds`` is that call's time, its
        ``step_seconds`` and the step time learnt the whole step's. With ``rows``, a stopped
        step of other rows is dropped first."""
        if rows is not None and not {id(t) for t in self.engine.pending_rows} <= set(map(id, rows)):
            # A stopped step with other rows (a critical prefill stops a step of critical and
            # batch rows): finishing it would make this prefill wait for those rows too.
            self.engine.abandon_step()
        if not self.engine.step_pending:
            self._stopped_s = 0.0  # nothing to finish (or what was stopped was abandoned)
        started = self.clock()
        result = self.engine.decode_step(self.listener, stop, rows)
        now = self.clock()
        whole = self._stopped_s + now - started
        if result is None:
            self._stopped_s = whole
            result = StepResult((), (), torch.empty(0), ())  # no rows yet: the next call ends it
        else:
            self.step_s = _learn(self.step_s, whole)
            self._stopped_s = 0.0
        result = dataclasses.replace(
            result, seconds=now - started, slotted=slotted, step_seconds=whole
        )
        for task in result.tasks:
            self._last_token_at[task.request_id] = now
        for task in result.finished:
            self._last_token_at.pop(task.request_id, None)
        self.on_step(result)
        return result

    def forget(self, task: Task) -> None:
        self._last_token_at.pop(task.request_id, None)

    def deadline(self, tightest_s: float = float("inf")) -> float:
        """The earliest time by which some row (of a TBT target up to ``tightest_s``) needs
        its next token."""
        last = self._last_token_at
        return min(
            (
                last.get(t.request_id, 0.0) + target
                for t in self.engine.rows
                if (target := self.tbt_target_s(t)) <= tightest_s
            ),
            default=float("inf"),
        )

    def __call__(self) -> None:
        """At a prefill boundary: step now if waiting one more block would be too late for a
        row whose target is as tight as the prefill's; the step decodes those rows alone."""
        now = self.clock()
        if self._boundary_at is not None:
            self.operator_s = _learn(self.operator_s, now - self._boundary_at)
        due = self.deadline(self._prefill_target_s)
        if self.engine.rows and now + self.operator_s + self.step_s > due:
            # Only the rows as tight as the prefill: the others would make it wait for them.
            target = self._prefill_target_s
            tight = [t for t in self.engine.rows if self.tbt_target_s(t) <= target]
            self.step(slotted=True, rows=tight)
            self.slotted_steps += 1
            now = self.clock()
        self._boundary_at = now
