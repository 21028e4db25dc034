"""The queue service process: client API + worker control stream + Kafka, on one asyncio loop.

    python -m queue_service.server --listen 127.0.0.1:50051 --model tiny-llama \
        --kafka-bootstrap 127.0.0.1:9092 --tls-dir ~/.cache/tierflow/certs

Serves ``tierflow.v1.Tierflow`` (clients, through the edge) and ``tierflow.v1.WorkerControl``
(worker processes dial in), plus the standard gRPC health service and server reflection.
With ``--tls-dir`` every peer presents a certificate of the deployment's CA, and what it may
call follows from its identity (``queue_service/trust.py``); ``--plaintext`` is for development.
Health: ``tierflow.v1.WorkerControl`` is SERVING once the server listens (workers may attach);
the server as a whole ("") and ``tierflow.v1.Tierflow`` are SERVING only while it can serve a
client: a worker is attached and Kafka is not known to be down.
Stops gracefully on SIGTERM/SIGINT: no new calls, in-flight streams get a grace period.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from queue_service.broker.bridge import KafkaBridge
from queue_service.clients.admission import AdmissionLimits
from queue_service.clients.api import ClientApi
from queue_service.clients.wire import add_client_api
from queue_service.config import QueueServiceConfig, kafka_from_env
from queue_service.core.capacity_board import CapacityBoard, load_record, published_load
from queue_service.core.finished import finished_record, refused_record
from queue_service.core.live import LiveRequest
from queue_service.core.service_core import ServiceCore, Transport
from queue_service.metrics import QueueServiceMetrics
from queue_service.scheduler import (
    PrefillTimePredictor,
    Scheduler,
    SchedulerConfig,
    make_policy,
)
from queue_service.trust import Trust
from queue_service.workers.api import WorkerApi
from tierflow.catalogue import load_model_info
from tierflow.heap import freeze_startup_heap, time_collections
from tierflow.identity import Identity, Role, add_port, add_tls_arguments
from tierflow.logging import configure_logging
from tierflow.metrics import add_metrics_arguments, serve_metrics
from tierflow.tiers import TierTable, load_tiers
from tierflow.v1 import queue_pb2, serving_pb2, worker_pb2, worker_pb2_grpc

log = structlog.get_logger("queue_service")

METRICS_SAMPLE_S = 0.5  # how often the queue depths and suspended bytes are sampled
READINESS_CHECK_S = 0.2  # how often health follows the workers and Kafka
CLIENT_SERVICES = ("", "tierflow.v1.Tierflow")  # NOT_SERVING without a worker or Kafka


def _scheduler(config: QueueServiceConfig, tiers: TierTable) -> Scheduler:
    """The scheduler with the configured policy, predictor (a calibration file's, refitted
    online unless ``refit_predictor`` is off) and shedding limit."""
    predictor = (
        PrefillTimePredictor.load(config.predictor_file)
        if config.predictor_file
        else PrefillTimePredictor()
    )
    return Scheduler(
        make_policy(config.policy),
        tiers,
        predictor,
        SchedulerConfig(
            max_queued_sheddable=config.max_queued_sheddable,
            refit_predictor=config.refit_predictor,
        ),
    )


class QueueService:
    """Builds the parts and owns their lifetimes."""

    def __init__(self, config: QueueServiceConfig) -> None:
        self.config = config
        info = load_model_info(config.model)
        tiers = load_tiers(config.tiers_file)
        scheduler = _scheduler(config, tiers)
        self.slos_s = {t.name: t.ttft_slo_s for t in tiers}
        self.tbt_slos_s = {t.name: t.tbt_slo_s for t in tiers}
        self.metrics = QueueServiceMetrics(config.deployment, self.slos_s, self.tbt_slos_s)
        self.kafka = KafkaBridge(
            config.kafka,
            tiers,
            config.instance_id,
            max_live=config.max_live,
            live_count=lambda: len(self.core.live),
        )
        self.core = ServiceCore(
            scheduler,
            Transport(
                finished=self.kafka.finished,
                publish_reply=self.kafka.publish_reply,
                request_ended=self._request_ended,
                preempted=self.metrics.preempted,
            ),
            instance_id=config.instance_id,
            decode=lambda ids: info.tokenizer.decode(ids, skip_special_tokens=True),
            eos_ids=frozenset(
                i for i in (info.tokenizer.token_id(info.tokenizer.eos_token),) if i is not None
            ),
            no_worker_timeout_s=config.no_worker_timeout_s,
            decode_stream=lambda: info.tokenizer.decode_stream(skip_special_tokens=True).step,
        )
        trust = Trust(mtls=config.tls_dir is not None)
        self.workers = WorkerApi(
            self.core, heartbeat_timeout_s=config.heartbeat_timeout_s, trust=trust
        )
        self.capacity_tiers = tiers.judged()
        self.board = CapacityBoard(config.instance_id, tiers, stale_after_s=config.capacity_stale_s)
        self.clients = ClientApi(
            self.core,
            tiers,
            AdmissionLimits(
                max_prompt_tokens=info.max_positions - 1, max_new_tokens=config.max_new_tokens
            ),
            publish=self.kafka.publish,
            board=self.board,
            tokenize=info.tokenizer.encode,
            vocab_size=info.vocab_size,
            deadline_margin_s=config.deadline_margin_s,
            heartbeat_s=config.stream_heartbeat_s,
            deployment=config.deployment,
            refused=self._refused,
            unjudged=self.metrics.admitted_unjudged,
            trust=trust,
        )
        self.health = health.aio.HealthServicer()
        self.server = self._grpc_server()
        self.port = add_port(
            self.server, config.listen, config.tls_dir, Identity(Role.QUEUE_SERVICE), log
        )

    def _grpc_server(self) -> grpc.aio.Server:
        """The client, worker and health services on one server, with reflection."""
        server = grpc.aio.server()
        add_client_api(self.clients, server)  # a request that does not parse: INVALID_ARGUMENT
        worker_pb2_grpc.add_WorkerControlServicer_to_server(self.workers, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                serving_pb2.DESCRIPTOR.services_by_name["Tierflow"].full_name,
                worker_pb2.DESCRIPTOR.services_by_name["WorkerControl"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        return server

    def _request_ended(self, live: LiveRequest, now: float) -> None:
        """One request-log record per request, counted by the metrics from the same record."""
        record = finished_record(
            live,
            now,
            deployment=self.config.deployment,
            policy=self.config.policy,
            slo_s=self.slos_s.get(live.record.tier, 0.0),
            tbt_slo_s=self.tbt_slos_s.get(live.record.tier),
        )
        self.metrics.request_ended(record, live.token_gaps_s)
        self.kafka.publish_finished(record)

    def _refused(self, queued: queue_pb2.QueuedRequest) -> None:
        """A request refused for load at admission: a record too (metering, audit)."""
        record = refused_record(
            queued,
            deployment=self.config.deployment,
            policy=self.config.policy,
            slo_s=self.slos_s.get(queued.tier, 0.0),
            tbt_slo_s=self.tbt_slos_s.get(queued.tier),
        )
        self.metrics.request_ended(record, [])
        self.kafka.publish_finished(record)

    async def _sample_metrics(self) -> None:
        while True:
            self.metrics.sample(
                self.core.scheduler.queue_depth(),
                self.kafka.kafka_waiting,
                sum(s.suspended_bytes for s in self.workers.sessions.values()),
                len(self.workers.sessions),
            )
            await asyncio.sleep(METRICS_SAMPLE_S)

    async def _publish_capacity(self) -> None:
        """Every ``capacity_publish_s``, the load of each tier that admission judges
        (``TierTable.judged``) and this instance schedules (a partition of its topic is
        assigned here), for admission on every instance
        (``queue_service/core/capacity_board.py``)."""
        while True:
            for tier in self.capacity_tiers:
                if tier in self.kafka.owned_tiers:
                    self.kafka.publish_capacity(load_record(self.core.tier_load(tier)))
            await asyncio.sleep(self.config.capacity_publish_s)

    def _capacity_read(self, record: queue_pb2.TierCapacity) -> None:
        try:
            self.board.update(published_load(record))
        except ValueError as exc:
            log.error("malformed tier load ignored", error=str(exc))

    async def _follow_readiness(self) -> None:
        """Health follows whether a client can be served; waiting requests with no worker
        attached end when their time is up."""
        serving: bool | None = None
        while True:
            self.core.expire_unattended()
            workers, kafka = len(self.workers.sessions), self.kafka.available
            ready = workers > 0 and kafka
            if ready != serving:
                status = health_pb2.HealthCheckResponse
                for service in CLIENT_SERVICES:
                    await self.health.set(service, status.SERVING if ready else status.NOT_SERVING)
                (log.info if ready else log.warning)(
                    "health", serving=ready, workers=workers, kafka_available=kafka
                )
                serving = ready
            await asyncio.sleep(READINESS_CHECK_S)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        await self.server.start()
        self.kafka.start(loop, self.core.on_delivered, self.core.deliver_reply, self._capacity_read)
        watchdog = asyncio.create_task(self.workers.watch_heartbeats())
        sampler = asyncio.create_task(self._sample_metrics())
        publisher = asyncio.create_task(self._publish_capacity())
        endpoint = serve_metrics(
            self.metrics.registry, self.config.metrics_port, self.config.metrics_host
        )
        await self.health.set("tierflow.v1.WorkerControl", health_pb2.HealthCheckResponse.SERVING)
        readiness = asyncio.create_task(self._follow_readiness())
        log.info(
            "queue service ready",
            port=self.port,
            instance_id=self.config.instance_id,
            policy=self.config.policy,
            model=self.config.model,
            kafka=self.config.kafka.bootstrap,
            kafka_tls=bool(self.config.kafka.tls_dir),
            deployment=self.config.deployment,
            metrics_port=endpoint.port if endpoint else None,
        )
        if not self.config.kafka.tls_dir:
            log.warning(
                "kafka plaintext: anyone who reaches the broker reads every prompt on the tier "
                "topics (development only; give --kafka-tls-dir for mTLS and the broker's ACLs)",
                kafka=self.config.kafka.bootstrap,
            )
        await stopping.wait()
        readiness.cancel()
        await self.health.enter_graceful_shutdown()
        # The requests stay in Kafka (uncommitted) and run after a restart or on another
        # instance: their clients are told UNAVAILABLE, the cue to reattach.
        streams = self.clients.end_streams(
            grpc.StatusCode.UNAVAILABLE,
            "the queue service is stopping; the request stays queued: send it again with its "
            "request_id to reattach",
        )
        log.info("stopping", client_streams_ended=streams)
        watchdog.cancel()
        await self.server.stop(self.config.grace_s)
        sampler.cancel()
        publisher.cancel()
        await loop.run_in_executor(None, self.kafka.stop)
        if endpoint is not None:
            endpoint.close()


def parse_args(argv: list[str] | None = None) -> QueueServiceConfig:
    defaults = QueueServiceConfig
    p = argparse.ArgumentParser(prog="tierflow queue-service", description=__doc__.split("\n")[0])
    p.add_argument("--listen", default=defaults.listen)
    p.add_argument("--model", default=defaults.model, help="same model as the workers")
    p.add_argument("--policy", default=defaults.policy)
    p.add_argument("--tiers", type=Path)
    p.add_argument("--predictor", type=Path, help="from `tierflow calibrate`")
    p.add_argument(
        "--no-refit-predictor", dest="refit_predictor", action="store_false",
        help="keep the predictor's coefficients: no refit from finished prefills",
    )  # fmt: skip
    p.add_argument("--kafka-bootstrap", help="default $TIERFLOW_KAFKA_BOOTSTRAP or :9092")
    p.add_argument("--topic-prefix", help="default $TIERFLOW_KAFKA_TOPIC_PREFIX or 'tierflow.'")
    p.add_argument(
        "--kafka-tls-dir",
        help="reach Kafka over mTLS as queue-service, with the certificates in this directory "
        "(default $TIERFLOW_KAFKA_TLS_DIR; unset: plaintext)",
    )
    p.add_argument("--instance-id")
    p.add_argument("--heartbeat-timeout", type=float, default=defaults.heartbeat_timeout_s)
    p.add_argument(
        "--no-worker-timeout", type=float, default=defaults.no_worker_timeout_s,
        help="seconds a request waits with no worker attached before UNAVAILABLE",
    )  # fmt: skip
    p.add_argument(
        "--max-queued-sheddable", type=int, default=defaults.max_queued_sheddable,
        help="refuse a sheddable tier's request when this many of them already wait",
    )  # fmt: skip
    p.add_argument(
        "--deadline-margin", type=float, default=defaults.deadline_margin_s,
        help="seconds before a client's gRPC deadline its stream ends (beats the edge's timer)",
    )  # fmt: skip
    p.add_argument(
        "--stream-heartbeat", type=float, default=defaults.stream_heartbeat_s,
        help="seconds of silence after which a client stream gets a Heartbeat event",
    )  # fmt: skip
    p.add_argument("--deployment", default=defaults.deployment, help="metrics/request-log label")
    add_metrics_arguments(p)
    add_tls_arguments(p)
    args = p.parse_args(argv)
    overrides = {
        k: v
        for k, v in (
            ("bootstrap", args.kafka_bootstrap),
            ("topic_prefix", args.topic_prefix),
            ("tls_dir", args.kafka_tls_dir),
        )
        if v is not None
    }
    extra = {"instance_id": args.instance_id} if args.instance_id else {}
    return QueueServiceConfig(
        listen=args.listen,
        model=args.model,
        policy=args.policy,
        tiers_file=args.tiers,
        predictor_file=args.predictor,
        refit_predictor=args.refit_predictor,
        kafka=kafka_from_env(**overrides),
        heartbeat_timeout_s=args.heartbeat_timeout,
        no_worker_timeout_s=args.no_worker_timeout,
        max_queued_sheddable=args.max_queued_sheddable,
        deadline_margin_s=args.deadline_margin,
        stream_heartbeat_s=args.stream_heartbeat,
        deployment=args.deployment,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        tls_dir=args.tls_dir,
        **extra,
    )


async def serve(config: QueueServiceConfig) -> None:
    # Built inside the running loop: a grpc.aio server binds to the loop it was created on.
    service = QueueService(config)  # loads the tokenizer, the tiers, the predictor
    log.info("startup heap frozen", gc_objects=freeze_startup_heap())  # (tierflow.heap)
    time_collections(service.metrics.registry, config.deployment)
    await service.run()


def main(argv: list[str] | None = None) -> int:
    configure_logging(json=True)
    asyncio.run(serve(parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
