"""The gateway's configuration: the single home of its defaults (its command line and the local
stack read them from here)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tierflow.metrics import DEFAULT_DEPLOYMENT, METRICS_LOOPBACK

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class GatewayConfig:
    listen: str = "127.0.0.1:50052"
    keys_file: Path = REPO / "config" / "keys.toml"
    tiers_file: Path | None = None  # None: $TIERFLOW_TIERS_FILE, else config/tiers.toml
    keys_check_interval_s: float = 1.0  # how often a Check looks at the keys file's mtime
    grace_s: float = 5.0
    deployment: str = DEFAULT_DEPLOYMENT  # the label of its metrics
    metrics_port: int | None = None  # Prometheus /metrics; None: not served, 0: a free port
    # mTLS: the CA and the gateway's identity (``tierflow certs``); only the edge may call.
    # None: plaintext, for development only (``--plaintext``).
    tls_dir: Path | None = None
    # Where /metrics listens: loopback unless the deployment opens it (compose: its network).
    metrics_host: str = METRICS_LOOPBACK
