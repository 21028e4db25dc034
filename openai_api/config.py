"""The OpenAI-compatible service's settings (the command line's defaults come from here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from openai_api.service_tiers import DEFAULT_SERVICE_TIERS


@dataclass(frozen=True)
class OpenAIApiConfig:
    listen: str = "127.0.0.1:8000"
    queue_service: str = "127.0.0.1:50051"
    # The queue service's model: its tokenizer (chat template) and context length. Must match.
    model: str = "tiny-llama"
    served_model_name: str | None = None  # the ``model`` clients send; None: ``model``
    tiers_file: Path | None = None  # None: $TIERFLOW_TIERS_FILE, else config/tiers.toml
    # OpenAI's service_tier -> tier
    service_tiers: Mapping[str, str] = field(default_factory=lambda: DEFAULT_SERVICE_TIERS)
    # Tokens to generate when a request does not say: chat (clamped to the room left in the
    # context) and completions (OpenAI's documented default).
    chat_default_max_tokens: int = 1024
    completion_default_max_tokens: int = 16
    # Retry-After (seconds) for a shed request (429) and an unreachable queue service (503).
    retry_after_s: int = 5
    # mTLS (``tierflow certs``): to the queue service as the ``openai-api`` identity, and on
    # its own listener, which accepts the edge's certificate only. None: plaintext.
    tls_dir: Path | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
