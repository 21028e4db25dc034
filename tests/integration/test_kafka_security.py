"""Kafka holds tenants' prompts behind more than network placement: a real broker of this
module's own with mTLS listeners and ACLs (``scripts/kafka.sh`` with ``KAFKA_TLS_DIR``), granted
by ``launch.kafka_acls`` as ``tierflow up`` grants them, and a real queue service and worker
serving a request through it.

Who may do what (``launch/kafka_acls.py``): the queue service everything on its topics, the
request log write-only; the operator (the ops tools) reads the request log and nothing else;
anyone else nothing, and a client without a certificate of the CA does not connect at all.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import (
    GroupAuthorizationFailedError,
    KafkaTimeoutError,
    TopicAuthorizationFailedError,
)

from launch.certs import ensure, export
from launch.kafka_acls import grant
from launch.kafka_broker import LocalKafkaBroker
from ops.records import LogRecord, iter_kafka
from tests.integration.processes import operator, start_queue_service, start_worker
from tierflow.client import TierflowClient
from tierflow.identity import Identity, Role
from tierflow.kafka_settings import KafkaSettings

MODEL = "tiny-llama"
# Short client timeouts: a refused connection must fail the test quickly, not after 10 s.
QUICK = {"bootstrap_timeout_ms": 4000, "request_timeout_ms": 4000, "max_block_ms": 4000}
QUICK |= {"delivery_timeout_ms": 4000}


@pytest.fixture(scope="module")
def secure_kafka(tmp_path_factory, certs):
    """A broker of this module's own, mTLS only, with the ACLs of a deployment on ``prefix``."""
    broker = LocalKafkaBroker(tls_dir=export(certs, Identity(Role.KAFKA)))
    broker.start(data_dir=tmp_path_factory.mktemp("secure-kafka"))
    prefix = f"t{uuid.uuid4().hex[:12]}."
    try:
        grant(
            broker.admin_settings(),
            topic_prefixes=[prefix],
            request_log=f"{prefix}request_log",
            group_prefix=f"{prefix}queue",
        )
        yield broker, prefix
    finally:
        broker.stop()


def as_(secure_kafka, certs: Path, identity: Identity | None, **kw) -> KafkaSettings:
    """Settings of a client of ``secure_kafka`` presenting ``identity`` (None: plaintext)."""
    broker, prefix = secure_kafka
    tls = {"tls_dir": str(certs), "tls_identity": identity.file_stem} if identity else {}
    return KafkaSettings(
        bootstrap=broker.bootstrap, topic_prefix=prefix, group_id=f"{prefix}queue",
        **tls, **QUICK, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory, secure_kafka, certs):
    """A queue service that reaches Kafka as ``queue-service`` over mTLS, and worker w0, having
    served one critical request: the tier topics and the request log exist and hold records."""
    tmp = tmp_path_factory.mktemp("served")
    settings = as_(secure_kafka, certs, Identity(Role.QUEUE_SERVICE))
    qs, target = start_queue_service(
        tmp, settings, model=MODEL, tls_dir=certs, extra=["--kafka-tls-dir", str(certs)]
    )
    started = [qs]
    try:
        started.append(start_worker(tmp, target, "w0", model=MODEL, tls_dir=certs))
        with TierflowClient(target, tier="critical", credentials=operator(certs)) as client:
            done = client.complete("hello over mTLS", max_new_tokens=2, timeout=120)
        assert done.text is not None and done.tier == "critical"
        yield settings
    finally:
        for proc in reversed(started):
            proc.stop()


def tier_topic(secure_kafka) -> str:
    return KafkaSettings(topic_prefix=secure_kafka[1]).tier_topic("critical")


def read(settings: KafkaSettings, topic: str) -> int:
    """How many records ``topic`` holds, read from the start: its end offset (what DESCRIBE
    allows), then a fetch of every record (what READ allows)."""
    consumer = KafkaConsumer(**settings.consumer_config(standalone=True))
    try:
        partition = TopicPartition(topic, 0)
        end = consumer.end_offsets([partition])[partition]
        consumer.assign([partition])
        consumer.seek_to_beginning(partition)
        got = 0
        for _ in range(20):
            if got >= end:
                break
            got += sum(len(batch) for batch in consumer.poll(timeout_ms=500).values())
        assert got == end, f"read {got} of the {end} records of {topic}"
        return got
    finally:
        consumer.close()


def produce(settings: KafkaSettings, topic: str) -> None:
    producer = KafkaProducer(**settings.producer_config())
    try:
        producer.send(topic, b"forged request").get(timeout=10)
    finally:
        producer.close()


def test_the_queue_service_serves_through_a_broker_that_requires_mtls(served, secure_kafka):
    # The request went through the tier topic: the queue service wrote and read it.
    assert read(served, tier_topic(secure_kafka)) >= 1
    with pytest.raises(TopicAuthorizationFailedError):  # it writes the request log, never reads
        read(served, served.request_log_topic)
    admin = KafkaAdminClient(**served.admin_config())
    try:  # ...nor erases it
        with pytest.raises(TopicAuthorizationFailedError):
            admin.delete_topics([served.request_log_topic], timeout_ms=4000)
    finally:
        admin.close()


def test_the_operator_reads_the_request_log_and_nothing_else(served, secure_kafka, certs):
    operator = as_(secure_kafka, certs, Identity(Role.OPERATOR))
    records = [LogRecord.from_proto(m) for m in iter_kafka(operator)]
    assert [r.tier for r in records] == ["critical"]
    with pytest.raises(TopicAuthorizationFailedError):
        read(operator, tier_topic(secure_kafka))
    with pytest.raises(TopicAuthorizationFailedError):  # no forged requests from the ops tools
        produce(operator, tier_topic(secure_kafka))
    consumer = KafkaConsumer(tier_topic(secure_kafka), **operator.consumer_config())
    try:
        with pytest.raises(GroupAuthorizationFailedError):  # nor a seat in the service's group
            consumer.poll(timeout_ms=4000)
    finally:
        consumer.close()


@pytest.mark.parametrize("role", [Role.EDGE, Role.GATEWAY, Role.WORKER])
def test_other_identities_of_the_ca_can_neither_read_nor_write_a_tier_topic(
    served, secure_kafka, certs, role
):
    identity = Identity.worker("w0") if role is Role.WORKER else Identity(role)
    settings = as_(secure_kafka, certs, identity)
    with pytest.raises(TopicAuthorizationFailedError):
        read(settings, tier_topic(secure_kafka))
    with pytest.raises(TopicAuthorizationFailedError):
        produce(settings, tier_topic(secure_kafka))


def test_a_client_without_a_certificate_of_the_ca_does_not_connect(
    served, secure_kafka, certs, tmp_path
):
    with pytest.raises(KafkaTimeoutError):  # plaintext: no handshake
        read(as_(secure_kafka, certs, None), tier_topic(secure_kafka))
    # The right name, issued by another CA; the client trusts ours, so only the broker can
    # refuse it.
    other_ca = tmp_path / "other-ca"
    ensure(other_ca, [Identity(Role.QUEUE_SERVICE)])
    shutil.copy(certs / "ca.pem", other_ca / "ca.pem")
    with pytest.raises(KafkaTimeoutError):
        read(as_(secure_kafka, other_ca, Identity(Role.QUEUE_SERVICE)), "x")
