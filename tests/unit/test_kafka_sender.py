"""The queued writes of ``RequestLog`` (replies, tier loads, request-log records) on their own,
with a stand-in producer whose acks the test releases: records are sent in order without
waiting for each other's acks, and a failed ack fails its future and trips the guard. The same
writes against a real broker, stalled and resumed, are tests/integration/test_kafka_io.py."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
from kafka.errors import KafkaTimeoutError

import queue_service.broker.io as kafka_io
from queue_service.broker.io import QueueUnavailableError, RequestLog
from tierflow.kafka_settings import KafkaSettings
from tierflow.v1 import queue_pb2

DEADLINE_S = 10.0


class Ack:
    """A sent record's ack, as ``KafkaProducer.send`` returns it, ended by the test."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: Exception | None = None
        self.awaited = threading.Event()  # someone waits for it

    def end(self, error: Exception | None = None) -> None:
        self._error = error
        self._done.set()

    def get(self, timeout: float) -> None:
        self.awaited.set()
        if not self._done.wait(timeout):
            raise KafkaTimeoutError("no ack")
        if self._error is not None:
            raise self._error


class Producer:
    """Takes every record at once; its ack waits for the test."""

    def __init__(self, **config: object) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.acks: list[Ack] = []
        self.refuse: Exception | None = None  # what the next send raises

    def send(self, topic: str, *, key: bytes, value: bytes, headers: list) -> Ack:
        if self.refuse is not None:
            raise self.refuse
        self.sent.append((topic, key))
        self.acks.append(Ack())
        return self.acks[-1]

    def close(self, timeout: float = 0) -> None:
        pass


@pytest.fixture
def request_log(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(kafka_io, "KafkaProducer", Producer)
    guarded: list[str] = []

    def guard(write, *args):
        try:
            return write(*args)
        except QueueUnavailableError as exc:
            guarded.append(str(exc))
            raise

    log = RequestLog(KafkaSettings(topic_prefix="t."), guard=guard)
    log.guarded = guarded
    yield log
    for ack in log._producer.acks:
        ack.end()
    log.close()


def wait_until(condition) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "condition never came true"
        time.sleep(0.01)


def test_queued_records_are_all_sent_before_the_first_ack(request_log: RequestLog) -> None:
    """One ack per send capped the writes at one record per round trip to the broker, and a
    tier load queued behind a backlog of replies reached the other instances late by it."""
    producer = request_log._producer
    futures = [
        request_log.publish_reply("b", queue_pb2.ReplyRecord(request_id="r")),
        request_log.publish_capacity(queue_pb2.TierCapacity(tier="critical", instance_id="a")),
        request_log.publish_finished(queue_pb2.FinishedRequest(request_id="r")),
    ]
    wait_until(lambda: len(producer.sent) == 3)
    assert [topic for topic, _ in producer.sent] == ["t.reply_b", "t.capacity", "t.request_log"]
    assert not any(f.done() for f in futures)
    for ack in producer.acks:
        ack.end()
    concurrent.futures.wait(futures, timeout=DEADLINE_S)
    assert [f.result(timeout=0) for f in futures] == [None, None, None]


def test_a_failed_ack_fails_its_write_and_trips_the_guard(request_log: RequestLog) -> None:
    producer = request_log._producer
    lost = request_log.publish_reply("b", queue_pb2.ReplyRecord(request_id="lost"))
    kept = request_log.publish_reply("b", queue_pb2.ReplyRecord(request_id="kept"))
    wait_until(lambda: len(producer.sent) == 2)
    producer.acks[0].end(KafkaTimeoutError("expired in the accumulator"))
    producer.acks[1].end()
    with pytest.raises(QueueUnavailableError, match="expired in the accumulator"):
        lost.result(timeout=DEADLINE_S)
    assert kept.result(timeout=DEADLINE_S) is None
    assert len(request_log.guarded) == 1


def test_an_ack_failing_after_the_producer_was_renewed_leaves_the_guard_alone(
    request_log: RequestLog,
) -> None:
    """Renewing the producer ends the outage that failed the old one's records: their failure
    must not open the breaker again, though the wait for the ack began before the renewal."""
    old = request_log._producer
    abandoned = request_log.publish_reply("b", queue_pb2.ReplyRecord(request_id="old"))
    wait_until(lambda: len(old.acks) == 1 and old.acks[0].awaited.is_set())
    request_log.renew_producer()
    old.acks[0].end(KafkaTimeoutError("producer closed"))
    with pytest.raises(QueueUnavailableError):
        abandoned.result(timeout=DEADLINE_S)
    assert request_log.guarded == []


def test_a_record_the_producer_refuses_fails_its_write_and_trips_the_guard(
    request_log: RequestLog,
) -> None:
    request_log._producer.refuse = KafkaTimeoutError("no metadata for the topic")
    refused = request_log.publish_capacity(queue_pb2.TierCapacity(tier="critical"))
    with pytest.raises(QueueUnavailableError, match="no metadata for the topic"):
        refused.result(timeout=DEADLINE_S)
    assert len(request_log.guarded) == 1
