"""`tierflow canary run`'s configuration: workers split in proportion to the traffic weight,
and a configuration that cannot make a canary refused with a clear message."""

from __future__ import annotations

import subprocess

import pytest

from launch.canary_run import CanaryRunConfig
from launch.processes import python_module


@pytest.mark.parametrize(
    ("weight", "workers", "split"),
    [(50, 2, (1, 1)), (10, 10, (9, 1)), (25, 8, (6, 2)), (10, 2, (1, 1)), (90, 4, (1, 3))],
)
def test_workers_follow_the_weight_with_one_at_least_a_side(weight, workers, split):
    got = CanaryRunConfig(weight=weight, workers=workers).split()
    assert (got["primary"], got["canary"]) == split
    stack = CanaryRunConfig(weight=weight, workers=workers).stack_config()
    assert (stack.workers, stack.canary_workers, stack.pin_workers) == (*split, True)


@pytest.mark.parametrize(
    "bad", [{"weight": 0}, {"weight": 100}, {"workers": 1}, {"load": 0}, {"load": 1.5}]
)
def test_a_configuration_that_cannot_make_a_canary_is_refused(bad):
    with pytest.raises(ValueError):
        CanaryRunConfig(**bad)


def test_the_command_line_says_why_and_exits_nonzero():
    done = subprocess.run(
        python_module("launch.cli", "canary", "run", "--weight", "100"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "tierflow canary run: a canary needs 0 < weight < 100, got 100" in done.stderr
