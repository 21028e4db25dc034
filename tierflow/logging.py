"""structlog set-up, done once per process.

Services log JSON, one line per event; interactive commands log in a readable console format.
Bind ``request_id`` and ``tier`` with ``structlog.contextvars.bind_contextvars`` (or
``log.bind``) so every line of a request carries them.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


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
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level_name)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=level_name, stream=sys.stderr, format="%(name)s %(message)s")
    _configured = True


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
