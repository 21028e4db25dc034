"""A service's log is one JSON object per line, library records included; kafka-python's INFO
chatter is dropped (run in a child process: logging is configured once per process)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import logging, structlog
from tierflow.logging import configure_logging
configure_logging(json=True)
logging.getLogger("kafka.net.manager").info("Initializing connection for node_id 1")
logging.getLogger("kafka.cluster").warning("No node available for metadata refresh")
logging.getLogger("grpc._server").info("a library line at INFO")
structlog.get_logger("queue_service").info("queued", request_id="r1")
"""


def test_library_lines_are_json_and_kafka_python_logs_from_warning_up():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=60
    )
    lines = [json.loads(line) for line in done.stderr.splitlines()]  # every line is JSON
    events = {(e.get("logger"), e["event"]) for e in lines}
    assert ("kafka.cluster", "No node available for metadata refresh") in events
    assert ("grpc._server", "a library line at INFO") in events
    assert (None, "queued") in events
    assert not any("Initializing connection" in e["event"] for e in lines)
    assert {e["level"] for e in lines} == {"warning", "info"}
