"""Busy time: the runner's own timing of its runs, read by the metrics sampler."""

from __future__ import annotations

import time

from worker.busy_clock import BusyClock
from worker.metrics import SAMPLE_S, WorkerMetrics


def test_busy_clock_counts_runs_and_steps_between_them():
    clock = BusyClock()
    clock.start(10.0)
    assert clock.seconds(now=10.5) == 0.5  # the current run's part
    clock.stop(11.0)
    clock.add(0.25)  # a decode step between runs
    clock.stop(20.0)  # stopping while idle adds nothing
    assert clock.seconds(now=30.0) == 1.25


def test_a_run_shorter_than_the_sampling_period_is_counted():
    """The run starts and ends between two samples: no sample sees a request running."""
    clock, metrics = BusyClock(), WorkerMetrics("primary", "w")
    metrics.start_sampling(lambda: None, clock.seconds, lambda: 0, lambda: 0)
    try:
        for _ in range(5):
            start = time.perf_counter()
            clock.start(start)
            clock.stop(start + SAMPLE_S / 10)  # a 5 ms run, recorded as it ended
            time.sleep(SAMPLE_S * 2)
        time.sleep(SAMPLE_S * 2)
        busy = metrics.registry.get_sample_value(
            "tierflow_engine_busy_seconds_total", {"deployment": "primary", "worker": "w"}
        )
        assert busy is not None and abs(busy - 5 * SAMPLE_S / 10) < 1e-9
    finally:
        metrics.stop()
