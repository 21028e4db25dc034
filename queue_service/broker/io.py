"""Kafka I/O of the queue service: the durable request log, topics, and replies between
instances. The strict-priority consumer of the tier topics is
``queue_service.broker.priority_consumer``.

No scheduling decision is made here.

* **Durable before Queued.** ``RequestLog.publish`` returns only once the broker acknowledged
  the record (acks=all, idempotent producer), so a client told ``Queued`` has a request that
  survives a crash of the service.
* **Finished requests** go to ``<prefix>request_log`` (``RequestLog.publish_finished``): one
  ``FinishedRequest`` per request, whatever its end, kept for the audit and the canary compare.
  Keyed by request id, written from the sending thread (never blocks the loop), acks=all.
* ``RequestLog`` is thread-safe. ``publish`` blocks until the broker acknowledged: call it from
  an executor thread (``loop.run_in_executor``), never on the asyncio loop. ``publish_reply``
  (and ``publish_capacity``, ``publish_finished``) never blocks: it queues the record for a
  sending thread of its own and returns a future that ends with the broker's ack.
* ``ReplyConsumer``: all calls from one thread (kafka-python's consumer is not thread-safe).
* **Readable by the usual tools.** Every record carries two headers: ``content-type``
  (``application/x-protobuf``) and ``message`` (the protobuf message's full name, e.g.
  ``tierflow.v1.QueuedRequest``), so ``tierflow topic read`` or kcat + ``protoc --decode`` know
  how to decode it (docs/api.md, "Reading the Kafka topics and calling the API by hand").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import structlog
from google.protobuf.message import DecodeError, Message
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError, TopicAlreadyExistsError
from kafka.producer.future import FutureRecordMetadata

from tierflow.kafka_settings import KafkaSettings
from tierflow.tiers import TierPolicy
from tierflow.v1 import queue_pb2

log = structlog.get_logger("queue_service.broker.io")

CONTENT_TYPE = "application/x-protobuf"

T = TypeVar("T")


def record_headers(message: Message) -> list[tuple[str, bytes]]:
    """The headers of a record whose value is ``message`` serialised."""
    return [
        ("content-type", CONTENT_TYPE.encode()),
        ("message", message.DESCRIPTOR.full_name.encode()),
    ]


class QueueUnavailableError(RuntimeError):
    """Kafka did not take the record (unreachable, topic missing, timed out): nothing is queued."""


class _Abandoned(Exception):
    """A queued record of a producer renewed since: not a QueueUnavailableError, so that the
    guard lets it pass without counting it."""


def tier_names(tiers: Iterable[str | TierPolicy]) -> tuple[str, ...]:
    """Tier names in the order given (a TierTable iterates most important first)."""
    names = tuple(t if isinstance(t, str) else t.name for t in tiers)
    if len(set(names)) != len(names):
        raise ValueError(f"tiers named twice: {names}")
    return names


# ----------------------------------------------------------------------------------- topics


def ensure_topics(
    settings: KafkaSettings,
    tiers: Iterable[str | TierPolicy],
    *,
    reply_instances: Iterable[str] = (),
    request_log: bool = False,
    capacity: bool = False,
    timeout_s: float = 30.0,
) -> list[str]:
    """Create the tier topics (the reply topics of ``reply_instances``, the request-log topic
    with ``request_log``, the capacity topic with ``capacity``) that do not exist yet, and wait
    until they can be used. Returns the names created; safe to run concurrently from several
    instances."""
    wanted: dict[str, dict] = {
        settings.tier_topic(t): {
            "num_partitions": settings.partitions,
            "replication_factor": settings.replication_factor,
        }
        for t in tier_names(tiers)
    }
    for instance_id in reply_instances:
        # One partition: a reply topic has exactly one reader, the instance it is named after.
        wanted[settings.reply_topic(instance_id)] = {
            "num_partitions": 1,
            "replication_factor": settings.replication_factor,
            "configs": {"retention.ms": str(settings.reply_retention_ms)},
        }
    if request_log:
        wanted[settings.request_log_topic] = {
            "num_partitions": 1,
            "replication_factor": settings.replication_factor,
            "configs": {"retention.ms": str(settings.request_log_retention_ms)},
        }
    if capacity:
        wanted[settings.capacity_topic] = {
            "num_partitions": 1,
            "replication_factor": settings.replication_factor,
            "configs": {"retention.ms": str(settings.capacity_retention_ms)},
        }
    if not wanted:
        return []
    admin = KafkaAdminClient(**settings.admin_config())
    try:
        existing = set(admin.list_topics())
        missing = {name: spec for name, spec in wanted.items() if name not in existing}
        created: list[str] = []
        if missing:
            result = admin.create_topics(
                missing, timeout_ms=int(timeout_s * 1000), raise_errors=False
            )
            for topic in result["topics"]:
                code = topic["error_code"]
                if code == 0:
                    created.append(topic["name"])
                elif code != TopicAlreadyExistsError.errno:  # another instance was quicker
                    raise QueueUnavailableError(
                        f"creating topic {topic['name']} failed: error {code} "
                        f"{topic.get('error_message') or ''}".rstrip()
                    )
            admin.wait_for_topics(list(missing), timeout_ms=int(timeout_s * 1000))
            log.info("kafka topics created", topics=created)
        return created
    except KafkaError as exc:
        raise QueueUnavailableError(f"Kafka at {settings.bootstrap}: {exc!r}") from exc
    finally:
        admin.close()


# ---------------------------------------------------------------------------------- producer

Guard = Callable[..., Any]


def direct(write: Callable[..., T], *args: object) -> T:
    """The guard of a RequestLog without a breaker: just the write."""
    return write(*args)


class RequestLog:
    """Writes accepted requests to their tier's topic, and replies to other instances."""

    def __init__(self, settings: KafkaSettings, *, guard: Guard = direct) -> None:
        """``guard(write, *args)`` runs each queued write (replies, loads, request-log records):
        the bridge passes its breaker's ``call``, so that a failed one trips the breaker too."""
        self.settings = settings
        self._guard = guard
        try:
            self._producer = KafkaProducer(**settings.producer_config())
        except KafkaError as exc:
            raise QueueUnavailableError(f"Kafka at {settings.bootstrap}: {exc!r}") from exc
        # Queued records are sent from this one thread: publish_reply must not block the
        # asyncio loop (the first send to a topic waits for its metadata), and one sender keeps
        # the replies of a request in order (an idempotent producer sends one batch of a
        # partition at a time: kafka-python mutes the partition meanwhile). Their acks are
        # awaited on a second thread, in the same order: a sender that waited for each ack
        # before the next send wrote one record per round trip to the broker, and every tier
        # load queued behind a backlog of replies reached the other instances late by it.
        self._sender = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tierflow-kafka-sender"
        )
        self._acks = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tierflow-kafka-acks"
        )

    def publish(self, record: queue_pb2.QueuedRequest, timeout: float | None = None) -> None:
        """Write ``record`` to the topic of ``record.tier``, keyed by its request id, and return
        once the broker acknowledged it. Blocks: not on the asyncio loop.
        Raises QueueUnavailableError when Kafka did not take it."""
        if not record.request_id or not record.tier:
            raise ValueError("a queued request needs a request_id and a tier")
        topic = self.settings.tier_topic(record.tier)
        self._send_and_wait(topic, record.request_id, record, timeout)

    def publish_reply(
        self, instance_id: str, reply: queue_pb2.ReplyRecord
    ) -> concurrent.futures.Future[None]:
        """Queue ``reply`` for the reply topic of ``instance_id``; never blocks. The future ends
        when the broker acknowledged (or with QueueUnavailableError, which is also logged)."""
        topic = self.settings.reply_topic(instance_id)
        return self._queue(
            topic, reply.request_id, reply, "reply not delivered",
            request_id=reply.request_id, instance=instance_id,
        )  # fmt: skip

    def publish_finished(
        self, record: queue_pb2.FinishedRequest
    ) -> concurrent.futures.Future[None]:
        """Queue a finished request's record for the request-log topic; never blocks."""
        return self._queue(
            self.settings.request_log_topic, record.request_id, record,
            "request-log record not written", request_id=record.request_id,
        )  # fmt: skip

    def publish_capacity(self, record: queue_pb2.TierCapacity) -> concurrent.futures.Future[None]:
        """Queue one owner's load of a tier for the capacity topic; never blocks."""
        return self._queue(
            self.settings.capacity_topic, f"{record.tier}/{record.instance_id}", record,
            "tier load not published", tier=record.tier,
        )  # fmt: skip

    def _queue(
        self, topic: str, key: str, message: Message, failure: str, **context: str
    ) -> concurrent.futures.Future[None]:
        """Send on the one sending thread, in order; the future ends with the broker's ack. A
        failure is logged with ``context``."""
        acked: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._sender.submit(self._send_then_await, topic, key, message, acked)

        def log_failure(done: concurrent.futures.Future[None]) -> None:
            if not done.cancelled() and done.exception() is not None:
                log.error(failure, error=str(done.exception()), **context)

        acked.add_done_callback(log_failure)
        return acked

    def _send_then_await(
        self, topic: str, key: str, message: Message, acked: concurrent.futures.Future[None]
    ) -> None:
        """On the sending thread: hand the record to the producer and its ack to the ack
        thread. Both steps run under the guard, so that a failure of either trips it."""
        try:
            producer, sent = self._guard(self._send, topic, key, message)
            self._acks.submit(self._await_into, sent, producer, topic, acked)
        except Exception as exc:  # the future carries it to whoever waits, and to the log
            acked.set_exception(exc)

    def _await_into(
        self,
        sent: FutureRecordMetadata,
        producer: KafkaProducer,
        topic: str,
        acked: concurrent.futures.Future[None],
    ) -> None:
        try:
            self._guard(self._await_ack_of, sent, producer, topic)
        except _Abandoned as exc:
            acked.set_exception(QueueUnavailableError(str(exc)))
        except Exception as exc:
            acked.set_exception(exc)
        else:
            acked.set_result(None)

    def _await_ack_of(
        self, sent: FutureRecordMetadata, producer: KafkaProducer, topic: str
    ) -> None:
        try:
            self._await_ack(sent, topic, None)
        except QueueUnavailableError as exc:
            if producer is not self._producer:
                # Renewed since, after an outage: the record failed for that outage, which is
                # over, so its failure must not trip the guard again.
                raise _Abandoned(str(exc)) from exc
            raise

    def _send_and_wait(self, topic: str, key: str, message: Message, timeout: float | None) -> None:
        self._await_ack(self._send(topic, key, message)[1], topic, timeout)

    def _send(
        self, topic: str, key: str, message: Message
    ) -> tuple[KafkaProducer, FutureRecordMetadata]:
        """Hand the record to the producer (which waits for the topic's metadata the first
        time); its ack is the returned future's."""
        producer = self._producer
        try:
            return producer, producer.send(
                topic,
                key=key.encode(),
                value=message.SerializeToString(),
                headers=record_headers(message),
            )
        except KafkaError as exc:
            raise QueueUnavailableError(
                f"Kafka did not take the record for {topic}: {exc!r}"
            ) from exc

    def _await_ack(self, sent: FutureRecordMetadata, topic: str, timeout: float | None) -> None:
        # delivery_timeout_ms bounds the wait for the ack; the margin covers the metadata wait.
        if timeout is None:
            timeout = (self.settings.delivery_timeout_ms + self.settings.max_block_ms) / 1000
        try:
            sent.get(timeout=timeout)
        except KafkaError as exc:
            raise QueueUnavailableError(
                f"Kafka did not take the record for {topic}: {exc!r}"
            ) from exc

    def renew_producer(self) -> None:
        """Replace the producer with a fresh one (after an outage: see ``breaker``). Records the
        old one still holds were never acknowledged, so no client was told they are queued;
        they are abandoned. Keeps the old producer if a new one cannot be made."""
        try:
            fresh = KafkaProducer(**self.settings.producer_config())
        except KafkaError as exc:
            log.error("kafka producer not renewed", error=repr(exc))
            return
        old, self._producer = self._producer, fresh
        with contextlib.suppress(KafkaError):
            old.close(timeout=0)
        # kafka-python 3.0's close() stops at its flush while records are pending, before it
        # ends the sender thread; end it here, failing what it still holds at once.
        sender = getattr(old, "_sender", None)
        if sender is not None and sender.is_alive():
            sender.force_close()
        log.info("kafka producer renewed")

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then close."""
        self._sender.shutdown(wait=True)  # every record handed over: its ack is queued
        self._acks.shutdown(wait=True)
        self._producer.close(timeout=timeout)

    def __enter__(self) -> RequestLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------- consumer


class TailConsumer:
    """Reads one topic's new records, all partitions, as messages of one type. No consumer
    group: every reader reads everything, from the end of the topic when it started (what came
    before is of no use to it). All calls from one thread."""

    def __init__(self, settings: KafkaSettings, topic: str, message: type[Message]) -> None:
        self.settings = settings
        self.topic = topic
        self.message = message
        try:
            self._consumer = KafkaConsumer(**settings.consumer_config(standalone=True))
            partitions = self._consumer.partitions_for_topic(self.topic)
            if not partitions:
                raise QueueUnavailableError(f"topic {self.topic} does not exist")
            tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
            self._consumer.assign(tps)
            self._consumer.seek_to_end(*tps)
            # Resolve the end now: a record written after the constructor returns is not missed.
            for tp in tps:
                self._consumer.position(tp, timeout_ms=settings.bootstrap_timeout_ms)
        except KafkaError as exc:
            raise QueueUnavailableError(f"Kafka at {settings.bootstrap}: {exc!r}") from exc
        self.undecodable = 0

    def poll(self, timeout: float = 0.0, max_records: int = 256) -> list[Message]:
        records = self._consumer.poll(timeout_ms=int(timeout * 1000), max_records=max_records)
        out = []
        for rec in itertools.chain.from_iterable(records.values()):
            try:
                out.append(self.message.FromString(rec.value or b""))
            except DecodeError:
                self.undecodable += 1
                log.error(
                    "skipping an undecodable record",
                    topic=self.topic,
                    offset=rec.offset,
                    expected=self.message.DESCRIPTOR.full_name,
                )
        return out

    def close(self, timeout: float = 10.0) -> None:
        self._consumer.close(autocommit=False, timeout_ms=int(timeout * 1000))

    def __enter__(self) -> TailConsumer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ReplyConsumer(TailConsumer):
    """Reads the reply topic of one queue-service instance: events of its clients' requests that
    other instances run. The instance is its only reader, and replies from before it started are
    of no use (their client streams died with the previous process)."""

    def __init__(
        self, settings: KafkaSettings, instance_id: str, *, create_topic: bool = True
    ) -> None:
        self.instance_id = instance_id
        if create_topic:
            ensure_topics(settings, (), reply_instances=[instance_id])
        super().__init__(settings, settings.reply_topic(instance_id), queue_pb2.ReplyRecord)
