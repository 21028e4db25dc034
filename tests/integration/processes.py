"""Starting the real services as real processes for the integration tests.

Each process writes its JSON log to a file in the test's tmp dir, is waited for until it is
ready, and is stopped (SIGTERM, then SIGKILL) by the fixture that started it; a function-scoped
fixture does that with ``stop_started``, which also prints the processes' own log lines when
the test failed. ``kill()`` is a SIGKILL, for the crash tests.
"""

from __future__ import annotations

from pathlib import Path

from launch.processes import (
    QUEUE_SERVICE_LISTENING,
    ServiceProcess,
    free_port,
    python_module,
    wait_http_ok,
    wait_serving,
)
from tierflow.identity import Identity, Role, TlsFiles, client_context
from worker.config import WorkerConfig


def start_queue_service(
    tmp: Path,
    kafka_settings,
    *,
    model: str,
    tiers: Path | None = None,
    port: int | None = None,
    instance_id: str = "qs-1",
    extra: list[str] | None = None,
    tls_dir: Path | None = None,
) -> tuple[ServiceProcess, str]:
    """``tls_dir``: mTLS with the identities there (``launch.certs.ensure``); else plaintext."""
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
    args += tls_arguments(tls_dir)
    proc = ServiceProcess(
        f"queue-service:{port}",
        args + (extra or []),
        tmp / f"queue_service_{instance_id}_{port}.log",
        env={"TIERFLOW_KAFKA_GROUP_ID": kafka_settings.group_id},
    )
    target = f"127.0.0.1:{port}"
    wait_serving(target, service=QUEUE_SERVICE_LISTENING, credentials=operator(tls_dir))
    return proc, target


def tls_arguments(tls_dir: Path | None) -> list[str]:
    return ["--tls-dir", str(tls_dir)] if tls_dir is not None else ["--plaintext"]


def operator(tls_dir: Path | None):
    """The operator's channel credentials under mTLS (what the tests call directly as)."""
    if tls_dir is None:
        return None
    return TlsFiles.load(tls_dir, Identity(Role.OPERATOR)).channel_credentials()


def start_worker(
    tmp: Path,
    queue_target: str,
    worker_id: str,
    *,
    model: str,
    chunk_size: int = 512,
    check: str = WorkerConfig.check,
    extra: list[str] | None = None,
    tls_dir: Path | None = None,
    wait: bool = True,
) -> ServiceProcess:
    """``extra``: more command-line arguments (``--kv-slots 4``: four KV slots). ``wait``:
    until it logs "attached"."""
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
        *tls_arguments(tls_dir),
        *(extra or []),
    )
    proc = ServiceProcess(f"worker:{worker_id}", args, tmp / f"worker_{worker_id}.log")
    if wait:
        proc.wait_for_log("attached", timeout=120)
    return proc


def start_gateway(
    tmp: Path,
    *,
    keys: Path,
    tiers: Path | None = None,
    port: int | None = None,
    keys_check_interval: float = 1.0,
    tls_dir: Path | None = None,
) -> tuple[ServiceProcess, str]:
    """The ext_authz gateway (``python -m gateway.server``), once its health says SERVING;
    ``tls_dir``: over mTLS (only the edge may call its Check)."""
    port = port or free_port()
    args = python_module(
        "gateway.server",
        "--listen",
        f"127.0.0.1:{port}",
        "--keys",
        str(keys),
        "--keys-check-interval",
        str(keys_check_interval),
    )
    if tiers is not None:
        args += ["--tiers", str(tiers)]
    args += tls_arguments(tls_dir)
    proc = ServiceProcess(f"gateway:{port}", args, tmp / f"gateway_{port}.log")
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, timeout=60, credentials=operator(tls_dir), server=Role.GATEWAY)
    except TimeoutError:
        proc.stop()
        raise
    return proc, target


def start_edge(
    tmp: Path,
    *,
    queue_service: str,
    gateway: str,
    canary: str | None = None,
    openai_api: str | None = None,
    rate_limits: dict[str, tuple[int, float]] | None = None,
    tls_dir: Path | None = None,
) -> tuple[ServiceProcess, int, int]:
    """The shipped Envoy config in front of these targets, started on free ports: (the Envoy
    process, its listener port, its admin port). ``tls_dir``: to the queue service over mTLS."""
    from gateway.envoy_config import render_envoy_config
    from launch.protogen import write_descriptor_set

    port, admin = free_port(), free_port()
    config = render_envoy_config(
        listen_port=port,
        admin_port=admin,
        queue_service=queue_service,
        queue_service_canary=canary,
        gateway=gateway,
        openai_api=openai_api,
        descriptor_path=write_descriptor_set(tmp / "tierflow.pb"),
        rate_limits=rate_limits,
        tls_dir=tls_dir,
    )
    return start_envoy(tmp, config, admin_port=admin), port, admin


