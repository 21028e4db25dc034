"""Kafka settings: the one place that says how tierflow talks to Kafka, and what topics are called.

Every producer, consumer and admin client in tierflow gets its configuration from here, so the
choices below hold everywhere. They are made for latency, not throughput: a critical request is
a few hundred bytes that must reach the scheduler in milliseconds, while the volume is small.

* Producer: ``linger_ms=0`` (send at once, never wait to fill a batch), ``acks='all'`` and
  idempotence (a request the client was told is queued survives a broker restart and is never
  written twice by a retry). The service tells a client ``Queued`` only after the broker's ack.
* Consumer: manual commits only (a request is committed when it is finished, not when it is
  read); ``earliest`` so that a new group starts at the oldest request rather than skipping the
  backlog; few records per poll so that a batch backlog stays in Kafka rather than in memory.
  ``fetch_max_wait_ms`` is NOT what makes an arrival fast: a fetch is a long poll that the
  broker answers as soon as one record arrives (``fetch_min_bytes=1``). It bounds how long a
  just-resumed partition (strict priority) waits for the fetch in flight. Measured here (two
  busy cores, idle consumer): 5 ms cost about 13% of a core in the client plus 13% in the broker
  and delivered no faster than 50 ms, which costs about 5% + 5%; hence 50.
* Group timeouts small enough that a test (or a crashed instance) does not wait long for a
  rebalance, and large enough for two busy cores. The broker's default
  ``group.min.session.timeout.ms`` is 6000, the floor for ``session_timeout_ms``.

Topic names: ``<prefix>priority_<tier>`` for the tier queues (docs/design.md, "Data flow"),
``<prefix>reply_<id>`` for the reply topic of one queue-service instance, ``<prefix>request_log``
for the record of every finished request (kept ``request_log_retention_ms``, a week by
default), ``<prefix>capacity`` for the committed work of the tiers admission judges (read by
admission on every instance; kept ``capacity_retention_ms``). A canary deployment has tier
topics of its own (another prefix) but writes to the primary's request log (``request_log``),
so that one topic holds both sides of a rollout.

Security: with ``tls_dir`` set, every client speaks mTLS to the broker, presenting the
certificate of ``tls_identity`` (a file stem of ``tierflow certs``: ``queue-service``,
``operator``), and the broker's ACLs decide what that principal may do
(``launch/kafka_acls.py``). Empty: PLAINTEXT, for a broker on loopback in development.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

BOOTSTRAP_ENV = "TIERFLOW_KAFKA_BOOTSTRAP"
TOPIC_PREFIX_ENV = "TIERFLOW_KAFKA_TOPIC_PREFIX"
GROUP_ID_ENV = "TIERFLOW_KAFKA_GROUP_ID"
PARTITIONS_ENV = "TIERFLOW_KAFKA_PARTITIONS"
REPLICATION_FACTOR_ENV = "TIERFLOW_KAFKA_REPLICATION_FACTOR"
REQUEST_LOG_ENV = "TIERFLOW_KAFKA_REQUEST_LOG"
TLS_DIR_ENV = "TIERFLOW_KAFKA_TLS_DIR"

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"

# Kafka's own rule for topic names (kafka.common.internals.Topic): at most 249 of these.
_TOPIC_CHARS = re.compile(r"^[A-Za-z0-9._-]+$")
_MAX_TOPIC_LEN = 249


def _check_topic(name: str) -> str:
    if not _TOPIC_CHARS.match(name) or len(name) > _MAX_TOPIC_LEN or name in {".", ".."}:
        raise ValueError(
            f"{name!r} is not a legal Kafka topic name: use letters, digits, '.', '_' or '-', "
            f"at most {_MAX_TOPIC_LEN} characters"
        )
    return name


def tier_topic(prefix: str, tier: str) -> str:
    """The topic that queues the requests of ``tier``: ``<prefix>priority_<tier>``."""
    return _check_topic(f"{prefix}priority_{tier}")


def reply_topic(prefix: str, instance_id: str) -> str:
    """The topic on which the queue-service instance ``instance_id`` receives the events of its
    clients' requests that another instance runs: ``<prefix>reply_<instance_id>``."""
    return _check_topic(f"{prefix}reply_{instance_id}")


