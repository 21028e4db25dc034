"""The threads between Kafka (blocking kafka-python clients) and the service's asyncio loop.

- consumer thread: polls the tier topics in strict priority and hands each delivery to the loop
  (``loop.call_soon_threadsafe``). It takes only as many requests as the service has room for
  (``max_live`` requests in memory), so a backlog stays in Kafka; the most important tier may
  always bring in one more, so a full queue of batch work never holds a critical request back.
- reply thread: reads this instance's reply topic (events of its clients' requests that another
  instance runs) and hands them to the loop.
- capacity thread: reads the capacity topic (every owner's load of the tiers that admission
  judges, ``queue_service/core/capacity_board.py``) and hands each load to the loop.
- both threads outlive any error a Kafka call raises (``run_until_stopped``): logged, retried.
- ``publish`` (an executor thread per call, it blocks until the broker's ack) and
  ``finished`` (any thread; the consumer thread commits) are called from the loop.
- probe thread (``KafkaBreaker``): while Kafka is known to be down, every write (requests,
  replies, loads, request-log records) fails at once instead of waiting for the producer's
  timeout; ``available`` says which (the service's health reads it). A failed write of any
  kind opens it, so the shared producer is renewed once Kafka answers: after a broker stall
  that expired a batch it was retrying, kafka-python 3.0's idempotent producer drops its
  producer id and never fetches a new one, and sends nothing again (seen with SIGSTOP: an
  instance that sent only loads and replies failed every write, 20 s apart, each after its
  whole timeout, until a failed request write happened to trip the breaker).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import structlog

from queue_service.broker.breaker import KafkaBreaker
from queue_service.broker.io import (
    QueueUnavailableError,
    ReplyConsumer,
    RequestLog,
    TailConsumer,
    ensure_topics,
)
from queue_service.broker.priority_consumer import DeliveredRequest, PriorityConsumer
from tierflow.kafka_settings import KafkaSettings
from tierflow.tiers import TierTable
from tierflow.v1 import queue_pb2

log = structlog.get_logger("queue_service.kafka")

POLL_TIMEOUT_S = 0.05  # how long one poll waits; bounds how fast stop() is noticed
ERROR_PAUSE_S = 0.5  # after a failed turn of a Kafka thread (the broker gone: no busy loop)


def run_until_stopped(
    stop: threading.Event, turn: Callable[[], None], name: str, pause_s: float = ERROR_PAUSE_S
) -> None:
    """Calls ``turn`` until ``stop`` is set, and outlives every error it raises: one is logged
    (with its traceback when it starts a run of failures) and the next turn comes after
    ``pause_s``. kafka-python's ``poll`` raises KafkaConnectionError while the broker is down;
    in CI that ended the consumer thread, and after the broker's return nothing was delivered
    again (every request hung until its client's timeout)."""
    failures = 0
    while not stop.is_set():
        try:
            turn()
        except Exception as exc:
            failures += 1
            if failures == 1:
                log.exception("kafka thread: a turn failed; retrying", thread=name)
            else:
                log.warning("kafka thread: a turn failed again", thread=name, error=repr(exc))
            stop.wait(pause_s)
            continue
        if failures:
            log.info("kafka thread: turns succeed again", thread=name, failed_turns=failures)
            failures = 0


class KafkaBridge:
    def __init__(
        self,
        settings: KafkaSettings,
        tiers: TierTable,
        instance_id: str,
        *,
        max_live: int,
        live_count: Callable[[], int],
    ) -> None:
        ensure_topics(
            settings, tiers.names, reply_instances=[instance_id], request_log=True, capacity=True
        )
        self.settings = settings
        self.tiers = tiers
        self.instance_id = instance_id
        self.max_live = max_live
        self.live_count = live_count  # read from the consumer thread: a len(), no lock needed
        self.breaker = KafkaBreaker.for_kafka(settings, on_recovered=self.renew_clients)
        # Every kind of write goes through the breaker, not only requests: they share one
        # producer, and an instance that only sends loads and replies must renew it too.
        self.request_log = RequestLog(settings, guard=self.breaker.call)
        self.consumer = PriorityConsumer(settings, tiers)
        self.replies = ReplyConsumer(settings, instance_id, create_topic=False)
        self.capacity = TailConsumer(settings, settings.capacity_topic, queue_pb2.TierCapacity)
        self._renew_consumer = threading.Event()
        self.kafka_waiting: dict[str, int] = dict.fromkeys(tiers.names, 0)  # for the metrics
        self.owned_tiers: frozenset[str] = frozenset()  # tiers with a partition assigned here
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        on_delivered: Callable[[queue_pb2.QueuedRequest, DeliveredRequest], None],
        on_reply: Callable[[queue_pb2.ReplyRecord], None],
        on_capacity: Callable[[queue_pb2.TierCapacity], None],
    ) -> None:
        top_tier = self.tiers.names[0]

        def consume_once() -> None:
            if self._renew_consumer.is_set():
                self._replace_consumer()
            room = self.max_live - self.live_count()
            if room <= 0 and self.consumer.waiting().get(top_tier):
                room = 1
            for delivered in self.consumer.poll(POLL_TIMEOUT_S, max_records=max(room, 0)):
                loop.call_soon_threadsafe(on_delivered, delivered.request, delivered)
            # Swapped whole: the metrics and the capacity publisher read them from the loop.
            self.kafka_waiting = self.consumer.waiting()
            self.owned_tiers = self.consumer.owned_tiers()

        def read_replies_once() -> None:
            for reply in self.replies.poll(POLL_TIMEOUT_S):
                loop.call_soon_threadsafe(on_reply, reply)

        def read_capacity_once() -> None:
            for load in self.capacity.poll(POLL_TIMEOUT_S):
                loop.call_soon_threadsafe(on_capacity, load)

        def consume() -> None:
            run_until_stopped(self._stop, consume_once, "kafka-consumer")
            self.consumer.close()

        def read_replies() -> None:
            run_until_stopped(self._stop, read_replies_once, "kafka-replies")
            self.replies.close()

        def read_capacity() -> None:
            run_until_stopped(self._stop, read_capacity_once, "kafka-capacity")
            self.capacity.close()

        threads = (
            (consume, "kafka-consumer"),
            (read_replies, "kafka-replies"),
            (read_capacity, "kafka-capacity"),
        )
        for target, name in threads:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        self.breaker.start()

    def renew_clients(self) -> None:
        """Kafka answers again after an outage (the breaker's probe thread). Both clients are
        renewed: kafka-python's idempotent producer could stay wedged, and its consumer could
        stay out of the group after the coordinator moved (seen in CI: no partitions assigned
        for minutes after a broker restart, so nothing was delivered)."""
        self.request_log.renew_producer()
        self._renew_consumer.set()

    def _replace_consumer(self) -> None:
        """On the consumer thread (the consumer is not thread-safe). Nothing is lost: the old
        consumer commits what is finished if it can, and its uncommitted records (handed out or
        buffered) are read again by the new one; the service ignores a request id it already
        runs and marks again one it already finished (``ServiceCore.on_delivered``)."""
        try:
            fresh = PriorityConsumer(self.settings, self.tiers)
        except QueueUnavailableError as exc:
            log.warning("kafka consumer not renewed yet", error=str(exc))
            return  # the flag stays set: tried again on the next turn
        self._renew_consumer.clear()
        old, self.consumer = self.consumer, fresh
        try:
            old.close(timeout=5.0)
        except Exception:
            log.exception("closing the old kafka consumer failed")
        log.info("kafka consumer renewed after an outage")

    @property
    def available(self) -> bool:
        """False while Kafka is known to be down (writes fail fast meanwhile)."""
        return not self.breaker.is_open

    def publish(self, record: queue_pb2.QueuedRequest) -> None:
        """Blocks until the broker's ack; QueueUnavailableError at once while Kafka is down."""
        self.breaker.call(self.request_log.publish, record)

    # Replies and request-log records are queued for the sending thread; while Kafka is down
    # they are dropped (and logged) rather than each holding that thread for a timeout.

    def publish_reply(self, instance_id: str, reply: queue_pb2.ReplyRecord) -> None:
        if self.breaker.is_open:
            log.error("reply dropped: kafka is down", request_id=reply.request_id, to=instance_id)
            return
        self.request_log.publish_reply(instance_id, reply)

    def publish_capacity(self, record: queue_pb2.TierCapacity) -> None:
        if not self.breaker.is_open:  # a load is republished soon: none is worth a log line
            self.request_log.publish_capacity(record)

    def publish_finished(self, record: queue_pb2.FinishedRequest) -> None:
        if self.breaker.is_open:
            log.error("request-log record dropped: kafka is down", request_id=record.request_id)
            return
        self.request_log.publish_finished(record)

    def finished(self, delivered: DeliveredRequest) -> None:
        self.consumer.finished(delivered)

    def stop(self) -> None:
        self._stop.set()
        self.breaker.stop()
        for thread in self._threads:
            thread.join(timeout=15)
        self.request_log.close()
