"""The canary run's capacity probe: Envoy splits a backlog at random, so a side can serve none
of a short one; the probe sends it again (and says so) rather than measure nothing."""

from __future__ import annotations

import pytest
from rich.console import Console

import launch.canary_run as canary_run
from bench.harness import RunResult
from bench.workload import Arrival, Workload
from launch.local_stack import CANARY, PRIMARY
from launch.stack_client import StackRecord

SPLIT = {PRIMARY: 1, CANARY: 1}
BACKLOG = Workload("probe", tuple(Arrival(0.0, f"r{i}", "critical", 100) for i in range(4)))


def _result(sides: list[str | None]) -> RunResult:
    """Each request done in 1 s on its side (None: it failed before it was queued)."""
    records = {}
    for arrival, side in zip(BACKLOG.arrivals, sides, strict=True):
        record = StackRecord(arrival, arrived_at=0.0, deployment=side or "")
        if side is None:
            record.failed = "UNAVAILABLE: no healthy upstream"
        else:
            record.done_at = 1.0
        records[arrival.request_id] = record
    return RunResult("probe", records)


def _sending(monkeypatch, backlogs: list[list[str | None]]) -> list[int]:
    sent = []

    def send(e, workload, by_id, name):
        sent.append(len(workload.arrivals))
        return _result(backlogs[len(sent) - 1])

    monkeypatch.setattr(canary_run, "_send", send)
    return sent


def test_a_backlog_that_one_side_served_whole_is_sent_again(monkeypatch):
    sent = _sending(monkeypatch, [[CANARY] * 4, [PRIMARY, CANARY, PRIMARY, CANARY]])
    rates, tries = canary_run._probe(
        None, BACKLOG, {}, SPLIT, "both", (PRIMARY, CANARY), Console(quiet=True)
    )
    assert tries == 2 and sent == [4, 4]
    assert rates == {PRIMARY: 200.0, CANARY: 200.0}  # two 100-token prompts a side in 1 s


def test_a_failed_request_is_not_counted_and_a_side_that_never_serves_is_an_error(monkeypatch):
    sent = _sending(monkeypatch, [[None, CANARY, None, CANARY]] * canary_run.PROBE_TRIES)
    with pytest.raises(RuntimeError, match="primary served none"):
        canary_run._probe(None, BACKLOG, {}, SPLIT, "both", (PRIMARY, CANARY), Console(quiet=True))
    assert len(sent) == canary_run.PROBE_TRIES


def test_the_old_side_alone_needs_only_itself(monkeypatch):
    _sending(monkeypatch, [[PRIMARY] * 4])
    rates, tries = canary_run._probe(
        None, BACKLOG, {}, SPLIT, "alone", (PRIMARY,), Console(quiet=True)
    )
    assert tries == 1 and rates == {PRIMARY: 400.0}
