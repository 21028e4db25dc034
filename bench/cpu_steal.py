"""CPU steal: the share of this machine's CPU time its hypervisor gave to other guests.

On a shared virtual machine steal slows every engine, unevenly over time: this project's
development VM has gone from under 1 % to over 40 % within one benchmark run, and a critical
request whose prefill runs in such a second takes several times its isolated TTFT. So the bench
records the whole run's share (``RunResult.cpu_steal``) and, in a timeline
(``bench.event_log``), one sample a second, which ``tierflow misses`` sets against each wait.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psutil


def steal_share(before, after) -> float:
    """Of the CPU time between two ``psutil.cpu_times()``, the share stolen (0 where the
    platform does not report steal)."""
    total = sum(after) - sum(before)
    stolen = getattr(after, "steal", 0.0) - getattr(before, "steal", 0.0)
    return stolen / total if total > 0 else 0.0


class StealSampler:
    """Calls ``record(share, seconds)`` about every ``interval_s`` with the steal share of the
    ``seconds`` just ended (measured: a wait oversleeps under steal), on a daemon thread,
    until ``stop``."""

    def __init__(self, record: Callable[[float, float], None], interval_s: float = 1.0) -> None:
        self._record = record
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-steal", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        before, since = psutil.cpu_times(), time.perf_counter()
        while not self._stopped.wait(self._interval_s):
            after, now = psutil.cpu_times(), time.perf_counter()
            self._record(steal_share(before, after), now - since)
            before, since = after, now

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def mean_over(samples: list[tuple[float, float, float]], start: float, end: float) -> float | None:
    """The steal share over ``[start, end]``: each sample ``(ended_at, seconds, share)``
    weighted by how much of its interval falls inside; None when none does."""
    weight = total = 0.0
    for ended_at, seconds, share in samples:
        overlap = min(end, ended_at) - max(start, ended_at - seconds)
        if overlap > 0:
            weight += overlap
            total += overlap * share
    return total / weight if weight > 0 else None
