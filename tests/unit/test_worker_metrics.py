"""Busy time: the runner's own timing of its runs, read by the metrics sampler."""

from __future__ import annotations

import pytest

from worker.busy_clock import BusyClock
from worker.events import DecodeStepDone
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
    """The run starts and ends between two samples: no sample sees a request running. A fake
    clock drives the samples, so the total is exact whatever the machine's load."""
    now = [100.0]
    busy, metrics = BusyClock(), WorkerMetrics("primary", "w")
    sample = metrics.sampler(
        lambda: None, lambda: busy.seconds(now=now[0]), lambda: 0, lambda: 0, clock=lambda: now[0]
    )
    for _ in range(5):
        busy.start(now[0] + SAMPLE_S / 4)
        busy.stop(now[0] + SAMPLE_S / 4 + SAMPLE_S / 10)  # a 5 ms run between two samples
        now[0] += SAMPLE_S
        sample()
    labels = {"deployment": "primary", "worker": "w"}
    assert metrics.registry.get_sample_value(
        "tierflow_engine_busy_seconds_total", labels
    ) == pytest.approx(5 * SAMPLE_S / 10)
    # Five samples a period apart, each a tenth busy: the window's fraction is a tenth.
    fraction = metrics.registry.get_sample_value("tierflow_engine_busy_fraction", labels)
    assert fraction == pytest.approx(0.1)


def test_each_decode_step_counts_its_rows():
    metrics = WorkerMetrics("primary", "w")
    for rows in (1, 3, 3):
        metrics.observe(
            DecodeStepDone(tuple(f"r{i}" for i in range(rows)), (7,) * rows, (0,) * rows,
                           seconds=0.01, slotted=False, at=0.0)
        )  # fmt: skip
    labels = {"deployment": "primary", "worker": "w"}
    value = metrics.registry.get_sample_value
    assert value("tierflow_decode_step_rows_count", labels) == 3
    assert value("tierflow_decode_step_rows_sum", labels) == 7
    assert value("tierflow_decode_step_rows_bucket", {**labels, "le": "1.0"}) == 1
