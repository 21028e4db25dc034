"""``run_until_stopped``, the loop of the bridge's Kafka threads, on its own: a turn that raises
(as kafka-python's poll does while the broker is down) never ends it. The whole service with a
broker stopped and started again is tests/integration/test_faults.py."""

from __future__ import annotations

import threading

from kafka.errors import KafkaConnectionError

from queue_service.broker.bridge import run_until_stopped


def test_the_loop_outlives_failing_turns_and_stops_when_told() -> None:
    stop = threading.Event()
    calls: list[str] = []

    def turn() -> None:
        calls.append("turn")
        if len(calls) <= 3:  # the broker is down for three turns
            raise KafkaConnectionError("111 ECONNREFUSED")
        if len(calls) == 5:
            stop.set()

    thread = threading.Thread(target=run_until_stopped, args=(stop, turn, "test", 0.01))
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert len(calls) == 5  # three failed turns, then two good ones, then the stop


def test_a_failed_turn_waits_its_pause_but_not_past_the_stop() -> None:
    stop = threading.Event()
    calls: list[str] = []

    def turn() -> None:
        calls.append("turn")
        stop.set()  # stopped while failing: the pause ends at once
        raise RuntimeError("any error, not only Kafka's")

    thread = threading.Thread(target=run_until_stopped, args=(stop, turn, "test", 3600.0))
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and calls == ["turn"]
