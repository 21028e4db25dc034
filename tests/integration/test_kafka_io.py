"""queue_service.broker.io against a real Kafka broker.

What the queue service relies on: a publish is acknowledged (the record is in Kafka when
``publish`` returns); the tier topics are read in strict priority with a batch backlog left in
Kafka and a bounded buffer; an offset is committed only when its request is finished, so that a
restarted consumer re-delivers exactly the unfinished requests; a request id is handed out once;
replies reach the instance they are addressed to.

Timing-free by design (two busy cores run these next to the broker's JVM): tests wait for
conditions with generous deadlines and assert orders, never durations. "Nothing else is
delivered" is shown with sentinels: a record published last to each topic, after which nothing
earlier can still come.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition

from launch.kafka_broker import LocalKafkaBroker
from queue_service.broker.bridge import KafkaBridge
from queue_service.broker.io import QueueUnavailableError, ReplyConsumer, RequestLog, ensure_topics
from queue_service.broker.priority_consumer import DeliveredRequest, PriorityConsumer
from tests.tiers import UNIT_TIERS
from tierflow.kafka_settings import KafkaSettings
from tierflow.v1 import queue_pb2, serving_pb2

TIERS = ("critical", "standard", "batch")
DEADLINE_S = 60.0  # for a condition to come true; only a broken build ever waits that long


def request(request_id: str, tier: str) -> queue_pb2.QueuedRequest:
    return queue_pb2.QueuedRequest(
        request_id=request_id,
        tier=tier,
        prompt_ids=[1, 2, 3],
        max_new_tokens=4,
        arrival_unix_ms=int(time.time() * 1000),
        reply_to="instance-a",
    )


def ids(deliveries: Iterable[DeliveredRequest]) -> list[str]:
    return [d.request_id for d in deliveries]


def collect(consumer: PriorityConsumer, n: int) -> list[DeliveredRequest]:
    """Exactly ``n`` deliveries (never asks for more than it still needs)."""
    out: list[DeliveredRequest] = []
    deadline = time.monotonic() + DEADLINE_S
    while len(out) < n:
        assert time.monotonic() < deadline, f"only {len(out)} of {n} delivered: {ids(out)}"
        out += consumer.poll(timeout=0.2, max_records=n - len(out))
    return out


def keep_polling_until(consumer: PriorityConsumer, condition: Callable[[], bool]) -> None:
    """Poll without taking anything until ``condition`` holds."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "condition never came true"
        assert consumer.poll(timeout=0.1, max_records=0) == []


def drain_through_sentinels(
    consumer: PriorityConsumer, log: RequestLog, tiers: Iterable[str]
) -> list[DeliveredRequest]:
    """Publish a sentinel last to each tier; return everything delivered up to the sentinels
    (which are finished and left out). Whatever was in those topics before has then been read."""
    sentinels = {f"sentinel-{tier}-{time.monotonic_ns()}" for tier in tiers}
    for sid in sentinels:
        log.publish(request(sid, sid.split("-")[1]))
    out: list[DeliveredRequest] = []
    seen: set[str] = set()
    deadline = time.monotonic() + DEADLINE_S
    while seen != sentinels:
        assert time.monotonic() < deadline, f"sentinels missing: {sentinels - seen}"
        for d in consumer.poll(timeout=0.2):
            if d.request_id in sentinels:
                seen.add(d.request_id)
                consumer.finished(d)
            else:
                out.append(d)
    return out


def committed(settings: KafkaSettings, tier: str) -> int | None:
    """The group's committed offset for a tier topic, read by a client outside the group."""
    reader = KafkaConsumer(**settings.consumer_config())
    try:
        return reader.committed(TopicPartition(settings.tier_topic(tier), 0), timeout_ms=10_000)
    finally:
        reader.close(autocommit=False)


@pytest.fixture
def topics(kafka_settings: KafkaSettings) -> KafkaSettings:
    ensure_topics(kafka_settings, TIERS)
    return kafka_settings


@pytest.fixture
def request_log(topics: KafkaSettings) -> Iterator[RequestLog]:
    with RequestLog(topics) as log:
        yield log


