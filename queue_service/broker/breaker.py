"""Fail fast while Kafka is known to be down; find out quickly when it is back.

Without this, every request that arrives during an outage waits the producer's whole delivery
timeout (10 s) before its client hears UNAVAILABLE. ``KafkaBreaker`` is a circuit breaker with
two states:

* **closed**: writes go to Kafka. A write that fails (``QueueUnavailableError``) opens it, and
  so does a probe that finds no broker listening (``tcp_reachable``, a TCP connect to the
  bootstrap addresses each ``probe_interval_s``: a broker that is gone is noticed within about a
  second, not after a request's timeout).
* **open**: writes fail at once with ``QueueUnavailableError``, nothing waits. Each
  ``probe_interval_s`` a probe asks the broker for its metadata (``broker_answers``, a fresh
  admin client with a short timeout); the first answer closes the breaker. There is no
  half-open state in which a client's request is the trial: a probe is.

A write that started before the breaker last closed and fails after it does not open it again
(it failed for the outage that is over). Closing first calls ``on_recovered``: the service
renews its Kafka producer there, because kafka-python's idempotent producer can stay wedged
after a broker restart (in CI every write then timed out for a minute and more while fresh
clients were answered at once). The probes run on a thread of their own (``start``);
``probe_once`` is the same step, for tests. Thread-safe: writes come from executor threads.

Not a library: ``pybreaker`` holds its lock for the whole protected call, which would serialise
the service's concurrent writes (each waits for the broker's ack), and neither it nor
``circuitbreaker`` or ``purgatory`` (asyncio only) lets a background probe open or close it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import structlog
from kafka import KafkaAdminClient
from kafka.errors import KafkaError

from queue_service.broker.io import QueueUnavailableError
from tierflow.kafka_settings import KafkaSettings

log = structlog.get_logger("queue_service.broker.breaker")

T = TypeVar("T")


def bootstrap_addresses(bootstrap: str) -> list[tuple[str, int]]:
    out = []
    for entry in bootstrap.split(","):
        host, _, port = entry.strip().rpartition(":")
        out.append((host.strip("[]") or "localhost", int(port)))
    return out


def tcp_reachable(bootstrap: str, timeout_s: float) -> bool:
    """Some bootstrap address accepts a TCP connection (a broker process listens there)."""
    for host, port in bootstrap_addresses(bootstrap):
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return True
        except OSError:
            continue
    return False


def broker_answers(settings: KafkaSettings, timeout_s: float) -> bool:
    """A broker answers a metadata request within ``timeout_s``."""
    timeout_ms = max(1, int(timeout_s * 1000))
    try:
        admin = KafkaAdminClient(
            **{
                **settings.admin_config(),
                "bootstrap_timeout_ms": timeout_ms,
                "request_timeout_ms": timeout_ms,
            }
        )
    except KafkaError:
        return False
    try:
        admin.list_topics()
        return True
    except KafkaError:
        return False
    finally:
        admin.close()


class KafkaBreaker:
    def __init__(
        self,
        *,
        reachable: Callable[[float], bool],
        answers: Callable[[float], bool],
        probe_interval_s: float = 1.0,
        probe_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        on_recovered: Callable[[], None] = lambda: None,
    ) -> None:
        self._reachable = reachable
        self._answers = answers
        self._on_recovered = on_recovered
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._opened_at: float | None = None  # None: closed
        self._closed_at = clock()
        self._why = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_kafka(cls, settings: KafkaSettings, **kwargs) -> KafkaBreaker:
        return cls(
            reachable=lambda timeout: tcp_reachable(settings.bootstrap, timeout),
            answers=lambda timeout: broker_answers(settings, timeout),
            **kwargs,
        )

    @property
    def is_open(self) -> bool:
        return self._opened_at is not None

    def call(self, write: Callable[..., T], *args) -> T:
        """``write(*args)``, unless Kafka is known to be down: then QueueUnavailableError at
        once. A write that raises QueueUnavailableError opens the breaker."""
        with self._lock:
            opened_at, why = self._opened_at, self._why
        if opened_at is not None:
            down_s = self._clock() - opened_at
            raise QueueUnavailableError(f"Kafka is unreachable ({why}, {down_s:.0f} s ago)")
        started = self._clock()
        try:
            return write(*args)
        except QueueUnavailableError as exc:
            self._open(f"a write failed: {exc}", started)
            raise

    def probe_once(self) -> None:
        """One probe: open when no broker listens; close when one answers again."""
        if self.is_open:
            if self._answers(self.probe_timeout_s):
                self._close()
        elif not self._reachable(self.probe_timeout_s):
            self._open("no broker accepts connections", self._clock())

    def start(self) -> KafkaBreaker:
        self._thread = threading.Thread(target=self._probe_loop, name="kafka-probe", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.probe_timeout_s * 3 + self.probe_interval_s)

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.probe_interval_s):
            try:
                self.probe_once()
            except Exception:  # a probe must never end the loop
                log.exception("kafka probe failed")

    def _open(self, why: str, failure_started: float) -> None:
        with self._lock:
            if self._opened_at is not None or failure_started < self._closed_at:
                return  # open already, or a failure from before the last recovery
            self._opened_at, self._why = self._clock(), why
        log.error("kafka unavailable: failing requests fast until it answers again", why=why)

    def _close(self) -> None:
        if self._opened_at is None:
            return
        # Before writes are let through (they must find what it renews), and outside the lock:
        # writes meanwhile still fail fast instead of waiting for it.
        try:
            self._on_recovered()
        except Exception:  # the broker answers: accept requests even so
            log.exception("kafka recovery hook failed")
        with self._lock:
            if self._opened_at is None:
                return
            down_s = self._clock() - self._opened_at
            self._opened_at, self._closed_at, self._why = None, self._clock(), ""
        log.warning("kafka answers again: accepting requests", down_s=round(down_s, 1))
