"""`tierflow up` / `tierflow down`: the whole system as local processes on loopback, no Docker.

Starts, in dependency order and each only once the previous answers: a Kafka broker (KRaft,
from its Maven Central jars), the queue service, N workers (each attached), the gateway
(ext_authz), the OpenAI-compatible service and Envoy (the edge). Every hop into the queue
service is mTLS, with identities from a CA made on first use in the cache (``tierflow certs``),
and so is every Kafka client, held by the broker's ACLs to what its role needs
(``launch.kafka_acls``).
Every process logs to one directory. Once up, a supervisor (``launch.supervisor``) restarts a
child that exits, with backoff, and gives up loudly after repeated failures
(``supervisor.failed``). ``stop()`` (Ctrl-C in ``tierflow up``, or ``tierflow down`` from
another shell) stops them in reverse order; children also die with the launcher if it is
killed, so nothing is left orphaned.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import structlog

from gateway.config import GatewayConfig
from launch.certs import STANDARD as STANDARD_IDENTITIES
from launch.certs import default_dir as default_certs_dir
from launch.certs import ensure as ensure_certs
from launch.certs import export as export_identity
from launch.kafka_acls import grant as grant_acls
from launch.kafka_broker import LocalKafkaBroker
from launch.processes import (
    QUEUE_SERVICE_LISTENING,
    REPO,
    ServiceProcess,
    free_port,
    python_module,
    wait_http_ok,
    wait_serving,
)
from launch.supervisor import RestartPolicy, Supervisor
from queue_service.config import QueueServiceConfig
from queue_service.scheduler import make_policy
from tierflow.identity import Identity, Role, TlsFiles, client_context
from tierflow.kafka_settings import KafkaSettings
from worker.config import WorkerConfig

log = structlog.get_logger("tierflow.stack")

STATE_FILE = "stack.json"
PRIMARY, CANARY = "primary", "canary"  # the deployment labels of metrics and request log
CANARY_TOPIC_PREFIX = "tierflow-canary."


@dataclass(frozen=True)
class StackConfig:
    """The stack's own choices; what it passes on to a service defaults to that service's config."""

    model: str = "smollm2"  # the real model: the stack is for trying tierflow out
    workers: int = 1
    policy: str = QueueServiceConfig.policy
    # The workers' engine settings; None: what each deployment's policy runs at its best
    # (``SchedulingPolicy.engine_check``; the chunked baseline at its own C, as in the bench).
    chunk_size: int | None = WorkerConfig.chunk_size
    check: str | None = None
    device: str = "cpu"
    log_dir: Path = Path("out/stack")
    tiers_file: Path = REPO / "config" / "tiers.toml"
    keys_file: Path = GatewayConfig.keys_file
    predictor_file: Path | None = None
    edge: bool = True  # the gateway, the OpenAI service and Envoy in front of the queue service
    envoy_port: int | None = None  # None: a free port
    rate_limits: dict[str, tuple[int, float]] | None = None  # tier -> (burst, tokens/s)
    # A canary: a second queue service (this policy) with its own worker(s) and tier topics,
    # writing to the same request log; Envoy sends it canary_percent of the requests.
    canary_policy: str | None = None
    canary_percent: int = 0
    canary_workers: int | None = None  # None: as many as the primary's
    # Each worker on a core of its own (round robin over this process's cores) with one torch
    # thread, so that two deployments' workers do not run at each other's pace.
    pin_workers: bool = False
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # children that exit
    no_worker_timeout_s: float = QueueServiceConfig.no_worker_timeout_s
    # The CA and the identities (``tierflow certs``), made on first use: every hop into the
    # queue service and the gateway is mTLS (Envoy, the OpenAI service, the workers, direct
    # operators). None: plaintext, for measuring what TLS adds (``tierflow bench --tls``).
    tls_dir: Path | None = field(default_factory=default_certs_dir)


@dataclass
class Endpoints:
    queue_service: str = ""
    envoy: str = ""  # gRPC, JSON and the OpenAI API (HTTP/1.1) on the same port
    envoy_admin: str = ""
    gateway: str = ""
    openai_api: str = ""  # behind Envoy: clients use http://<envoy>/v1
    kafka: str = ""
    queue_service_canary: str = ""
    metrics: dict[str, str] = field(default_factory=dict)  # service -> host:port of /metrics
    pids: dict[str, int] = field(default_factory=dict)
    tls_dir: str = ""  # the operator's own certificates: what a direct caller presents

    def operator_kafka(self) -> KafkaSettings:
        """Kafka as the ops tools reach it: the operator's identity (the request log only)."""
        if not self.tls_dir:
            return KafkaSettings(bootstrap=self.kafka)
        operator = Identity(Role.OPERATOR).file_stem
        return KafkaSettings(bootstrap=self.kafka, tls_dir=self.tls_dir, tls_identity=operator)

    def operator_credentials(self) -> grpc.ChannelCredentials | None:
        """What a direct caller of the queue service presents: the operator's identity."""
        if not self.tls_dir:
            return None
        return TlsFiles.load(Path(self.tls_dir), Identity(Role.OPERATOR)).channel_credentials()