def test_ensure_topics_creates_once(kafka_settings: KafkaSettings) -> None:
    created = ensure_topics(kafka_settings, TIERS, reply_instances=["instance-a"])
    assert sorted(created) == sorted(
        [kafka_settings.tier_topic(t) for t in TIERS] + [kafka_settings.reply_topic("instance-a")]
    )
    assert ensure_topics(kafka_settings, TIERS, reply_instances=["instance-a"]) == []


def test_publish_returns_once_the_record_is_in_kafka(
    topics: KafkaSettings, request_log: RequestLog
) -> None:
    record = request("r-1", "standard")
    request_log.publish(record)
    # No waiting: acks=all means the broker has it, so its end offset has moved already.
    reader = KafkaConsumer(**topics.consumer_config(standalone=True))
    try:
        tp = TopicPartition(topics.tier_topic("standard"), 0)
        assert reader.end_offsets([tp], timeout_ms=10_000)[tp] == 1
        reader.assign([tp])
        got = []
        deadline = time.monotonic() + DEADLINE_S
        while not got and time.monotonic() < deadline:
            got = reader.poll(timeout_ms=200).get(tp, [])
        assert got[0].key == b"r-1"
        assert queue_pb2.QueuedRequest.FromString(got[0].value) == record
    finally:
        reader.close(autocommit=False)


def test_publish_to_a_missing_topic_fails_instead_of_hanging(kafka_settings: KafkaSettings) -> None:
    settings = KafkaSettings(
        bootstrap=kafka_settings.bootstrap,
        topic_prefix=kafka_settings.topic_prefix,
        max_block_ms=1_000,
    )
    with RequestLog(settings) as log, pytest.raises(QueueUnavailableError):
        log.publish(request("r-1", "nosuchtier"))


def test_strict_priority_batch_backlog_stays_in_kafka_and_critical_goes_first(
    topics: KafkaSettings, request_log: RequestLog
) -> None:
    for i in range(20):
        request_log.publish(request(f"b{i}", "batch"))
    for i in range(2):
        request_log.publish(request(f"s{i}", "standard"))

    with PriorityConsumer(topics, TIERS, max_buffered=4) as consumer:
        # Standard outranks the older batch backlog.
        first = collect(consumer, 3)
        assert ids(first) == ["s0", "s1", "b0"]
        assert [d.tier for d in first] == ["standard", "standard", "batch"]
        # The backlog is in Kafka, not here: at most max_buffered records were read ahead.
        assert consumer.buffered <= 4
        assert consumer.waiting()["batch"] == 19

        for i in range(3):
            request_log.publish(request(f"c{i}", "critical"))
        keep_polling_until(consumer, lambda: consumer.waiting()["critical"] == 3)
        # Critical work waits: everything below it is paused (standard has none, batch has).
        assert consumer.paused_tiers() == {"standard", "batch"}
        assert consumer.buffered <= 4

        after = collect(consumer, 4)
        assert ids(after) == ["c0", "c1", "c2", "b1"]
        # Critical drained: batch is read again.
        assert consumer.paused_tiers() == frozenset()
        assert ids(collect(consumer, 18)) == [f"b{i}" for i in range(2, 20)]


def test_buffer_is_bounded_and_a_full_buffer_still_lets_critical_in(
    topics: KafkaSettings, request_log: RequestLog
) -> None:
    for i in range(30):
        request_log.publish(request(f"b{i}", "batch"))

    with PriorityConsumer(topics, TIERS, max_buffered=5) as consumer:
        keep_polling_until(consumer, lambda: consumer.buffered == 5)
        for _ in range(10):  # it stays full, never fuller
            assert consumer.poll(timeout=0.02, max_records=0) == []
            assert consumer.buffered == 5
        assert consumer.waiting()["batch"] == 30

        # A critical arrival into a full buffer of batch: a batch record gives way (it is read
        # again later), the critical one is handed out first.
        request_log.publish(request("c0", "critical"))
        keep_polling_until(consumer, lambda: consumer.waiting()["critical"] == 1)
        assert consumer.buffered <= 5
        assert ids(collect(consumer, 1)) == ["c0"]

        # Every batch request exactly once, in order, the one that gave way included.
        rest = []
        deadline = time.monotonic() + DEADLINE_S
        while len(rest) < 30:
            assert time.monotonic() < deadline
            got = consumer.poll(timeout=0.2, max_records=100)
            assert len(got) <= 5  # never more than the buffer holds
            rest += got
        assert ids(rest) == [f"b{i}" for i in range(30)]


