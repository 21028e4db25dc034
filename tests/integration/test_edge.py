"""The edge end to end: a real Envoy (envoy/envoy.yaml, rendered for local ports), the real
gateway process, and behind them either a recording stand-in for the queue service (to see
exactly what reaches the upstream) or the real services (queue service, Kafka, a worker).

What a client sees from Envoy, each checked below:
  known key             the request reaches the queue service with the key's tier; the
                        client's own x-tierflow-tier and its x-api-key never do
  unknown / no key      grpc-status 16 UNAUTHENTICATED (HTTP 401 for JSON); not forwarded
  tier over its limit   grpc-status 8 RESOURCE_EXHAUSTED (HTTP 429 for JSON); not forwarded
  tier without a route  grpc-status 7 PERMISSION_DENIED; other paths 12 UNIMPLEMENTED
  gateway down          grpc-status 14 UNAVAILABLE (fail closed)
  client deadline       grpc-timeout reaches the queue service, which cancels the work and
                        ends the stream (error event, DEADLINE_EXCEEDED) before Envoy's timer
  JSON POST /v1/generate  newline-delimited JSON events, streamed as they happen; a failure
                        after the stream started is a last `error` line (HTTP/1.1: no trailers)

Assertions are orderings and generous bounds: CI shares 2 cores with Kafka's JVM.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import random
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.demo_keys import DEMO_KEYS
from gateway.keys import hash_key
from launch.certs import STANDARD, ensure
from launch.processes import REPO, ServiceProcess, free_port
from queue_service.clients.admission import scoped_request_id
from tests.integration.json_http import post_generate
from tests.integration.processes import (
    start_edge,
    start_gateway,
    start_openai_api,
    start_queue_service,
    start_worker,
)
from tests.tiers import SERVICE_TIERS_TOML
from tierflow.client import TierflowClient
from tierflow.identity import Identity, Role, TlsFiles
from tierflow.kafka_settings import KafkaSettings
from tierflow.v1 import serving_pb2, serving_pb2_grpc

TIERS = SERVICE_TIERS_TOML
# The gateway of the stand-in tests knows one more tier, which has no route at the edge.
INTERNAL_KEY = "tf-test-internal-0123456789abcdef"
GATEWAY_TIERS = TIERS + "[tiers.internal]\nrank = 3\nttft_slo_s = 600.0\n"
KEYS_FILE = REPO / "config" / "keys.toml"  # the shipped demo keys
CANARY_KEY = "tierflow.canary.queue_service_canary"  # envoy/README.md, "Canary"


def ids(n: int, seed: int, vocab: int = 4000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, vocab) for _ in range(n)]


def kinds(events) -> list[str]:
    return [e.WhichOneof("event") for e in events]


def demo_scoped(tier: str, request_id: str) -> str:
    """The queue service's (and the worker's) name of a request sent with a demo key: its id in
    the key's scope (``config/keys.toml`` labels the demo key of a tier ``demo-<tier>``)."""
    return scoped_request_id(f"demo-{tier}", request_id)


def status_of(target: str, metadata, **kw) -> tuple[grpc.StatusCode, str]:
    """The status of a Generate call that is expected to fail."""
    with grpc.insecure_channel(target) as channel:
        stub = serving_pb2_grpc.TierflowStub(channel)
        request = serving_pb2.GenerateRequest(text="hello", **kw)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, metadata=metadata, timeout=30))
    return err.value.code(), err.value.details()


