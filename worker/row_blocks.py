"""Row blocks: each prefill operator cut into pieces that fit the preemption budget.

A premium request waits for the running prefill to reach its next interruption point. With
points at layer boundaries that wait is one layer, and one layer of a 2048-token chunk takes
130-360 ms on this project's CPU machines: most of a 0.3 s SLO. So the engine runs each
operator of a prefill (a layer's attention half and its MLP half) over blocks of rows of the
chunk, and reads the preemption channel between blocks. Each block appends its K/V and attends
to the keys before it, as a chunk of that size would, so every row's result is the whole
chunk's, and a stop between blocks resumes exactly, mid-operator.

How many rows fit the budget depends on the model, the machine and how many keys a row attends
to, so the planner learns it as the engine runs (``observe``) instead of being told:
- an MLP block costs ``rows x rate``;
- an attention block costs ``rows x (keys + key_offset) x rate``: the projections cost about
  as much per row as attending to ``hidden + kv_dim`` keys (their multiply-adds per row), and
  the scores and values cost one unit per key. The measured rate absorbs how efficiently the
  machine runs each; a block late in a long chunk, whose rows see many keys, gets fewer rows.
Each operator's rate (seconds per unit) is the lower quartile of its last ``window`` blocks'
rates: the machine's own speed. A block's fixed cost (module calls, slicing) is part of its
sample, so the sizes settle where a block's whole time, fixed cost included, is the target.
Contention is not followed down: when neighbours take the cores, every operator of a block
waits for descheduled threads, blocks take longer whatever their size, and smaller ones only
multiply those waits (a planner that shrank blocks after slow samples fell to its smallest
blocks under a load of 3 on 2 cores and ran 5-15x slower than the unsplit prefill). A slowdown
that lasts most of a window does move the quartile. Blocks aim at ``fill`` of the budget, which
leaves room for noise, and never have fewer than ``min_rows`` rows. Before the first sample of
an operator the planner does not know its cost and starts with ``min_rows``.

Where one operator fits the budget (a short chunk, a GPU), there is one block and nothing
changes. ``fixed_rows`` replaces the learnt size with a constant (tests).

The same blocks are the decode slotter's boundaries (``worker.decode_slotting``): a decode step
can come within one block of when it is due.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

ATTENTION = "attention"
MLP = "mlp"
OPERATORS = (ATTENTION, MLP)


@dataclass(frozen=True)
class BlockRule:
    budget_s: float  # the longest one block may take
    key_offset: int  # an attention row's projections, in keys (hidden + kv_dim)
    fill: float = 0.8  # aim at this share of the budget
    min_rows: int = 128
    align: int = 16  # block sizes rounded down to a multiple of this
    window: int = 32  # the blocks of an operator whose rates the planner keeps
    fixed_rows: int | None = None  # a constant block size instead of the learnt one


class RowBlockPlanner:
    """Plans the rows of each block of an operator; learns each operator's cost per unit."""

    def __init__(self, rule: BlockRule) -> None:
        self.rule = rule
        self._rates: dict[str, deque[float]] = {}  # per operator: recent seconds per unit

    def units(self, operator: str, rows: int, keys: int) -> float:
        if operator == ATTENTION:
            return rows * (keys + self.rule.key_offset)
        return float(rows)

    def rows(self, operator: str, past_keys: int, remaining: int) -> int:
        """Rows of the next block of ``operator``, whose rows attend to ``past_keys`` keys
        before them (attention; the block's own rows come on top), ``remaining`` rows left."""
        rule = self.rule
        if rule.fixed_rows is not None:
            return min(rule.fixed_rows, remaining)
        rate = self.rate(operator)
        if rate is None:
            return min(rule.min_rows, remaining)
        units = rule.budget_s * rule.fill / rate
        if operator == ATTENTION:  # rows x (past + rows + offset) <= units
            b = past_keys + rule.key_offset
            fit = (-b + math.sqrt(b * b + 4 * units)) / 2
        else:
            fit = units
        size = max(rule.min_rows, int(fit) - int(fit) % rule.align)
        if size >= remaining:
            return remaining
        if remaining - size < size // 2:  # no sliver at the end: two blocks of about half
            return (remaining + 1) // 2
        return size

    def observe(self, operator: str, rows: int, keys: int, seconds: float) -> None:
        """One block of ``operator`` over ``rows`` rows, its rows seeing up to ``keys`` keys,
        took ``seconds``."""
        rates = self._rates.setdefault(operator, deque(maxlen=self.rule.window))
        rates.append(seconds / max(self.units(operator, rows, keys), 1.0))

    def rate(self, operator: str) -> float | None:
        """Seconds per unit of ``operator``: the lower quartile of its recent blocks; None
        before the first."""
        rates = self._rates.get(operator)
        if not rates:
            return None
        ordered = sorted(rates)
        return ordered[(len(ordered) - 1) // 4]

    def predicted_s(self, operator: str, rows: int, keys: int) -> float | None:
        rate = self.rate(operator)
        return None if rate is None else rate * self.units(operator, rows, keys)


class BlockClock:
    """Times blocks for the planner. On the CPU a block's time is the wall time around it. On
    CUDA the host runs ahead of the device, so each block records two events and the planner
    gets the elapsed time once the device has passed the second one (read without waiting)."""

    def __init__(self, planner: RowBlockPlanner, device: str) -> None:
        self.planner = planner
        self.cuda = str(device).startswith("cuda")
        self._pending: deque[tuple[object, object, str, int, int]] = deque()
        self._started = 0.0
        self._start_event: object | None = None

    def start(self) -> None:
        if self.cuda:
            import torch

            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        else:
            self._started = time.perf_counter()

    def stop(self, operator: str, rows: int, keys: int) -> None:
        if not self.cuda:
            self.planner.observe(operator, rows, keys, time.perf_counter() - self._started)
            return
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((self._start_event, end, operator, rows, keys))
        self._read_finished()

    def _read_finished(self) -> None:
        while self._pending and self._pending[0][1].query():
            start, end, operator, rows, keys = self._pending.popleft()
            self.planner.observe(operator, rows, keys, start.elapsed_time(end) / 1000)


def planner_for(budget_ms: float | None, key_offset: int, fixed_rows: int | None):
    """The planner of an engine's config; None when operators run whole (no budget)."""
    if budget_ms is None and fixed_rows is None:
        return None
    budget_s = (budget_ms if budget_ms is not None else math.inf) / 1000
    return RowBlockPlanner(BlockRule(budget_s, key_offset, fixed_rows=fixed_rows))
