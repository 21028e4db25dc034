"""Running the services as child processes: start, wait until ready, stop, never orphan.

Used by ``tierflow up`` (the local stack) and by the integration tests. Each process writes its
output (JSON logs) to a file; ``wait_for_log`` and ``wait_serving`` tell when it is ready. On
Linux every child gets PR_SET_PDEATHSIG, so even a launcher killed with SIGKILL takes its
children with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierflow.identity import Role, open_channel

REPO = Path(__file__).resolve().parent.parent


# PR_SET_PDEATHSIG is set by util-linux's setpriv, which then execs the service (same pid), not
# by a Python preexec_fn: a preexec_fn makes subprocess use a plain fork(), which runs gRPC's
# atfork handlers, and in a launcher that holds gRPC channels the prefork handler once waited
# forever (`tierflow bench --tls`, the main thread stuck in fork()). Without one, subprocess
# spawns with vfork, which runs no atfork handlers.
@functools.cache
def _setpriv() -> str | None:
    """util-linux's setpriv when it has --pdeathsig (2.33 and later), else None."""
    path = shutil.which("setpriv")
    if path is None:
        return None
    usage = subprocess.run([path, "--help"], capture_output=True, text=True, check=False)
    return path if "--pdeathsig" in usage.stdout else None


def _die_with_parent() -> None:  # runs in the child between fork and exec: no setpriv only
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def python_module(module: str, *args: str) -> list[str]:
    """The command line that runs ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceProcess:
    def __init__(
        self, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.args = args
        self.log_path = log_path
        self.env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **(env or {}))
        self._log = open(log_path, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = self._popen()

    def _popen(self) -> subprocess.Popen:
        setpriv = _setpriv()
        if setpriv is not None:
            command, preexec = [setpriv, "--pdeathsig", "TERM", "--", *self.args], None
        else:
            command, preexec = self.args, _die_with_parent
        return subprocess.Popen(
            command,
            cwd=REPO,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
        )

    def respawn(self) -> None:
        """Start the same command again (after it exited), appending to the same log."""
        if self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is still running")
        self.proc = self._popen()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_records(self) -> list[tuple[str, dict | None]]:
        """Every line of the log with its JSON event (None for a line that is not one, such as
        a traceback written to stderr)."""
        records = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            event = None
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
            records.append((line, event))
        return records

    def log_events(self) -> list[dict]:
        return [event for _, event in self.log_records() if event is not None]

    def wait_for_log(self, event: str, timeout: float = 60.0, **fields) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.log_events():
                if e.get("event") == event and all(e.get(k) == v for k, v in fields.items()):
                    return e
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log_tail()}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.name}: no {event!r} in its log:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


# A queue service's health as a whole is NOT_SERVING until a worker attaches; its worker
# control service is SERVING as soon as it listens, which is what starting one waits for.
QUEUE_SERVICE_LISTENING = "tierflow.v1.WorkerControl"


def wait_serving(
    target: str,
    timeout: float = 60.0,
    service: str = "",
    credentials: grpc.ChannelCredentials | None = None,
    server: Role = Role.QUEUE_SERVICE,
) -> None:
    """Until the gRPC health service at ``target`` answers SERVING (over mTLS with
    ``credentials``, an identity's, to the service ``server``)."""
    deadline = time.monotonic() + timeout
    channel = open_channel(target, credentials, server=server)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{target} did not become SERVING within {timeout} s")


def wait_http_ok(
    url: str, proc: ServiceProcess, timeout: float = 60.0, context: ssl.SSLContext | None = None
) -> None:
    """Until GET ``url`` answers 200 (an HTTP service's health or readiness page); ``context``:
    for an https URL, the identity to present (``tierflow.identity.client_context``)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready within {timeout} s:\n{proc.log_tail()}")
