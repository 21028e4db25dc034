"""The queue service's configuration: the single home of its defaults.

``tierflow queue-service`` (``queue_service.server``) and the local stack read their defaults
from here.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from queue_service.scheduler import SchedulerConfig
from tierflow.catalogue import DEFAULT_MODEL
from tierflow.identity import Identity, Role
from tierflow.kafka_settings import KafkaSettings
from tierflow.metrics import DEFAULT_DEPLOYMENT, METRICS_LOOPBACK


def kafka_from_env(**overrides) -> KafkaSettings:
    """The queue service's Kafka settings (``KafkaSettings.from_env``): over mTLS, when the
    environment or ``overrides`` name a directory, as the ``queue-service`` identity."""
    return KafkaSettings.from_env(**overrides, tls_identity=Identity(Role.QUEUE_SERVICE).file_stem)


@dataclass(frozen=True)
class QueueServiceConfig:
    listen: str = "127.0.0.1:50051"
    model: str = DEFAULT_MODEL  # its tokenizer and context length: the workers' model
    policy: str = "flowprefill"
    tiers_file: Path | None = None
    predictor_file: Path | None = None
    # Refit the prefill predictor from every finished prefill (``SchedulerConfig``). Off: it
    # keeps ``predictor_file``'s coefficients, so that what admission predicts does not
    # follow this machine's speed (tests that fix the predicted cost of a prompt).
    refit_predictor: bool = SchedulerConfig.refit_predictor
    kafka: KafkaSettings = field(default_factory=kafka_from_env)
    instance_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    heartbeat_timeout_s: float = 3.0
    # A request that waits this long with no worker attached ends with UNAVAILABLE, not run
    # (its client was told at once that no worker is attached).
    no_worker_timeout_s: float = 60.0
    # Shedding: a sheddable tier's request is refused when this many of them already wait.
    max_queued_sheddable: int = SchedulerConfig.max_queued_sheddable
    max_new_tokens: int = 1024
    max_live: int = 256  # requests taken from Kafka and not finished; the rest wait in Kafka
    grace_s: float = 5.0
    # A client stream ends this long before its gRPC deadline (at most a quarter of it), so that
    # its terminal event and status beat the edge's timer for the same deadline.
    deadline_margin_s: float = 0.5
    # A client stream with nothing to send for this long gets a Heartbeat event, so that no
    # proxy's idle timeout (Envoy's: 60 s on the critical route) cuts a request still queued.
    stream_heartbeat_s: float = 10.0
    # Admission against capacity (tiers with an `overflow` rule): how often an instance that
    # schedules such a tier publishes its load to every instance, and how old a load may be
    # before it no longer counts (its owner is gone).
    capacity_publish_s: float = 0.2
    capacity_stale_s: float = 3.0
    deployment: str = DEFAULT_DEPLOYMENT  # the label of its metrics and request-log records
    metrics_port: int | None = None  # Prometheus /metrics; None: not served, 0: a free port
    # Where /metrics listens: loopback unless the deployment opens it (compose: its network).
    metrics_host: str = METRICS_LOOPBACK
    # mTLS: the CA and the queue service's identity (``tierflow certs``). None: plaintext, for
    # development only (``--plaintext``): every peer is trusted (``queue_service/trust.py``).
    tls_dir: Path | None = None
