"""Starting the real services as real processes for the integration tests.

Each process writes its JSON log to a file in the test's tmp dir (printed when a test fails
helps: ``ServiceProcess.log_tail``), is waited for until it is ready, and is stopped (SIGTERM,
then SIGKILL) by the fixture that started it. ``kill()`` is a SIGKILL, for the crash tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


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
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **(env or {}))
        self._log = open(log_path, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, *args], cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_events(self) -> list[dict]:
        events = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    events.append(json.loads(line))
        return events

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


def wait_serving(target: str, timeout: float = 60.0, service: str = "") -> None:
    """Until the gRPC health service at ``target`` answers SERVING."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
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


def start_queue_service(
    tmp: Path,
    kafka_settings,
    *,
    model: str,
    tiers: Path | None = None,
    port: int | None = None,
    instance_id: str = "qs-1",
    extra: list[str] | None = None,
) -> tuple[ServiceProcess, str]:
    port = port or free_port()
    args = [
        "-m",
        "queue_service.server",
        "--listen",
        f"127.0.0.1:{port}",
        "--model",
        model,
        "--kafka-bootstrap",
        kafka_settings.bootstrap,
        "--topic-prefix",
        kafka_settings.topic_prefix,
        "--instance-id",
        instance_id,
        "--heartbeat-timeout",
        "3",
    ]
    if tiers is not None:
        args += ["--tiers", str(tiers)]
    proc = ServiceProcess(
        f"queue-service:{port}",
        args + (extra or []),
        tmp / f"queue_service_{instance_id}_{port}.log",
        env={"TIERFLOW_KAFKA_GROUP_ID": kafka_settings.group_id},
    )
    target = f"127.0.0.1:{port}"
    wait_serving(target)
    return proc, target


def start_worker(
    tmp: Path,
    queue_target: str,
    worker_id: str,
    *,
    model: str,
    chunk_size: int = 512,
    check: str = "layer",
) -> ServiceProcess:
    args = [
        "-m",
        "worker.process",
        "--queue-service",
        queue_target,
        "--worker-id",
        worker_id,
        "--model",
        model,
        "--chunk-size",
        str(chunk_size),
        "--check",
        check,
        "--device",
        "cpu",
    ]
    proc = ServiceProcess(f"worker:{worker_id}", args, tmp / f"worker_{worker_id}.log")
    proc.wait_for_log("attached", timeout=120)
    return proc
