"""The engine time a runner has spent on requests, as one monotonic total.

The runner's engine thread starts and stops it around every run (and adds the decode steps it
takes between runs); the metrics thread reads it whenever it samples. Reading the total, not
sampling "is a request running now?", counts a run shorter than the sampling period too.
"""

from __future__ import annotations

import threading
import time


class BusyClock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total_s = 0.0
        self._since: float | None = None  # when the current run started; None: idle

    def start(self, now: float) -> None:
        with self._lock:
            self._since = now

    def stop(self, now: float) -> None:
        with self._lock:
            if self._since is not None:
                self._total_s += now - self._since
            self._since = None

    def add(self, seconds: float) -> None:
        """Engine time outside any run (a batched worker's decode step between prefills)."""
        with self._lock:
            self._total_s += seconds

    def seconds(self, now: float | None = None) -> float:
        """Engine time so far, the current run's part included."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            running = 0.0 if self._since is None else max(0.0, now - self._since)
            return self._total_s + running
