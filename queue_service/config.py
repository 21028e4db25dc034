"""The queue service's configuration: the single home of its defaults.

``tierflow queue-service`` (``queue_service.server``) and the local stack read their defaults
from here.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from tierflow.catalogue import DEFAULT_MODEL
from tierflow.kafka_settings import KafkaSettings
from tierflow.metrics import DEFAULT_DEPLOYMENT


@dataclass(frozen=True)
class QueueServiceConfig:
    listen: str = "127.0.0.1:50051"
    model: str = DEFAULT_MODEL  # its tokenizer and context length: the workers' model
    policy: str = "flowprefill"
    tiers_file: Path | None = None
    predictor_file: Path | None = None
    kafka: KafkaSettings = field(default_factory=KafkaSettings.from_env)
    instance_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    heartbeat_timeout_s: float = 3.0
    max_new_tokens: int = 1024
    max_live: int = 256  # requests taken from Kafka and not finished; the rest wait in Kafka
    grace_s: float = 5.0
    # A client stream ends this long before its gRPC deadline (at most a quarter of it), so that
    # its terminal event and status beat the edge's timer for the same deadline.
    deadline_margin_s: float = 0.5
    deployment: str = DEFAULT_DEPLOYMENT  # the label of its metrics and request-log records
    metrics_port: int | None = None  # Prometheus /metrics; None: not served, 0: a free port
