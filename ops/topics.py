"""Reading any of tierflow's Kafka topics as JSON: ``tierflow topic read TOPIC``.

Records are binary protobuf; their ``message`` header names the message type
(``queue_service.broker.io.record_headers``). A record without it (written before the headers
existed) is decoded by what its topic is: a tier topic holds ``QueuedRequest``, a reply topic
``ReplyRecord``, the request log ``FinishedRequest``. Reads every partition from the start (or
the end, to follow new records only) and stops after ``idle_s`` without a record, or never with
``follow``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from kafka import KafkaConsumer, TopicPartition

from tierflow.kafka_settings import KafkaSettings
from tierflow.v1 import queue_pb2

MESSAGES: dict[str, type[Message]] = {
    m.DESCRIPTOR.full_name: m
    for m in (
        queue_pb2.QueuedRequest,
        queue_pb2.ReplyRecord,
        queue_pb2.FinishedRequest,
        queue_pb2.TierCapacity,
    )
}


def message_type(topic: str, headers: list[tuple[str, bytes]] | None) -> type[Message] | None:
    named = dict(headers or {}).get("message")
    if named is not None:
        return MESSAGES.get(named.decode(errors="replace"))
    if re.search(r"priority_[^.]+$", topic):
        return queue_pb2.QueuedRequest
    if re.search(r"reply_[^.]+$", topic):
        return queue_pb2.ReplyRecord
    if topic.endswith("request_log"):
        return queue_pb2.FinishedRequest
    if topic.endswith("capacity"):
        return queue_pb2.TierCapacity
    return None


def decode(topic: str, record) -> dict:
    """One consumer record as a JSON-ready dict; ``value`` is the message, or the raw bytes'
    hex when it cannot be decoded."""
    kind = message_type(topic, record.headers)
    out = {
        "topic": topic,
        "partition": record.partition,
        "offset": record.offset,
        "timestamp_ms": record.timestamp,
        "key": record.key.decode(errors="replace") if record.key else None,
        "message": kind.DESCRIPTOR.full_name if kind else None,
    }
    try:
        if kind is None:
            raise DecodeError("unknown message type")
        message = kind.FromString(record.value or b"")
        out["value"] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    except DecodeError:
        out["value_hex"] = (record.value or b"").hex()
    return out


def read_topic(
    settings: KafkaSettings,
    topic: str,
    *,
    from_end: bool = False,
    limit: int | None = None,
    follow: bool = False,
    idle_s: float = 2.0,
) -> Iterator[dict]:
    consumer = KafkaConsumer(**settings.consumer_config(standalone=True))
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            raise ValueError(f"topic {topic!r} does not exist on {settings.bootstrap}")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        (consumer.seek_to_end if from_end else consumer.seek_to_beginning)(*tps)
        seen = 0
        while limit is None or seen < limit:
            batch = consumer.poll(timeout_ms=int(idle_s * 1000))
            if not batch and not follow:
                return
            for records in batch.values():
                for record in records:
                    yield decode(topic, record)
                    seen += 1
                    if limit is not None and seen >= limit:
                        return
    finally:
        consumer.close(autocommit=False)
