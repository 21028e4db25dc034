"""structlog set-up, done once per process.

Services log JSON, one line per event; interactive commands log in a readable console format.
Libraries that log through the standard ``logging`` module go through the same renderer, so a
service's log stays one JSON object per line; kafka-python's chatty INFO lines (every connect,
every metadata refresh) are dropped: it logs at WARNING and above.
Bind ``request_id`` and ``tier`` with ``structlog.contextvars.bind_contextvars`` (or
``log.bind``) so every line of a request carries them.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


class _CurrentStderr:
    """Writes to ``sys.stderr`` as it is at each write, not as it was at set-up: whatever
    replaces it later (a test runner capturing one test's output, then closing that file) must
    not leave every later log call, on any thread, raising on a closed file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(*, json: bool | None = None, level: str | None = None) -> None:
    """Configure structlog and the stdlib root logger. Later calls are no-ops."""
    global _configured
    if _configured:
        return
    level_name = (level or os.environ.get("TIERFLOW_LOG_LEVEL", "INFO")).upper()
    if json is None:
        json = os.environ.get("TIERFLOW_LOG_FORMAT", "console") == "json"
    renderer = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, *shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level_name)),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
    # The standard library's records (kafka-python, grpc, ...) through the same renderer.
    handler = logging.StreamHandler(_CurrentStderr())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_name)
    kafka_level = max(logging.WARNING, logging.getLevelName(level_name))
    logging.getLogger("kafka").setLevel(kafka_level)
    _configured = True


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
