"""KafkaBreaker on its own: writes fail fast while the broker is known to be down, probes open
and close it. The probes are stand-ins here (a unit test of the breaker); the whole service with
a broker stopped and started again is tests/integration/test_faults.py."""

from __future__ import annotations

import socket
import threading

import pytest

from queue_service.broker.breaker import KafkaBreaker, tcp_reachable
from queue_service.broker.io import QueueUnavailableError


class Broker:
    """What the probes see."""

    def __init__(self) -> None:
        self.listening = True
        self.answering = True
        self.probes: list[str] = []

    def reachable(self, timeout: float) -> bool:
        self.probes.append("reachable")
        return self.listening

    def answers(self, timeout: float) -> bool:
        self.probes.append("answers")
        return self.answering


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[KafkaBreaker, Broker, Clock]:
    broker, clock = Broker(), Clock()
    breaker = KafkaBreaker(reachable=broker.reachable, answers=broker.answers, clock=clock)
    return breaker, broker, clock


def failing_write() -> None:
    raise QueueUnavailableError("timed out")


def test_a_failed_write_opens_it_and_later_writes_fail_without_being_tried():
    breaker, _, clock = make()
    assert breaker.call(lambda x: x + 1, 1) == 2
    with pytest.raises(QueueUnavailableError, match="timed out"):
        breaker.call(failing_write)
    assert breaker.is_open
    tried = []
    clock.now += 3
    with pytest.raises(QueueUnavailableError, match=r"unreachable \(a write failed.*3 s ago"):
        breaker.call(tried.append, "x")
    assert tried == []  # failed fast: the write was never attempted


def test_a_probe_that_finds_no_broker_opens_it_and_one_that_gets_an_answer_closes_it():
    breaker, broker, _ = make()
    breaker.probe_once()
    assert not breaker.is_open and broker.probes == ["reachable"]  # closed: the cheap probe
    broker.listening = broker.answering = False
    breaker.probe_once()
    assert breaker.is_open
    breaker.probe_once()  # open: it asks the broker itself, and nobody answers
    assert breaker.is_open and broker.probes[-1] == "answers"
    broker.listening = True  # the port is open, the broker not ready yet: still open
    breaker.probe_once()
    assert breaker.is_open
    broker.answering = True
    breaker.probe_once()
    assert not breaker.is_open
    assert breaker.call(lambda: "queued") == "queued"


def test_a_write_that_started_before_the_recovery_does_not_open_it_again():
    breaker, broker, clock = make()
    started, release = threading.Event(), threading.Event()
    errors: list[Exception] = []

    def write_in_flight_during_the_outage() -> None:
        started.set()
        release.wait(10)
        raise QueueUnavailableError("expired while the broker was down")

    def client() -> None:
        try:
            breaker.call(write_in_flight_during_the_outage)
        except QueueUnavailableError as exc:
            errors.append(exc)

    thread = threading.Thread(target=client)
    thread.start()
    started.wait(10)
    broker.listening = broker.answering = False
    breaker.probe_once()  # the outage is noticed
    clock.now += 20
    broker.listening = broker.answering = True
    breaker.probe_once()  # and its end
    assert not breaker.is_open
    release.set()  # the old write now fails: it must not open the breaker again
    thread.join(10)
    assert errors and not breaker.is_open


def test_the_probe_thread_runs_and_stops():
    broker = Broker()
    broker.listening = broker.answering = False
    breaker = KafkaBreaker(
        reachable=broker.reachable, answers=broker.answers, probe_interval_s=0.01
    ).start()
    try:
        for _ in range(500):
            if breaker.is_open and "answers" in broker.probes:
                break
            threading.Event().wait(0.01)
        assert breaker.is_open and "answers" in broker.probes
    finally:
        breaker.stop()


def test_tcp_reachable_tells_a_listening_port_from_a_closed_one():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert tcp_reachable(f"127.0.0.1:{port}", 1.0)
        assert tcp_reachable(f"127.0.0.1:1,127.0.0.1:{port}", 1.0)  # any of them
    assert not tcp_reachable(f"127.0.0.1:{port}", 1.0)


def test_recovery_renews_before_writes_are_let_through():
    broker, clock = Broker(), Clock()
    seen: list[bool] = []
    breaker = KafkaBreaker(
        reachable=broker.reachable,
        answers=broker.answers,
        clock=clock,
        on_recovered=lambda: seen.append(breaker.is_open),
    )
    broker.listening = broker.answering = False
    breaker.probe_once()
    breaker.probe_once()
    assert breaker.is_open and seen == []  # not recovered yet
    broker.listening = broker.answering = True
    breaker.probe_once()
    assert seen == [True]  # called once, while writes still failed fast
    assert not breaker.is_open
    breaker.probe_once()
    assert seen == [True]  # closed already: nothing to renew