def request_log_topic(prefix: str) -> str:
    """The topic of finished-request records (``tierflow audit``, ``tierflow compare``)."""
    return _check_topic(f"{prefix}request_log")


def capacity_topic(prefix: str) -> str:
    """The topic of tier loads for admission against capacity (``TierCapacity`` records)."""
    return _check_topic(f"{prefix}capacity")


@dataclass(frozen=True)
class KafkaSettings:
    """Where the broker is, what the topics are called, and how clients behave."""

    bootstrap: str = DEFAULT_BOOTSTRAP
    topic_prefix: str = "tierflow."
    group_id: str = "tierflow-queue"
    client_id: str = "tierflow"
    # Topic layout when tierflow creates the topics. One partition per tier keeps the order of
    # arrival within a tier; several queue-service instances share a tier with more.
    partitions: int = 1
    replication_factor: int = 1
    # Replies matter only while the client's stream is open; an hour is plenty.
    reply_retention_ms: int = 60 * 60 * 1000
    # The request-log topic; "": <prefix>request_log. What an audit reads: a week of it.
    request_log: str = ""
    request_log_retention_ms: int = 7 * 24 * 60 * 60 * 1000
    # Tier loads are republished several times a second and useless after a few: a minute.
    capacity_retention_ms: int = 60 * 1000
    # mTLS to the broker: the directory of the CA and the identity's key and certificate, and
    # the identity's file stem. "": plaintext (``TIERFLOW_KAFKA_TLS_DIR``).
    tls_dir: str = ""
    tls_identity: str = ""

    # Producer: how long a publish may take before the client hears UNAVAILABLE.
    request_timeout_ms: int = 5_000
    delivery_timeout_ms: int = 10_000
    max_block_ms: int = 10_000

    # Consumer.
    fetch_max_wait_ms: int = 50
    max_poll_records: int = 16
    session_timeout_ms: int = 6_000
    heartbeat_interval_ms: int = 1_000
    max_poll_interval_ms: int = 60_000
    consumer_request_timeout_ms: int = 30_000

    # How long a client waits for the first broker connection before giving up.
    bootstrap_timeout_ms: int = 10_000
    # A lost broker connection is retried with exponential backoff up to this. kafka-python's
    # default (30 s) left a service that outlived a broker restart idle for up to 30 s after
    # the broker was back; one second costs a few refused connects per second during an outage.
    reconnect_backoff_max_ms: int = 1_000

    def __post_init__(self) -> None:
        if not self.bootstrap.strip():
            raise ValueError("bootstrap must name at least one host:port")
        if self.topic_prefix:
            _check_topic(self.topic_prefix)
        if not self.group_id:
            raise ValueError("group_id must not be empty")
        # Annotations are strings here (``from __future__ import annotations``).
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{f.name} must be an integer, got {value!r}")
            if f.type == "int" and value < 1 and f.name != "fetch_max_wait_ms":
                raise ValueError(f"{f.name} must be >= 1, got {value!r}")
        if self.fetch_max_wait_ms < 0:
            raise ValueError(f"fetch_max_wait_ms must be >= 0, got {self.fetch_max_wait_ms}")
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            # Kafka's rule of thumb: several heartbeats must fit in one session.
            raise ValueError("heartbeat_interval_ms must be at most a third of session_timeout_ms")
        if self.tls_dir and not self.tls_identity:
            raise ValueError("tls_dir needs tls_identity: whose certificate to present")
        if self.delivery_timeout_ms < self.request_timeout_ms:
            raise ValueError("delivery_timeout_ms must be >= request_timeout_ms (linger is 0)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> KafkaSettings:
        """Settings from ``TIERFLOW_KAFKA_*`` variables; keyword arguments win over both."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name, var, parse in (
            ("bootstrap", BOOTSTRAP_ENV, str),
            ("topic_prefix", TOPIC_PREFIX_ENV, str),
            ("group_id", GROUP_ID_ENV, str),
            ("partitions", PARTITIONS_ENV, int),
            ("replication_factor", REPLICATION_FACTOR_ENV, int),
            ("request_log", REQUEST_LOG_ENV, str),
            ("tls_dir", TLS_DIR_ENV, str),
        ):
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            try:
                values[name] = parse(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not a valid {name}") from None
        values.update(overrides)
        return cls(**values)

    def tier_topic(self, tier: str) -> str:
        return tier_topic(self.topic_prefix, tier)

    def reply_topic(self, instance_id: str) -> str:
        return reply_topic(self.topic_prefix, instance_id)

    @property
    def request_log_topic(self) -> str:
        if self.request_log:
            return _check_topic(self.request_log)
        return request_log_topic(self.topic_prefix)

    @property
    def capacity_topic(self) -> str:
        return capacity_topic(self.topic_prefix)

    # Client configurations (kafka-python 3 keyword arguments).

    def _common(self) -> dict[str, Any]:
        return {
            "bootstrap_servers": self.bootstrap,
            "bootstrap_timeout_ms": self.bootstrap_timeout_ms,
            "reconnect_backoff_max_ms": self.reconnect_backoff_max_ms,
            **self._security(),
        }

    def _security(self) -> dict[str, Any]:
        if not self.tls_dir:
            return {"security_protocol": "PLAINTEXT"}
        stem = os.path.join(self.tls_dir, self.tls_identity)
        return {
            "security_protocol": "SSL",
            "ssl_cafile": os.path.join(self.tls_dir, "ca.pem"),
            "ssl_certfile": f"{stem}.pem",
            "ssl_keyfile": f"{stem}.key",
            "ssl_check_hostname": True,  # the broker's certificate names 127.0.0.1 and kafka
        }

    def producer_config(self) -> dict[str, Any]:
        return {
            **self._common(),
            "client_id": f"{self.client_id}-producer",
            "acks": "all",
            "enable_idempotence": True,
            "linger_ms": 0,
            # Idempotence keeps order with up to 5 requests in flight; no need to serialise.
            "max_in_flight_requests_per_connection": 5,
            "request_timeout_ms": self.request_timeout_ms,
            "delivery_timeout_ms": self.delivery_timeout_ms,
            "max_block_ms": self.max_block_ms,
            # Topics are created on purpose (ensure_topics); a typo must fail, not create one.
            "allow_auto_create_topics": False,
        }

    def consumer_config(
        self, group_id: str | None = None, *, standalone: bool = False
    ) -> dict[str, Any]:
        """Consumer settings in ``group_id`` (default: this settings' group), or in no group at
        all with ``standalone`` (manually assigned partitions, nothing committed)."""
        return {
            **self._common(),
            "client_id": f"{self.client_id}-consumer",
            "group_id": None if standalone else (group_id or self.group_id),
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "fetch_max_wait_ms": self.fetch_max_wait_ms,
            "fetch_min_bytes": 1,
            "max_poll_records": self.max_poll_records,
            "session_timeout_ms": self.session_timeout_ms,
            "heartbeat_interval_ms": self.heartbeat_interval_ms,
            "max_poll_interval_ms": self.max_poll_interval_ms,
            "request_timeout_ms": self.consumer_request_timeout_ms,
            "allow_auto_create_topics": False,
        }

    def admin_config(self) -> dict[str, Any]:
        return {
            **self._common(),
            "client_id": f"{self.client_id}-admin",
            "request_timeout_ms": self.consumer_request_timeout_ms,
        }
