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


REPLACED_STDERR = """
import io, logging, sys, threading, structlog
from tierflow.logging import configure_logging
real, sys.stderr = sys.stderr, io.StringIO()  # a test runner's capture of one test
configure_logging(json=True)
structlog.get_logger("worker").info("while captured")
sys.stderr.close()
sys.stderr = real  # the capture ends; later lines, from any thread, go where stderr is now
thread = threading.Thread(target=lambda: structlog.get_logger("worker").warning("after"))
thread.start(); thread.join()
logging.getLogger("grpc._server").warning("a library line after")
"""


def test_logging_writes_where_stderr_is_now_not_where_it_was_at_setup():
    """An engine thread died on a log line written to a test's closed capture file: the
    logging set up during an earlier test kept that file."""
    done = subprocess.run(
        [sys.executable, "-c", REPLACED_STDERR],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    events = [json.loads(line)["event"] for line in done.stderr.splitlines()]
    assert events == ["after", "a library line after"]
