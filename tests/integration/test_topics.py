"""Kafka records say what they are (headers), and `tierflow topic read` prints any topic as
JSON lines, against a real broker."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from kafka import KafkaConsumer, TopicPartition

from launch.processes import REPO
from queue_service.broker.io import RequestLog, ensure_topics
from tierflow.v1 import queue_pb2


def test_records_carry_their_type_and_the_topic_reads_as_json(kafka_settings):
    ensure_topics(kafka_settings, ["critical"], request_log=True)
    record = queue_pb2.QueuedRequest(
        request_id="r-1", tier="critical", prompt_ids=[5, 6, 7], max_new_tokens=4,
        arrival_unix_ms=int(time.time() * 1000),
    )  # fmt: skip
    with RequestLog(kafka_settings) as log:
        log.publish(record)
        log.publish_finished(queue_pb2.FinishedRequest(request_id="r-1", tier="critical")).result(
            30
        )
    topic = kafka_settings.tier_topic("critical")
    consumer = KafkaConsumer(**kafka_settings.consumer_config(standalone=True))
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        records = consumer.poll(timeout_ms=10_000)[tp]
    finally:
        consumer.close()
    assert dict(records[0].headers) == {
        "content-type": b"application/x-protobuf",
        "message": b"tierflow.v1.QueuedRequest",
    }
    for name, expected in (
        (topic, {"message": "tierflow.v1.QueuedRequest", "tier": "critical"}),
        (kafka_settings.request_log_topic, {"message": "tierflow.v1.FinishedRequest"}),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "launch.cli", "topic", "read", name,
             "--kafka-bootstrap", kafka_settings.bootstrap, "--max", "1"],
            cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        (line,) = done.stdout.splitlines()
        read = json.loads(line)
        assert read["message"] == expected["message"] and read["key"] == "r-1", read
        assert read["value"]["request_id"] == "r-1"
        if "tier" in expected:
            assert read["value"]["prompt_ids"] == [5, 6, 7]