def test_only_finished_requests_are_committed_and_a_restart_redelivers_the_rest(
    topics: KafkaSettings, request_log: RequestLog
) -> None:
    for i in range(6):
        request_log.publish(request(f"s{i}", "standard"))
    for i in range(2):
        request_log.publish(request(f"c{i}", "critical"))

    with PriorityConsumer(topics, TIERS) as first:
        got = {d.request_id: d for d in collect(first, 8)}
        assert set(got) == {"c0", "c1"} | {f"s{i}" for i in range(6)}
        # Finished out of order; s1, s4 and c0 are still running when the consumer goes.
        for rid in ["s5", "s2", "c1", "s0", "s3"]:
            first.finished(got[rid])
    # close() committed what was finished.

    # Per partition: the lowest offset not finished (the finished ones above it ride along).
    assert committed(topics, "standard") == 1
    assert committed(topics, "critical") == 0

    with PriorityConsumer(topics, TIERS) as second:
        again = collect(second, 3)
        assert ids(again) == ["c0", "s1", "s4"]  # critical first, then standard in order
        assert drain_through_sentinels(second, request_log, ["critical", "standard"]) == []
        for d in again:
            second.finished(d)

    assert committed(topics, "standard") == 7  # six requests and a sentinel, all finished
    assert committed(topics, "critical") == 3

    with PriorityConsumer(topics, TIERS) as third:
        assert drain_through_sentinels(third, request_log, ["critical", "standard"]) == []


def test_the_bridge_renews_its_consumer_after_an_outage_and_loses_nothing(
    own_broker: LocalKafkaBroker, topic_prefix: str, tmp_path: Path
) -> None:
    """A real outage: the test's own broker is stopped and started again on the same port and
    data. The bridge's breaker sees it go and come back and has the consumer thread swap in a
    fresh consumer (nobody calls ``renew_clients`` by hand). A request handed out before the
    outage is read again (uncommitted; the service ignores the id it already runs), a request
    published after it arrives, and finishing both commits them."""
    settings = KafkaSettings(
        bootstrap=own_broker.bootstrap, topic_prefix=topic_prefix, group_id=f"{topic_prefix}q"
    )
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    delivered: queue.Queue[DeliveredRequest] = queue.Queue()
    bridge = KafkaBridge(settings, UNIT_TIERS, "renew", max_live=100, live_count=lambda: 0)
    bridge.start(loop, lambda record, d: delivered.put(d), lambda reply: None, lambda load: None)
    try:
        bridge.request_log.publish(request("before", "standard"))
        first = delivered.get(timeout=DEADLINE_S)
        port = own_broker.port
        own_broker.stop()
        wait_until(lambda: bridge.breaker.is_open)  # the outage, as the service sees it
        own_broker.start(data_dir=tmp_path / "kafka", port=port)
        wait_until(lambda: not bridge.breaker.is_open)
        again = delivered.get(timeout=DEADLINE_S)
        assert (again.request_id, again.offset) == ("before", first.offset)  # read again
        bridge.request_log.publish(request("after", "standard"))  # the renewed producer
        after = delivered.get(timeout=DEADLINE_S)
        assert after.request_id == "after" and after.offset == first.offset + 1
        bridge.finished(again)
        bridge.finished(after)
    finally:
        bridge.stop()
        loop.call_soon_threadsafe(loop.stop)
    assert committed(settings, "standard") == after.offset + 1


