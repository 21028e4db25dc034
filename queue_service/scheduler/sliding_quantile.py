"""The last N observations of a measured error, kept sorted so that a quantile is cheap.

The scheduler judges its predictions by a high quantile of their recent errors: the prefill
predictor's relative error (``prediction_error``), the time a preemption takes to act, and
admission's TTFT error (``admission_error``). Each new observation changes the quantile, and
each decision reads it: recomputing it with ``numpy.quantile`` over the whole window cost about
30 us a finished prefill, on the path of the next decision. Kept sorted (``sortedcontainers``),
an observation costs O(log N) and a quantile O(1). The quantile is numpy's default ("linear",
the 7th of Hyndman and Fan), computed the same way, so the numbers are numpy's.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator

from sortedcontainers import SortedList


class SlidingQuantile:
    """A window of the last ``window`` observations, with their quantiles."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._order: deque[float] = deque()
        self._sorted = SortedList()
        self.window = window

    def add(self, value: float) -> None:
        self._order.append(value)
        self._sorted.add(value)
        if len(self._order) > self.window:
            self._sorted.remove(self._order.popleft())

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[float]:
        """Oldest first."""
        return iter(self._order)

    def quantile(self, q: float) -> float:
        """``numpy.quantile(values, q)`` of the window; nan when it is empty."""
        n = len(self._sorted)
        if n == 0:
            return math.nan
        index = (n - 1) * q  # numpy's virtual index for the linear method
        below = math.floor(index)
        above = min(below + 1, n - 1)
        t = index - below
        a, b = self._sorted[below], self._sorted[above]
        diff = b - a
        # numpy's lerp: from the nearer end, so that the result stays within [a, b].
        return b - diff * (1 - t) if t >= 0.5 else a + diff * t