class LocalStack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.log_dir = Path(config.log_dir).resolve()
        self.endpoints = Endpoints()
        self.processes: list[ServiceProcess] = []
        self.broker: LocalKafkaBroker | None = None
        self.supervisor = Supervisor(config.restart)
        self._cores = sorted(os.sched_getaffinity(0))
        self._workers_started = 0
        self._identity_dirs: dict[Identity, str] = {}  # each process's own certificates

    def start(self) -> Endpoints:
        cfg = self.config
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            started = time.monotonic()
            self._ensure_identities()
            self._start_kafka()
            self.endpoints.queue_service = self._start_queue_service(PRIMARY)
            for i in range(cfg.workers):
                self._start_worker(f"worker-{i}", self.endpoints.queue_service, PRIMARY)
            if cfg.canary_policy:
                canary = self._start_queue_service(CANARY)
                self.endpoints.queue_service_canary = canary
                n = cfg.workers if cfg.canary_workers is None else cfg.canary_workers
                for i in range(n):
                    self._start_worker(f"canary-worker-{i}", canary, CANARY)
            if cfg.edge:
                self._start_gateway()
                self._start_openai_api()
                self._start_envoy()
            self._write_state()
            self.supervisor.start()
            log.info(
                "stack ready",
                seconds=round(time.monotonic() - started, 1),
                **{k: v for k, v in asdict(self.endpoints).items() if k != "pids"},
            )
            return self.endpoints
        except BaseException:
            self.stop()
            raise

    def _start_kafka(self) -> None:
        """The broker; with identities, mTLS only and the ACLs of ``launch.kafka_acls``."""
        kafka_dir = self.log_dir / "kafka"
        shutil.rmtree(kafka_dir, ignore_errors=True)  # a fresh queue: no replay of old runs
        own = self._identity_dir(Identity(Role.KAFKA))
        self.broker = LocalKafkaBroker(tls_dir=own).start(data_dir=kafka_dir)
        self.endpoints.kafka = self.broker.bootstrap
        if own is not None:
            primary = KafkaSettings(bootstrap=self.broker.bootstrap)
            grant_acls(
                self.broker.admin_settings(),
                topic_prefixes=[primary.topic_prefix, CANARY_TOPIC_PREFIX],
                request_log=primary.request_log_topic,
                group_prefix=primary.group_id,
            )
        log.info("kafka ready", bootstrap=self.broker.bootstrap, tls=own is not None)

    def _worker_ids(self) -> list[str]:
        cfg = self.config
        canaries = cfg.workers if cfg.canary_workers is None else cfg.canary_workers
        ids = [f"worker-{i}" for i in range(cfg.workers)]
        return ids + ([f"canary-worker-{i}" for i in range(canaries)] if cfg.canary_policy else [])

    def _ensure_identities(self) -> None:
        """The CA and every identity this stack runs (made once, kept in the cache), and for
        each process a directory with its own key only (``launch.certs.export``)."""
        if self.config.tls_dir is None:
            return
        tls_dir = Path(self.config.tls_dir).resolve()
        workers = [Identity.worker(w) for w in self._worker_ids()]
        identities = [*STANDARD_IDENTITIES, *workers]
        issued = ensure_certs(tls_dir, identities)
        log.info("identities ready", tls_dir=str(tls_dir), issued=[i.common_name for i in issued])
        self._identity_dirs = {i: str(export_identity(tls_dir, i)) for i in identities}
        self.endpoints.tls_dir = self._identity_dirs[Identity(Role.OPERATOR)]

    def _identity_dir(self, identity: Identity) -> Path | None:
        return Path(self._identity_dirs[identity]) if self._identity_dirs else None

    def _tls(self, identity: Identity) -> list[str]:
        """A service's mTLS flags: its own identity, or plaintext when the stack has none."""
        own = self._identity_dir(identity)
        return ["--tls-dir", str(own)] if own is not None else ["--plaintext"]

    def _spawn(self, name: str, command: list[str], **env: str) -> ServiceProcess:
        proc = ServiceProcess(name, command, self.log_dir / f"{name}.log", env=env or None)
        self.processes.append(proc)
        self.endpoints.pids[name] = proc.proc.pid
        self.supervisor.watch(proc)
        return proc

    def _metrics_port(self, name: str) -> str:
        port = free_port()
        self.endpoints.metrics[name] = f"127.0.0.1:{port}"
        return str(port)

    def _start_queue_service(self, deployment: str) -> str:
        """The primary or the canary (own tier topics and group, the primary's request log)."""
        cfg = self.config
        port = free_port()
        primary = KafkaSettings(bootstrap=self.endpoints.kafka)
        canary = deployment == CANARY
        name = "queue-service-canary" if canary else "queue-service"
        command = python_module(
            "queue_service.server",
            "--listen", f"127.0.0.1:{port}",
            "--model", cfg.model,
            "--policy", (cfg.canary_policy if canary else None) or cfg.policy,
            "--tiers", str(cfg.tiers_file),
            "--kafka-bootstrap", primary.bootstrap,
            "--instance-id", "local-canary" if canary else "local-0",
            "--deployment", deployment,
            "--metrics-port", self._metrics_port(name),
            "--no-worker-timeout", str(cfg.no_worker_timeout_s),
            *self._tls(Identity(Role.QUEUE_SERVICE)),
        )  # fmt: skip
        if self._identity_dirs:  # its own identity for Kafka too
            command += ["--kafka-tls-dir", str(self._identity_dir(Identity(Role.QUEUE_SERVICE)))]
        if canary:
            command += ["--topic-prefix", CANARY_TOPIC_PREFIX]
        if cfg.predictor_file:
            command += ["--predictor", str(cfg.predictor_file)]
        env = (
            {
                "TIERFLOW_KAFKA_GROUP_ID": f"{primary.group_id}-canary",
                "TIERFLOW_KAFKA_REQUEST_LOG": primary.request_log_topic,
            }
            if canary
            else {}
        )
        self._spawn(name, command, **env)
        target = f"127.0.0.1:{port}"
        credentials = self.endpoints.operator_credentials()
        wait_serving(target, timeout=180, service=QUEUE_SERVICE_LISTENING, credentials=credentials)
        return target

    def _engine_settings(self, deployment: str) -> tuple[int | None, str]:
        """(chunk size, check) of a deployment's workers."""
        cfg = self.config
        if cfg.check is not None:
            return cfg.chunk_size, cfg.check
        policy = (cfg.canary_policy if deployment == CANARY else None) or cfg.policy
        engine = make_policy(policy)
        return engine.engine_chunk_size or cfg.chunk_size, engine.engine_check

    def _start_worker(self, worker_id: str, queue_service: str, deployment: str) -> None:
        cfg = self.config
        chunk_size, check = self._engine_settings(deployment)
        pin = []
        if cfg.pin_workers:
            pin = ["--cpus", str(self._cores[self._workers_started % len(self._cores)])]
        self._workers_started += 1
        proc = self._spawn(
            worker_id,
            python_module(
                "worker.process",
                "--queue-service", queue_service,
                "--worker-id", worker_id,
                "--model", cfg.model,
                "--device", cfg.device,
                "--chunk-size", str(chunk_size or 0),  # 0: the whole prompt
                "--check", check,
                "--deployment", deployment,
                "--metrics-port", self._metrics_port(worker_id),
                *self._tls(Identity.worker(worker_id)),
                *pin,
            ),
            # Every service of this stack shares the machine's cores: the worker's OpenMP
            # threads must sleep between parallel regions, not spin (worker.batch_runner).
            OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        )  # fmt: skip
        proc.wait_for_log("attached", timeout=600)  # the first SmolLM2 load converts its GGUF

    def _start_gateway(self) -> None:
        port = free_port()
        self._spawn(
            "gateway",
            python_module(
                "gateway.server",
                "--listen", f"127.0.0.1:{port}",
                "--keys", str(self.config.keys_file),
                "--tiers", str(self.config.tiers_file),
                "--metrics-port", self._metrics_port("gateway"),
                *self._tls(Identity(Role.GATEWAY)),
            ),
        )  # fmt: skip
        self.endpoints.gateway = f"127.0.0.1:{port}"
        credentials = self.endpoints.operator_credentials()
        wait_serving(
            self.endpoints.gateway, timeout=60, credentials=credentials, server=Role.GATEWAY
        )

    def _start_openai_api(self) -> None:
        port = free_port()
        proc = self._spawn(
            "openai-api",
            python_module(
                "openai_api.server",
                "--listen", f"127.0.0.1:{port}",
                "--queue-service", self.endpoints.queue_service,
                "--model", self.config.model,
                "--tiers", str(self.config.tiers_file),
                *(self._tls(Identity(Role.OPENAI_API)) if self._identity_dirs else []),
            ),
        )  # fmt: skip
        self.endpoints.openai_api = f"127.0.0.1:{port}"
        edge_dir = self._identity_dir(Identity(Role.EDGE))
        if edge_dir is not None:  # it answers the edge only
            edge = client_context(edge_dir, Identity(Role.EDGE))
            wait_http_ok(f"https://{self.endpoints.openai_api}/health", proc, context=edge)
        else:
            wait_http_ok(f"http://{self.endpoints.openai_api}/health", proc)

    def _start_envoy(self) -> None:
        from gateway.envoy_config import envoy_binary, render_envoy_config
        from launch.protogen import write_descriptor_set

        port = self.config.envoy_port or free_port()
        admin = free_port()
        descriptor = write_descriptor_set(self.log_dir / "tierflow.pb")
        config_path = self.log_dir / "envoy.yaml"
        config_path.write_text(
            render_envoy_config(
                listen_port=port,
                admin_port=admin,
                queue_service=self.endpoints.queue_service,
                queue_service_canary=self.endpoints.queue_service_canary or None,
                canary_percent=self.config.canary_percent,
                gateway=self.endpoints.gateway,
                openai_api=self.endpoints.openai_api,
                descriptor_path=descriptor,
                rate_limits=self.config.rate_limits,
                tls_dir=self._identity_dir(Identity(Role.EDGE)),
            )
        )
        self._spawn(
            "envoy",
            # No hot restart: several local Envoys (tests, a demo) must not share its memory.
            [str(envoy_binary()), "-c", str(config_path), "--log-level", "warn",
             "--disable-hot-restart"],
        )  # fmt: skip
        self.endpoints.envoy = f"127.0.0.1:{port}"
        self.endpoints.envoy_admin = f"127.0.0.1:{admin}"
        wait_http_ok(f"http://{self.endpoints.envoy_admin}/ready", self.processes[-1])

    def _write_state(self) -> None:
        state = asdict(self.endpoints) | {"launcher_pid": os.getpid()}
        (self.log_dir / STATE_FILE).write_text(json.dumps(state, indent=2))

    def stop(self) -> None:
        self.supervisor.stop()  # first: nothing is restarted while the stack stops
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        (self.log_dir / STATE_FILE).unlink(missing_ok=True)
        log.info("stack stopped", logs=str(self.log_dir))

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_running_stack(log_dir: Path) -> bool:
    """`tierflow down`: ask the launcher recorded in ``log_dir`` to stop its stack."""
    state_path = Path(log_dir) / STATE_FILE
    if not state_path.exists():
        return False
    state = json.loads(state_path.read_text())
    try:
        os.kill(state["launcher_pid"], signal.SIGTERM)
    except ProcessLookupError:  # the launcher is gone; its children died with it
        state_path.unlink(missing_ok=True)
        return False
    deadline = time.monotonic() + 60
    while state_path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return True