def test_loads_and_replies_reach_kafka_again_after_the_broker_stalled(
    own_broker: LocalKafkaBroker, topic_prefix: str, tmp_path: Path
) -> None:
    """A broker that stalls (its JVM stopped by SIGSTOP, as in a long GC pause) while an
    instance sends only loads and replies, never a request. A batch that was sent, timed out and
    expired while it was retried makes kafka-python 3.0 drop its producer id and never fetch a
    new one: the producer sends nothing again, and each queued write fails after its whole
    timeout, one after another. A failed load or reply must trip the breaker like a failed
    request does, so that the producer is renewed once the broker answers. Short producer
    timeouts make the expiry fall inside the stall."""
    settings = KafkaSettings(
        bootstrap=own_broker.bootstrap,
        topic_prefix=topic_prefix,
        group_id=f"{topic_prefix}q",
        request_timeout_ms=2_000,
        delivery_timeout_ms=4_000,
        max_block_ms=4_000,
    )
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    loads: queue.Queue[str] = queue.Queue()
    replies: queue.Queue[str] = queue.Queue()
    bridge = KafkaBridge(settings, UNIT_TIERS, "stall", max_live=100, live_count=lambda: 0)
    bridge.start(
        loop,
        lambda record, d: None,
        lambda reply: replies.put(reply.request_id),
        lambda load: loads.put(load.instance_id),
    )
    pid = int((tmp_path / "kafka" / "broker.pid").read_text())
    sent = 0

    def send_until(stop_at: float) -> None:  # what the service does: a load every 0.2 s
        nonlocal sent
        while time.monotonic() < stop_at:
            sent += 1
            bridge.publish_capacity(queue_pb2.TierCapacity(tier="batch", instance_id=f"{sent}"))
            bridge.publish_reply("stall", queue_pb2.ReplyRecord(request_id=f"{sent}"))
            time.sleep(0.2)

    try:
        send_until(time.monotonic() + 1)
        os.kill(pid, signal.SIGSTOP)
        try:
            send_until(time.monotonic() + 8)  # past the request and the delivery timeout
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = sent
        deadline = time.monotonic() + DEADLINE_S
        seen_load = seen_reply = 0
        while seen_load <= resumed or seen_reply <= resumed:
            assert time.monotonic() < deadline, (
                f"nothing sent after the stall arrived (last load {seen_load}, reply "
                f"{seen_reply}, stall ended after {resumed})"
            )
            send_until(time.monotonic() + 0.5)
            while not loads.empty():
                seen_load = max(seen_load, int(loads.get()))
            while not replies.empty():
                seen_reply = max(seen_reply, int(replies.get()))
    finally:
        # stop() sends what is queued: with a wedged producer each write would take its whole
        # timeout, so whatever happened, a fresh producer sends them.
        bridge.request_log.renew_producer()
        bridge.stop()
        loop.call_soon_threadsafe(loop.stop)


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "condition never came true"
        time.sleep(0.1)


def test_a_request_id_is_handed_out_once(topics: KafkaSettings, request_log: RequestLog) -> None:
    request_log.publish(request("a", "standard"))
    request_log.publish(request("a", "standard"))  # e.g. a retry written twice
    request_log.publish(request("b", "standard"))

    with PriorityConsumer(topics, TIERS) as consumer:
        got = collect(consumer, 2)
        assert ids(got) == ["a", "b"]
        assert drain_through_sentinels(consumer, request_log, ["standard"]) == []
        assert consumer.duplicates == 1
        # The duplicate (and the finished sentinel) wait for the original to be committed.
        consumer.poll(timeout=0.1, max_records=0)
        assert (committed(topics, "standard") or 0) == 0

        for d in got:
            consumer.finished(d)
        # Once finished, the id is remembered: the same request again is not run again.
        request_log.publish(request("a", "standard"))
        assert drain_through_sentinels(consumer, request_log, ["standard"]) == []
        assert consumer.duplicates == 2

    assert committed(topics, "standard") == 6  # a, a, b, sentinel, a, sentinel


def test_reply_topic_round_trip(kafka_settings: KafkaSettings) -> None:
    ensure_topics(kafka_settings, (), reply_instances=["instance-a"])
    with RequestLog(kafka_settings) as log:
        stale = queue_pb2.ReplyRecord(request_id="old")
        log.publish_reply("instance-a", stale).result(timeout=DEADLINE_S)

        with ReplyConsumer(kafka_settings, "instance-a") as replies:
            event = queue_pb2.ReplyRecord(
                request_id="r-1",
                event=serving_pb2.GenerateEvent(
                    request_id="r-1", token=serving_pb2.Token(token_id=7, text="x")
                ),
            )
            error = queue_pb2.ReplyRecord(
                request_id="r-2", error=queue_pb2.ReplyError(code=4, message="too late")
            )
            log.publish_reply("instance-a", event)  # never blocks
            log.publish_reply("instance-a", error).result(timeout=DEADLINE_S)

            got: list[queue_pb2.ReplyRecord] = []
            deadline = time.monotonic() + DEADLINE_S
            while len(got) < 2:
                assert time.monotonic() < deadline
                got += replies.poll(timeout=0.2)
            # In order, and nothing from before this instance started listening.
            assert got == [event, error]