def runtime_modify(admin_port: int, values: dict[str, int]) -> None:
    """Envoy's admin runtime override (what an operator does to switch the canary)."""
    query = "&".join(f"{k}={v}" for k, v in values.items())
    request = urllib.request.Request(
        f"http://127.0.0.1:{admin_port}/runtime_modify?{query}", method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200


# ---------------------------------------------------------------- a recording upstream


class RecordingUpstream(serving_pb2_grpc.TierflowServicer):
    """Stands in for the queue service: remembers what reached it, answers Queued + Done."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[dict] = []
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(8))
        serving_pb2_grpc.add_TierflowServicer_to_server(self, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health.set("tierflow.v1.Tierflow", health_pb2.HealthCheckResponse.SERVING)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def Generate(self, request, context):
        metadata = context.invocation_metadata()
        call = {
            "tiers": [v for k, v in metadata if k == "x-tierflow-tier"],
            "keys": [v for k, v in metadata if k == "x-api-key"],
            "remaining": context.time_remaining(),
            "request_id": request.request_id,
        }
        self.calls.append(call)
        yield serving_pb2.GenerateEvent(
            request_id=request.request_id,
            queued=serving_pb2.Queued(tier=",".join(call["tiers"])),
        )
        yield serving_pb2.GenerateEvent(request_id=request.request_id, done=serving_pb2.Done())

    def stop(self) -> None:
        self.server.stop(None)


@dataclass
class StandIn:
    envoy: ServiceProcess
    target: str
    admin_port: int
    primary: RecordingUpstream
    canary: RecordingUpstream
    gateway: ServiceProcess


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("edge_stand_in")
    tiers = tmp / "tiers.toml"
    tiers.write_text(GATEWAY_TIERS)
    keys = tmp / "keys.toml"
    keys.write_text(
        KEYS_FILE.read_text()
        + f'\n[keys.test-internal]\nsha256 = "{hash_key(INTERNAL_KEY)}"\ntier = "internal"\n'
    )
    primary, canary = RecordingUpstream("primary"), RecordingUpstream("canary")
    started: list[ServiceProcess] = []
    try:
        gateway, gateway_target = start_gateway(tmp, keys=keys, tiers=tiers)
        started.append(gateway)
        envoy, port, admin = start_edge(
            tmp,
            queue_service=primary.target,
            gateway=gateway_target,
            canary=canary.target,
            # The canary test sends 50 requests of one key at once: more than the shipped
            # per-key burst (40), and rate limits are not what these tests are about.
            rate_limits={"standard": (1000, 1000.0)},
        )
        started.append(envoy)
        yield StandIn(started[-1], f"127.0.0.1:{port}", admin, primary, canary, gateway)
    finally:
        for proc in reversed(started):
            proc.stop()
        primary.stop()
        canary.stop()


def generate_through(target: str, metadata, *, timeout: float = 30, **kw) -> list:
    with grpc.insecure_channel(target) as channel:
        stub = serving_pb2_grpc.TierflowStub(channel)
        request = serving_pb2.GenerateRequest(text="hello", **kw)
        return list(stub.Generate(request, metadata=metadata, timeout=timeout))


def test_upstream_gets_the_keys_tier_never_the_key_nor_a_spoofed_tier(stand_in):
    up = stand_in.primary
    cases = {
        "plain": ([("x-api-key", DEMO_KEYS["standard"])], "standard"),
        "spoof-after": (
            [("x-api-key", DEMO_KEYS["batch"]), ("x-tierflow-tier", "critical")],
            "batch",
        ),
        "spoof-twice": (
            [
                ("x-tierflow-tier", "critical"),
                ("x-api-key", DEMO_KEYS["batch"]),
                ("x-tierflow-tier", "standard"),
            ],
            "batch",
        ),
    }
    for request_id, (metadata, tier) in cases.items():
        events = generate_through(stand_in.target, metadata, timeout=20, request_id=request_id)
        assert events[0].queued.tier == tier, request_id
        call = next(c for c in up.calls if c["request_id"] == request_id)
        assert call["tiers"] == [tier] and call["keys"] == [], call
        # The client's deadline reached the upstream (grpc-timeout through Envoy), not just
        # the route's cap of 600 s.
        assert call["remaining"] is not None and 0 < call["remaining"] < 25, call
    assert stand_in.canary.calls == []  # canary off


def test_refusals_are_grpc_statuses_and_never_reach_the_upstream(stand_in):
    before = len(stand_in.primary.calls) + len(stand_in.canary.calls)
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    assert status_of(stand_in.target, [("x-api-key", "tf-nope-0123456789abcdef")]) == (
        unauthenticated,
        "unknown API key",
    )
    code, details = status_of(stand_in.target, [("x-tierflow-tier", "critical")])
    assert code is unauthenticated and "missing API key" in details
    # A tier the gateway knows but the edge has no route for: refused, not forwarded untiered.
    code, details = status_of(stand_in.target, [("x-api-key", INTERNAL_KEY)])
    assert code is grpc.StatusCode.PERMISSION_DENIED and "no route" in details
    # Only the client API is exposed, even with a good key.
    with grpc.insecure_channel(stand_in.target) as channel, pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(),
            metadata=[("x-api-key", DEMO_KEYS["critical"])],
            timeout=10,
        )
    assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert len(stand_in.primary.calls) + len(stand_in.canary.calls) == before
    denied = [e for e in stand_in.gateway.log_events() if e.get("event") == "denied"]
    assert {e["reason"] for e in denied} >= {"unknown key", "no key"}
    assert "tf-nope-0123456789abcdef" not in stand_in.gateway.log_path.read_text()


def test_canary_is_off_until_its_runtime_key_is_set(stand_in):
    metadata = [("x-api-key", DEMO_KEYS["standard"])]
    for _ in range(10):
        generate_through(stand_in.target, metadata)
    assert stand_in.canary.calls == []
    # The one documented switch (envoy/README.md): the canary cluster's weight. 100 against the
    # primary's default 100 is an even split, so both sides must see some of 40 requests.
    runtime_modify(stand_in.admin_port, {CANARY_KEY: 100})
    try:
        primary_before = len(stand_in.primary.calls)
        for _ in range(40):
            generate_through(stand_in.target, metadata)
        to_canary = len(stand_in.canary.calls)
        assert 1 <= to_canary <= 39
        assert len(stand_in.primary.calls) - primary_before == 40 - to_canary
        assert all(c["tiers"] == ["standard"] for c in stand_in.canary.calls)
    finally:
        runtime_modify(stand_in.admin_port, {CANARY_KEY: 0})


def test_gateway_unreachable_fails_closed(tmp_path):
    upstream = RecordingUpstream("primary")
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
    envoy, port, _ = start_edge(tmp_path, queue_service=upstream.target, gateway=nowhere)
    try:
        code, _ = status_of(f"127.0.0.1:{port}", [("x-api-key", DEMO_KEYS["critical"])])
        assert code is grpc.StatusCode.UNAVAILABLE
        assert upstream.calls == []
    finally:
        envoy.stop()
        upstream.stop()


# ---------------------------------------------------------------- the real services


@dataclass
class EdgeStack:
    queue_service: ServiceProcess
    worker: ServiceProcess
    gateway: ServiceProcess
    envoy: ServiceProcess
    target: str  # Envoy: gRPC and JSON (and the OpenAI API when started)
    port: int
    openai_api: ServiceProcess | None = None
    kafka: KafkaSettings | None = None  # its own topics
    keys: Path = KEYS_FILE  # the gateway's keys file
    certs: Path | None = None  # the identities: a direct call to the queue service is mTLS

    def processes(self) -> list[ServiceProcess]:
        """Its services, for the logs of a failed test (``conftest``)."""
        procs = [self.queue_service, self.worker, self.gateway, self.openai_api, self.envoy]
        return [p for p in procs if p is not None]

    def operator(self) -> grpc.ChannelCredentials:
        """The operator's credentials, for a call straight to the queue service."""
        assert self.certs is not None
        return TlsFiles.load(self.certs, Identity(Role.OPERATOR)).channel_credentials()

    def direct_channel(self) -> grpc.Channel:
        """A channel straight to the queue service, as the operator (past the edge)."""
        target = self.queue_service.args[self.queue_service.args.index("--listen") + 1]
        return grpc.secure_channel(target, self.operator())

    def client(self, key_tier: str, **kw) -> TierflowClient:
        """A client through Envoy with the demo key of ``key_tier``."""
        return TierflowClient(self.target, api_key=DEMO_KEYS[key_tier], **kw)

    def queue_service_saw(self, request_id: str) -> bool:
        return any(e.get("request_id") == request_id for e in self.queue_service.log_events())


@contextlib.contextmanager
def edge_stack(
    tmp: Path,
    kafka,
    *,
    model: str,
    chunk_size: int,
    rate_limits=None,
    openai: bool = False,
    queue_service_args: list[str] | None = None,
    worker_args: list[str] | None = None,
    tiers_toml: str = TIERS,
    keys: Path = KEYS_FILE,
):
    prefix = f"t{uuid.uuid4().hex[:12]}."  # topics of this stack's own
    settings = KafkaSettings(
        bootstrap=kafka.bootstrap, topic_prefix=prefix, group_id=f"{prefix}queue"
    )
    tiers = tmp / "tiers.toml"
    tiers.write_text(tiers_toml)
    # Envoy, the OpenAI service and the worker reach the queue service, and Envoy the gateway,
    # over mTLS.
    certs = tmp / "certs"
    ensure(certs, [*STANDARD, Identity.worker("w1")])
    started: list[ServiceProcess] = []
    try:
        qs, qs_target = start_queue_service(
            tmp, settings, model=model, tiers=tiers, extra=queue_service_args, tls_dir=certs
        )
        started.append(qs)
        worker = start_worker(
            tmp, qs_target, "w1", model=model, chunk_size=chunk_size, extra=worker_args,
            tls_dir=certs,
        )  # fmt: skip
        started.append(worker)
        gateway, gateway_target = start_gateway(tmp, keys=keys, tiers=tiers, tls_dir=certs)
        started.append(gateway)
        openai_api, openai_target = None, None
        if openai:
            openai_api, openai_target = start_openai_api(
                tmp, qs_target, model=model, tiers=tiers, tls_dir=certs
            )
            started.append(openai_api)
        envoy, port, _ = start_edge(
            tmp,
            queue_service=qs_target,
            gateway=gateway_target,
            openai_api=openai_target,
            rate_limits=rate_limits,
            tls_dir=certs,
        )
        started.append(envoy)
        target = f"127.0.0.1:{port}"
        yield EdgeStack(qs, worker, gateway, envoy, target, port, openai_api, settings, keys, certs)
    finally:
        for proc in reversed(started):
            proc.stop()


# batch gets a bucket of 3 that (practically) never refills: the 4th batch request is refused.
BATCH_BURST = 3


@pytest.fixture(scope="class")
def tiny_edge(tmp_path_factory, kafka):
    tmp = tmp_path_factory.mktemp("tiny_edge")
    keys = tmp / "keys.toml"  # a copy: a test adds a key while the stack runs
    keys.write_text(KEYS_FILE.read_text())
    with edge_stack(
        tmp,
        kafka,
        model="tiny-llama",
        chunk_size=64,
        rate_limits={"batch": (BATCH_BURST, 0.0001)},
        keys=keys,
    ) as stack:
        yield stack


class TestTinyStack:
    def test_each_key_reaches_the_queue_service_with_its_tier(self, tiny_edge):
        for tier in ("critical", "standard", "batch"):
            with tiny_edge.client(tier) as client:
                done = client.complete(ids(40, seed=1), max_new_tokens=2, timeout=120)
            assert done.tier == tier and done.text is not None
        # A spoofed tier header is overwritten by the gateway's.
        with tiny_edge.client("standard", tier="critical") as client:
            done = client.complete(ids(40, seed=2), max_new_tokens=1, timeout=120)
        assert done.tier == "standard"

    def test_unknown_key_is_unauthenticated_and_never_queued(self, tiny_edge):
        for request_id, metadata in {
            "edge-unknown-key": [("x-api-key", "tf-unknown-0123456789abcdef")],
            "edge-no-key": [("x-tierflow-tier", "critical")],
        }.items():
            code, _ = status_of(tiny_edge.target, metadata, request_id=request_id)
            assert code is grpc.StatusCode.UNAUTHENTICATED
        with tiny_edge.client("critical") as client:  # a request after them is served...
            assert client.complete("still there?", max_new_tokens=1, timeout=120).text is not None
        # ...and the refused ones never reached the queue service.
        assert not tiny_edge.queue_service_saw("edge-unknown-key")
        assert not tiny_edge.queue_service_saw("edge-no-key")
        assert "tf-unknown-0123456789abcdef" not in tiny_edge.gateway.log_path.read_text()

    def test_a_key_over_its_rate_limit_is_resource_exhausted(self, tiny_edge):
        refused = None
        for i in range(BATCH_BURST + 1):  # earlier tests may have spent some of the bucket
            try:
                with tiny_edge.client("batch") as client:
                    client.complete(ids(20, seed=i), request_id=f"edge-rl-{i}", timeout=120)
            except grpc.RpcError as exc:
                refused = (i, exc.code(), exc.details())
                break
        assert refused is not None, "batch was never rate limited"
        i, code, details = refused
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert not tiny_edge.queue_service_saw(demo_scoped("batch", f"edge-rl-{i}"))
        # JSON clients get HTTP 429 for the same refusal.
        status, _ = post_json(tiny_edge.port, DEMO_KEYS["batch"], {"text": "hi"})
        assert status == 429
        # Buckets are per key. Another batch key, added to the keys file while everything
        # runs, is served: the gateway reloads the file, and Envoy gives the new label a
        # bucket of its own on its first request, without a restart.
        other = "tf-test-batch-two-0123456789abcdef"
        with tiny_edge.keys.open("a") as keys:
            keys.write(f'\n[keys.second-batch]\nsha256 = "{hash_key(other)}"\ntier = "batch"\n')
        assert served_once_known(tiny_edge.target, other).tier == "batch"
        code, _ = status_of(tiny_edge.target, [("x-api-key", DEMO_KEYS["batch"])])
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED  # the first key's bucket still empty


def served_once_known(target: str, key: str, wait_s: float = 30.0):
    """The completion of a request with ``key``, sent again while the gateway does not know
    the key yet (a refusal for an unknown key spends no rate-limit token)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with TierflowClient(target, api_key=key) as client:
                return client.complete(ids(20, seed=11), timeout=120)
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.UNAUTHENTICATED or time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def post_json(port: int, key: str | None, body: dict) -> tuple[int, bytes]:
    conn, reply = post_generate(port, key, body, timeout=60)
    try:
        return reply.status, reply.read()
    finally:
        conn.close()


@pytest.fixture(scope="class")
def bench_edge(tmp_path_factory, kafka):
    # bench-llama: prefills of thousands of tokens take seconds on a CPU.
    with edge_stack(
        tmp_path_factory.mktemp("bench_edge"), kafka, model="bench-llama", chunk_size=512
    ) as stack:
        yield stack


class TestBenchStack:
    def test_json_generate_streams_events_as_they_happen(self, bench_edge):
        status, body = post_json(bench_edge.port, "tf-unknown-0123456789abcdef", {"text": "hi"})
        assert status == 401 and body == b"unknown API key"
        body = {
            "token_ids": {"ids": ids(2500, seed=5)},
            "max_new_tokens": 2,
            "request_id": "json-1",
        }
        conn, reply = post_generate(bench_edge.port, DEMO_KEYS["standard"], body, timeout=300)
        assert reply.status == 200 and reply.getheader("content-type") == "application/json"
        first = json.loads(reply.readline())
        # Queued arrived while the prefill was still to run: it was streamed, not buffered.
        assert first["queued"]["tier"] == "standard" and first["request_id"] == "json-1"
        assert not any(
            e.get("event") == "finished"
            and e.get("request_id") == demo_scoped("standard", "json-1")
            for e in bench_edge.worker.log_events()
        )
        events = [first] + [json.loads(line) for line in reply if line.strip()]
        conn.close()
        order = [next(k for k in e if k != "request_id") for e in events]
        assert order[0] == "queued" and order[-1] == "done", order
        assert "progress" in order and order.index("first_token") < order.index("done")
        assert events[-1]["done"]["usage"] == {"prompt_tokens": 2500, "completion_tokens": 2}

    def test_client_deadline_passes_through_envoy_and_cancels_the_work(self, bench_edge):
        events = []
        request = serving_pb2.GenerateRequest(
            token_ids=serving_pb2.TokenIds(ids=ids(7000, seed=6)),
            max_new_tokens=64,
            request_id="deadline-1",
        )
        with (
            grpc.insecure_channel(bench_edge.target) as channel,
            pytest.raises(grpc.RpcError) as err,
        ):
            # 7000 tokens: a prefill of 5 s or more here; the client gives up after 4, by
            # which time the worker runs it.
            call = serving_pb2_grpc.TierflowStub(channel).Generate(
                request, metadata=[("x-api-key", DEMO_KEYS["batch"])], timeout=4
            )
            for event in call:
                events.append(event)
        # Envoy enforces the same grpc-timeout and resets a stream it times out (INTERNAL for
        # the client); the queue service ends the stream a margin before, with the terminal
        # event and the status, so the client sees exactly DEADLINE_EXCEEDED.
        # No wall-clock bound here: the client's own 4 s deadline ends the call whatever the load.
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
        assert kinds(events)[0] == "queued" and kinds(events)[-1] == "error", kinds(events)
        assert events[-1].error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        name = demo_scoped("batch", "deadline-1")
        bench_edge.queue_service.wait_for_log(
            "client gone, cancelling", request_id=name, timeout=60
        )
        # It was on the worker when time ran out (on a loaded machine maybe before its first
        # chunk ended), and the worker stopped it.
        bench_edge.worker.wait_for_log("assigned", request_id=name, timeout=5)
        bench_edge.worker.wait_for_log("cancelled", request_id=name, timeout=60)
        assert not any(
            e.get("event") == "finished" and e.get("request_id") == name
            for e in bench_edge.worker.log_events()
        )

    def test_a_failure_after_the_stream_started_reaches_a_json_client_over_http1(self, bench_edge):
        """No trailers over HTTP/1.1: the terminal error event, a JSON line, says how it ended."""
        conn = http.client.HTTPConnection("127.0.0.1", bench_edge.port, timeout=120)
        body = {
            "token_ids": {"ids": ids(7000, seed=7)},
            "max_new_tokens": 8,
            "request_id": "json-deadline-1",
            "timeout_ms": 4000,  # the service's own deadline: no client or Envoy timer races it
        }
        conn.request(
            "POST",
            "/v1/generate",
            body=json.dumps(body),
            headers={"x-api-key": DEMO_KEYS["standard"], "content-type": "application/json"},
        )
        reply = conn.getresponse()
        assert reply.status == 200  # the stream started with Queued
        events = [json.loads(line) for line in reply if line.strip()]
        conn.close()
        order = [next(k for k in e if k != "request_id") for e in events]
        assert order[0] == "queued" and order[-1] == "error", order
        assert events[-1]["error"]["code"] == "DEADLINE_EXCEEDED"
        assert "deadline" in events[-1]["error"]["message"]

    def test_critical_through_envoy_meets_its_slo_during_a_long_batch_prefill(self, bench_edge):
        batch_events: list = []
        with bench_edge.client("batch") as batch_client:
            stream = batch_client.generate(ids(3500, seed=1), timeout=300)
            for event in stream:  # until the batch prefill is under way
                batch_events.append(event)
                if event.WhichOneof("event") == "progress":
                    break
            with bench_edge.client("critical") as critical_client:
                critical = list(critical_client.generate(ids(24, seed=2), timeout=120))
            batch_events.extend(stream)
        assert kinds(critical)[0] == "queued" and critical[0].queued.tier == "critical"
        assert kinds(critical)[-1] == "done" and kinds(batch_events)[-1] == "done"
        critical_first = next(
            e.first_token for e in critical if e.WhichOneof("event") == "first_token"
        )
        batch_done = batch_events[-1].done
        # It waited about one layer, not the batch's 3500 tokens: its wait (TTFT less its own
        # prefill) against the batch prefill's engine time in this same run, whatever the box.
        assert critical_wait_ms(critical) < batch_done.timings.prefill_ms / 3
        assert critical_first.ttft_ms < batch_done.timings.ttft_ms  # it went first...
        assert batch_done.timings.preemptions >= 1  # ...by preempting the batch prefill


def critical_wait_ms(events) -> float:
    """Admission to first token, less the request's own prefill: the time it waited."""
    timings = events[-1].done.timings
    return timings.ttft_ms - timings.prefill_ms
