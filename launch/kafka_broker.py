"""A local single-node Kafka broker (KRaft) for the integration tests and ``tierflow up``.

``scripts/kafka.sh`` does the work (fetching the jars from Maven Central once, formatting the
storage, starting and stopping the JVM); this class wraps it for Python: it picks free ports,
waits until the broker answers a client (not merely until the JVM says it started), and makes
sure the broker does not outlive the process that started it:

* ``stop()`` on exit from the ``with`` block, and an ``atexit`` hook for a caller that forgot;
* the script's watchdog (``TIERFLOW_KAFKA_OWNER_PID``) for a caller killed by SIGKILL, which runs
  no Python clean-up at all.

    with LocalKafkaBroker().start() as broker:
        settings = KafkaSettings(bootstrap=broker.bootstrap)
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from kafka import KafkaAdminClient
from kafka.errors import KafkaError

from launch.kafka_acls import superuser
from launch.processes import free_port
from tierflow.kafka_settings import KafkaSettings

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kafka.sh"
# The JVM alone takes a few seconds; two busy cores shared with tests can make it many more.
DEFAULT_START_TIMEOUT_S = 90.0
_LOG_TAIL_LINES = 40


class KafkaBrokerError(RuntimeError):
    """The local broker could not be started (the message ends with the tail of its log)."""


class LocalKafkaBroker:
    """One broker+controller process on 127.0.0.1, started by ``scripts/kafka.sh``."""

    def __init__(
        self,
        *,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        heap: str = "512m",
        script: Path = SCRIPT,
        tls_dir: Path | None = None,
    ) -> None:
        """``tls_dir``: the broker's own directory (``launch.certs.export`` of the ``kafka``
        identity); then the broker speaks only mTLS and enforces ACLs (``launch/kafka_acls``)."""
        self.tls_dir = tls_dir
        self.start_timeout_s = start_timeout_s
        self.heap = heap
        self.script = script
        self._data_dir: Path | None = None
        self._owns_data_dir = False
        self._port: int | None = None
        self.startup_s: float | None = None  # how long the last start() took

    # -- lifecycle -------------------------------------------------------------------------

    def start(
        self, data_dir: str | os.PathLike[str] | None = None, port: int | None = None
    ) -> LocalKafkaBroker:
        """Start the broker and return once a client can list its topics.

        ``data_dir``: where the data, config and ``broker.log`` go; a fresh temporary directory
        (removed again by ``stop()``) when omitted. A directory that already holds a formatted
        broker is reused as it is, so a restart keeps the topics and committed offsets.
        ``port``: the client port; a free one when omitted (and then, should another process
        take it first, start() tries again with new ports).
        """
        if self._port is not None:
            raise KafkaBrokerError(f"the broker is already running on {self.bootstrap}")
        if data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="tierflow-kafka-"))
            self._owns_data_dir = True
        else:
            self._data_dir = Path(data_dir).resolve()
            self._data_dir.mkdir(parents=True, exist_ok=True)
            self._owns_data_dir = False
        began = time.monotonic()
        # Ports picked here are free when picked, not necessarily when the JVM binds them.
        attempts = 1 if port is not None else 3
        for attempt in range(1, attempts + 1):
            client_port = port if port is not None else free_port()
            controller_port = free_port()
            while controller_port == client_port:
                controller_port = free_port()
            try:
                self._run_script(
                    "start", str(self._data_dir), str(client_port), str(controller_port)
                )
                self._port = client_port
                atexit.register(self.stop)
                self._wait_until_answering(began + self.start_timeout_s)
                break
            except KafkaBrokerError as exc:
                self._stop_process()
                if attempt == attempts or "Address already in use" not in str(exc):
                    self._discard_data_dir()
                    raise
        self.startup_s = time.monotonic() - began
        return self

    def stop(self) -> None:
        """Stop the broker (SIGTERM, then SIGKILL) and remove a data directory it made itself.
        Safe to call twice, and when start() failed."""
        self._stop_process()
        self._discard_data_dir()

    def __enter__(self) -> LocalKafkaBroker:
        if self._port is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- what a caller needs to know ------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._port is not None

    @property
    def port(self) -> int:
        if self._port is None:
            raise KafkaBrokerError("the broker is not running")
        return self._port

    @property
    def bootstrap(self) -> str:
        """``127.0.0.1:PORT``, for ``KafkaSettings(bootstrap=...)``."""
        return f"127.0.0.1:{self.port}"

    def admin_settings(self) -> KafkaSettings:
        """Settings of a client as the broker's super user: with TLS, the ``kafka`` identity."""
        if self.tls_dir is None:
            return KafkaSettings(bootstrap=self.bootstrap)
        return superuser(self.bootstrap, self.tls_dir)

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise KafkaBrokerError("the broker was never started")
        return self._data_dir

    @property
    def log_path(self) -> Path:
        return self.data_dir / "broker.log"

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except (OSError, KafkaBrokerError):
            return "(no broker.log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- internals -------------------------------------------------------------------------

    def _stop_process(self) -> None:
        atexit.unregister(self.stop)
        if self._data_dir is not None and (self._data_dir / "broker.pid").exists():
            with contextlib.suppress(KafkaBrokerError):
                self._run_script("stop", str(self._data_dir))
        self._port = None

    def _run_script(self, *args: str) -> None:
        env = {
            **os.environ,
            "KAFKA_HEAP": self.heap,
            "KAFKA_START_TIMEOUT": str(int(self.start_timeout_s)),
            # The script's watchdog stops the broker once this process is gone, however it died.
            "TIERFLOW_KAFKA_OWNER_PID": str(os.getpid()),
            **({"KAFKA_TLS_DIR": str(self.tls_dir)} if self.tls_dir is not None else {}),
        }
        try:
            done = subprocess.run(
                ["bash", str(self.script), *args],
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                # The script enforces its own limits; this only guards against a hung shell.
                timeout=self.start_timeout_s + 60,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise KafkaBrokerError(
                f"kafka.sh {args[0]} hung\n--- broker.log (tail) ---\n{self.log_tail()}"
            ) from exc
        if done.returncode != 0:
            stderr = done.stderr.strip()
            log_tail = self.log_tail()
            if log_tail != "(no broker.log)" and stderr:
                stderr = stderr.splitlines()[-1]  # the script repeated the log's tail before it
            raise KafkaBrokerError(
                f"kafka.sh {args[0]} failed (exit {done.returncode}): {stderr}\n"
                f"--- broker.log (tail) ---\n{log_tail}"
            )

    def _wait_until_answering(self, deadline: float) -> None:
        """The JVM's "started" line precedes the listener being ready for clients now and then;
        a metadata request is the check that counts."""
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            remaining_ms = max(1000, int((deadline - time.monotonic()) * 1000))
            try:
                timeout_ms = min(remaining_ms, 10_000)
                admin = KafkaAdminClient(
                    **{
                        **self.admin_settings().admin_config(),
                        "bootstrap_timeout_ms": timeout_ms,
                        "request_timeout_ms": timeout_ms,
                    }
                )
                try:
                    admin.list_topics()
                    return
                finally:
                    admin.close()
            except KafkaError as exc:
                last_error = exc
                time.sleep(0.2)
        raise KafkaBrokerError(
            f"the broker on {self.bootstrap} did not answer within {self.start_timeout_s:.0f} s "
            f"({last_error!r})\n--- broker.log (tail) ---\n{self.log_tail()}"
        )

    def _discard_data_dir(self) -> None:
        if self._owns_data_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._owns_data_dir = False
