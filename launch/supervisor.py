"""Keeps the local stack's children running: restart with backoff, give up loudly.

``tierflow up`` starts the services as child processes (``launch.local_stack``). A child that
exits while the stack runs (crashed, killed, OOM) is noticed within ``poll_s``, reaped (no
zombie), logged with its exit code, and started again with the same command line and log file
after a backoff (``min_backoff_s`` doubling to ``max_backoff_s``, with jitter; reset once a child
stayed up ``healthy_after_s``). A child that exits ``max_restarts`` times within ``window_s`` is
given up on: the supervisor logs an error that says which child and where its log is, and sets
``failed``, on which ``tierflow up`` stops the whole stack and exits non-zero. Restarted children
find each other again by themselves: the queue service comes back on the same port, workers
redial it, and requests wait in Kafka meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import structlog

from launch.processes import ServiceProcess
from worker.backoff import Backoff

log = structlog.get_logger("tierflow.supervisor")


@dataclass(frozen=True)
class RestartPolicy:
    min_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    healthy_after_s: float = 60.0  # up this long: the next exit starts the backoff over
    max_restarts: int = 5  # exits within window_s before giving up
    window_s: float = 300.0
    poll_s: float = 0.5


@dataclass
class _Child:
    proc: ServiceProcess
    backoff: Backoff
    exits: deque[float]
    started_at: float
    restart_at: float | None = None  # exited: when to start it again


class Supervisor:
    def __init__(self, policy: RestartPolicy | None = None) -> None:
        self.policy = policy or RestartPolicy()
        self._children: list[_Child] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.failed = threading.Event()
        self.failure = ""  # what was given up on, once ``failed`` is set
        self.restarts = 0
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)

    def watch(self, proc: ServiceProcess) -> None:
        p = self.policy
        with self._lock:
            self._children.append(
                _Child(proc, Backoff(p.min_backoff_s, p.max_backoff_s), deque(), time.monotonic())
            )

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (before the children are stopped: none is restarted then)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.policy.poll_s) and not self.failed.is_set():
            with self._lock:
                children = list(self._children)
            for child in children:
                self._check(child, time.monotonic())

    def _check(self, child: _Child, now: float) -> None:
        if child.restart_at is None:
            code = child.proc.proc.poll()  # reaps it: no zombie
            if code is None:
                return
            self._exited(child, code, now)
        elif now >= child.restart_at and not self._stop.is_set():
            child.restart_at = None
            child.started_at = now
            child.proc.respawn()
            self.restarts += 1
            log.warning("restarted", child=child.proc.name, pid=child.proc.proc.pid)

    def _exited(self, child: _Child, code: int, now: float) -> None:
        p = self.policy
        if now - child.started_at >= p.healthy_after_s:
            child.backoff.reset()
        child.exits.append(now)
        while child.exits and now - child.exits[0] > p.window_s:
            child.exits.popleft()
        name, log_path = child.proc.name, str(child.proc.log_path)
        if len(child.exits) > p.max_restarts:
            self.failure = (
                f"{name} exited {len(child.exits)} times within {p.window_s:.0f} s "
                f"(last exit code {code}); giving up. Its log: {log_path}"
            )
            log.error("giving up", child=name, exits=len(child.exits), exit_code=code, log=log_path)
            self.failed.set()
            return
        delay = child.backoff.next_delay()
        child.restart_at = now + delay
        log.warning(
            "child exited; restarting", child=name, exit_code=code, in_s=round(delay, 2),
            log=log_path,
        )  # fmt: skip