def start_envoy(
    tmp: Path, config_yaml: str, *, admin_port: int, name: str = "envoy"
) -> ServiceProcess:
    """Envoy with ``config_yaml`` (from gateway.envoy_config.render_envoy_config), once its
    admin /ready says LIVE. Its log file holds its JSON access log lines as well, so
    ``log_events()`` returns one dict per request it answered."""
    import time
    import urllib.request

    from gateway.envoy_config import envoy_binary

    config_path = tmp / f"{name}.yaml"
    config_path.write_text(config_yaml)
    args = [
        str(envoy_binary()),
        "-c",
        str(config_path),
        # No hot restart: several Envoys on one machine would fight over its shared memory.
        "--disable-hot-restart",
        "--concurrency",
        "1",
        "--log-level",
        "warning",
        "--file-flush-interval-msec",
        "200",  # access log lines reach the file within 0.2 s, not 10 s
    ]
    proc = ServiceProcess(name, args, tmp / f"{name}.log")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{name} exited:\n{proc.log_tail()}")
        try:
            url = f"http://127.0.0.1:{admin_port}/ready"
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.read().strip() == b"LIVE":
                    return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.stop()
    raise TimeoutError(f"{name} not ready within 60 s:\n{proc.log_tail()}")


def start_openai_api(
    tmp: Path,
    queue_target: str,
    *,
    model: str,
    tiers: Path | None = None,
    extra=(),
    tls_dir: Path | None = None,
) -> tuple[ServiceProcess, str]:
    """The OpenAI-compatible service (``python -m openai_api.server``), once /health answers;
    ``tls_dir``: it reaches the queue service over mTLS and answers the edge only, over mTLS."""
    port = free_port()
    args = python_module(
        "openai_api.server",
        "--listen",
        f"127.0.0.1:{port}",
        "--queue-service",
        queue_target,
        "--model",
        model,
        *(["--tiers", str(tiers)] if tiers is not None else []),
        *(["--tls-dir", str(tls_dir)] if tls_dir is not None else []),
        *extra,
    )
    proc = ServiceProcess(f"openai-api:{port}", args, tmp / f"openai_api_{port}.log")
    target = f"127.0.0.1:{port}"
    try:
        if tls_dir is None:
            wait_http_ok(f"http://{target}/health", proc, timeout=120)
        else:  # it answers the edge only
            edge = client_context(tls_dir, Identity(Role.EDGE))
            wait_http_ok(f"https://{target}/health", proc, timeout=120, context=edge)
    except (TimeoutError, RuntimeError):
        proc.stop()
        raise
    return proc, target


def stop_started(request, procs) -> None:
    """For a function-scoped fixture's teardown: stops ``procs`` in reverse order, then, when
    the test failed (the report conftest's ``pytest_runtest_makereport`` keeps), prints their
    own log lines: often the only record of what the services did in CI."""
    for proc in reversed(procs):
        proc.stop()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print_own_log_lines(procs)


def print_own_log_lines(procs, last: int = 150) -> None:
    """Prints the last ``last`` lines of each process's log that are its own: its JSON events
    and anything else it wrote (a traceback on stderr), not the Kafka client library's
    chatter. What a failed test shows of what the services did and when."""
    for proc in procs:
        own = [shown for record in proc.log_records() if (shown := _own_line(*record))]
        print(f"--- {proc.name}: the last {min(last, len(own))} of {len(own)} lines of its own")
        print("\n".join(own[-last:]))


def _own_line(line: str, event: dict | None) -> str | None:
    """``line`` as printed (an event as its time, name and fields); None for Kafka's chatter."""
    if event is None:
        return line
    if str(event.get("logger", "")).startswith("kafka."):
        return None
    fields = {k: v for k, v in event.items() if k not in ("timestamp", "event", "level")}
    return f"{str(event.get('timestamp', ''))[11:23]} {event.get('event', '')} {fields}"
