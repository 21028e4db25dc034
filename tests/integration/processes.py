"""Starting the real services as real processes for the integration tests.

Each process writes its JSON log to a file in the test's tmp dir (printed when a test fails
helps: ``ServiceProcess.log_tail``), is waited for until it is ready, and is stopped (SIGTERM,
then SIGKILL) by the fixture that started it. ``kill()`` is a SIGKILL, for the crash tests.
"""

from __future__ import annotations

from pathlib import Path

from tierflow.processes import ServiceProcess, free_port, python_module, wait_serving


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
    args = python_module(
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
    )
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
    args = python_module(
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
    )
    proc = ServiceProcess(f"worker:{worker_id}", args, tmp / f"worker_{worker_id}.log")
    proc.wait_for_log("attached", timeout=120)
    return proc
