"""Clients recover when the queue service dies under their streams: a real queue service
process is killed (SIGKILL) or stopped (SIGTERM) mid-stream and started again on the same
port, behind the real edge (Envoy, the gateway) with real Kafka and a real worker.

What each client sees, each checked below:
  tierflow.client (sync, via Envoy)  reattaches by itself with the id from Queued; one stream,
                                     each token once, Done
  AsyncTierflowClient (direct)       the same, for asyncio (the OpenAI service's client)
  JSON over HTTP/1.1 (via Envoy)     the stream breaks off without a terminal line; docs/api.md's
                                     recipe (POST the same body with the request_id) gets Done
  a raw gRPC stub, SIGTERM           the terminal error event UNAVAILABLE, then that status
  a new request while it is down     UNAVAILABLE from the edge (HTTP 503 for JSON)
Every request completes once on the worker. Bounds are generous: CI has 2 shared cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gateway.demo_keys import DEMO_KEYS
from launch.processes import ServiceProcess, free_port
from tests.integration.json_http import post_generate
from tests.integration.processes import (
    operator,
    start_edge,
    start_gateway,
    start_queue_service,
    start_worker,
)
from tests.integration.test_edge import KEYS_FILE, TIERS, demo_scoped, ids, kinds
from tierflow.client import CHANNEL_OPTIONS, AsyncTierflowClient, TierflowClient
from tierflow.identity import Role, open_channel, pinned
from tierflow.kafka_settings import KafkaSettings
from tierflow.v1 import serving_pb2, serving_pb2_grpc

MODEL = "bench-llama"  # a 3000-token prefill takes seconds: the kill lands mid-stream
LONG, SHORT = 3000, 64  # prompt tokens: one request runs long, the other waits behind it
TIMEOUT_S = 600  # for a whole request across a restart, on a loaded 2-core machine
# A restart takes seconds to tens of seconds on a loaded 2-core machine: reattach for long enough.
REATTACH_S = 240.0


@dataclass
class Stack:
    tmp: Path
    settings: KafkaSettings
    tiers: Path
    queue_port: int
    queue_service: ServiceProcess
    worker: ServiceProcess
    envoy_port: int
    certs: Path  # every hop is mTLS; a direct caller presents the operator's identity
    restarts: int = 0

    @property
    def operator(self) -> grpc.ChannelCredentials:
        return operator(self.certs)

    @property
    def edge(self) -> str:
        return f"127.0.0.1:{self.envoy_port}"

    @property
    def direct(self) -> str:
        return f"127.0.0.1:{self.queue_port}"

    def restart_queue_service(self) -> None:
        """The same service again: same port, instance id, topics and consumer group."""
        self.restarts += 1
        tmp = self.tmp / f"restart-{self.restarts}"
        tmp.mkdir()
        self.queue_service, _ = start_queue_service(
            tmp, self.settings, model=MODEL, tiers=self.tiers, port=self.queue_port,
            tls_dir=self.certs,
        )  # fmt: skip

    def finished_on_worker(self, name: str) -> int:
        """How many times the worker finished the request (its log line may follow the client's
        Done by a moment: waited for)."""
        self.worker.wait_for_log("finished", request_id=name, timeout=60)
        return sum(
            1
            for e in self.worker.log_events()
            if e.get("event") == "finished" and e.get("request_id") == name
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory, kafka, certs):
    tmp = tmp_path_factory.mktemp("recovery")
    prefix = f"t{uuid.uuid4().hex[:12]}."
    settings = KafkaSettings(
        bootstrap=kafka.bootstrap, topic_prefix=prefix, group_id=f"{prefix}queue"
    )
    tiers = tmp / "tiers.toml"
    tiers.write_text(TIERS)
    started: list[ServiceProcess] = []
    the_stack = None
    try:
        queue_port = free_port()
        qs, qs_target = start_queue_service(
            tmp, settings, model=MODEL, tiers=tiers, port=queue_port, tls_dir=certs
        )
        started.append(qs)
        worker = start_worker(tmp, qs_target, "w1", model=MODEL, chunk_size=256, tls_dir=certs)
        started.append(worker)
        gateway, gateway_target = start_gateway(tmp, keys=KEYS_FILE, tiers=tiers, tls_dir=certs)
        started.append(gateway)
        envoy, port, _ = start_edge(
            tmp, queue_service=qs_target, gateway=gateway_target, tls_dir=certs
        )
        started.append(envoy)
        the_stack = Stack(tmp, settings, tiers, queue_port, qs, worker, port, certs)
        yield the_stack
    finally:
        if the_stack is not None:
            the_stack.queue_service.stop()
        for proc in reversed(started):
            proc.stop()


def own_connection() -> list[tuple[str, object]]:
    """Options for a channel with a connection of its own: grpc shares connections between a
    process's channels of the same target and options, and one that failed while the service
    was down stays in its redial backoff (up to 120 s by default) for every channel sharing it.
    A unique user agent makes the options unique; the client's short backoff bounds the rest."""
    return [
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.primary_user_agent", f"recovery-test-{uuid.uuid4().hex}"),
        *CHANNEL_OPTIONS,
    ]


def json_lines(port: int, key: str, body: dict, lines: list[dict]) -> None:
    """POST /v1/generate over HTTP/1.1, appending each JSON line as it comes, until the stream
    ends or breaks off (the connection closed mid-chunk)."""
    conn, reply = post_generate(port, key, body, timeout=300)
    try:
        assert reply.status == 200, reply.read()
        with contextlib.suppress(http.client.HTTPException, OSError):
            for line in reply:
                if line.strip():
                    lines.append(json.loads(line))
    finally:
        conn.close()


def terminal(lines: list[dict]) -> str | None:
    kinds_ = [next(k for k in e if k != "request_id") for e in lines]
    return kinds_[-1] if kinds_ and kinds_[-1] in ("done", "error") else None


def wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.05)


def test_killed_mid_stream_every_client_recovers_and_each_request_runs_once(stack):
    standard, batch = DEMO_KEYS["standard"], DEMO_KEYS["batch"]
    prompt = ids(LONG, seed=1)
    grpc_events: list = []
    grpc_failure: list[BaseException] = []

    def grpc_client() -> None:
        try:
            with TierflowClient(stack.edge, api_key=standard, reattach_s=REATTACH_S) as client:
                for event in client.generate(prompt, max_new_tokens=3, timeout=TIMEOUT_S):
                    grpc_events.append(event)
        except BaseException as exc:
            grpc_failure.append(exc)

    # A standard request runs its long prefill; a batch one (JSON) waits behind it.
    grpc_thread = threading.Thread(target=grpc_client)
    grpc_thread.start()
    wait_for(lambda: grpc_events)
    grpc_name = demo_scoped("standard", grpc_events[0].request_id)
    stack.worker.wait_for_log("assigned", request_id=grpc_name, timeout=60)
    json_body = {"token_ids": {"ids": ids(SHORT, seed=2)}, "max_new_tokens": 3}
    first_lines: list[dict] = []
    json_thread = threading.Thread(
        target=json_lines, args=(stack.envoy_port, batch, json_body, first_lines)
    )
    json_thread.start()
    wait_for(lambda: first_lines)  # both queued: durable in Kafka
    stack.queue_service.kill()  # SIGKILL, mid-stream

    # While it is down, the edge answers new requests UNAVAILABLE (HTTP 503 for JSON).
    with (
        grpc.insecure_channel(stack.edge, options=own_connection()) as channel,
        pytest.raises(grpc.RpcError) as err,
    ):
        list(
            serving_pb2_grpc.TierflowStub(channel).Generate(
                serving_pb2.GenerateRequest(text="anyone?"),
                metadata=[("x-api-key", standard)],
                timeout=30,
            )
        )
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert json_status(stack, {"text": "anyone?"}) == 503
    json_thread.join(60)  # the JSON stream broke off...
    assert not json_thread.is_alive() and terminal(first_lines) is None, first_lines  # silently

    stack.restart_queue_service()
    # The recipe for any client (docs/api.md): the same body again, with the id from `queued`.
    json_id = first_lines[0]["request_id"]
    again: list[dict] = []
    json_lines(stack.envoy_port, batch, json_body | {"request_id": json_id}, again)
    assert terminal(again) == "done", again
    assert again[-1]["done"]["usage"] == {"prompt_tokens": SHORT, "completion_tokens": 3}

    grpc_thread.join(TIMEOUT_S)
    assert not grpc_failure, grpc_failure
    # The sync client reattached by itself: one stream, Queued once, each token once.
    order = kinds(grpc_events)
    assert order[0] == "queued" and order[-1] == "done", order
    assert order.count("queued") == 1 and order.count("first_token") == 1
    assert order.count("token") == 2
    done = grpc_events[-1].done
    assert done.usage.prompt_tokens == LONG and done.usage.completion_tokens == 3
    assert stack.finished_on_worker(grpc_name) == 1
    assert stack.finished_on_worker(demo_scoped("batch", json_id)) == 1


def json_status(stack, body: dict) -> int:
    conn, reply = post_generate(stack.envoy_port, DEMO_KEYS["standard"], body, timeout=30)
    try:
        reply.read()
        return reply.status
    finally:
        conn.close()


def test_stopped_mid_stream_clients_are_told_unavailable_and_the_async_client_reattaches(stack):
    raw_events: list = []
    raw_status: list[grpc.StatusCode] = []
    request = serving_pb2.GenerateRequest(
        token_ids=serving_pb2.TokenIds(ids=ids(LONG, seed=3)), max_new_tokens=2
    )

    def raw_client() -> None:
        with open_channel(stack.direct, stack.operator, own_connection()) as channel:
            call = serving_pb2_grpc.TierflowStub(channel).Generate(
                request, metadata=[("x-tierflow-tier", "critical")], timeout=TIMEOUT_S
            )
            try:
                for event in call:
                    raw_events.append(event)
            except grpc.RpcError as exc:
                raw_status.append(exc.code())

    # A critical request (a raw stub) runs its long prefill; a batch one (the async client)
    # waits behind it.
    raw = threading.Thread(target=raw_client)
    raw.start()
    wait_for(lambda: raw_events)
    raw_id = raw_events[0].request_id
    stack.worker.wait_for_log("assigned", request_id=raw_id, timeout=60)

    async def async_client() -> None:
        client = AsyncTierflowClient(
            stack.direct, credentials=stack.operator, reattach_s=REATTACH_S
        )
        try:
            call = client.generate(
                ids(SHORT, seed=4), tier="batch", max_new_tokens=2, timeout=TIMEOUT_S
            )
            async for event in call:
                async_events.append(event)
        finally:
            await client.close()

    async_events: list = []
    async_thread = threading.Thread(target=asyncio.run, args=(async_client(),))
    async_thread.start()
    wait_for(lambda: async_events)  # queued
    # SIGTERM: the service ends its client streams with UNAVAILABLE and stops; the requests stay
    # queued in Kafka. It comes back on the same port. (Started from this thread: a service
    # process is stopped when the thread that started it ends, PR_SET_PDEATHSIG.)
    stack.queue_service.stop()
    stack.restart_queue_service()
    async_thread.join(TIMEOUT_S)
    events = async_events
    order = kinds(events)
    assert order[0] == "queued" and order[-1] == "done", order
    assert order.count("queued") == 1 and order.count("first_token") == 1
    raw.join(60)
    assert raw_status == [grpc.StatusCode.UNAVAILABLE], raw_status
    assert raw_events[-1].WhichOneof("event") == "error", kinds(raw_events)
    assert raw_events[-1].error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "reattach" in raw_events[-1].error.message
    # The raw client did not reattach, yet its request was not lost, and it ran once: on the
    # worker, which keeps computing while the stopping service waits for its streams to close
    # (the service then commits it), or after the restart, redelivered from Kafka.
    finished = stack.worker.wait_for_log("finished", request_id=raw_id, timeout=TIMEOUT_S)
    assert stack.finished_on_worker(raw_id) == 1
    ready = stack.queue_service.wait_for_log("queue service ready")
    if finished["timestamp"] > ready["timestamp"]:  # ran on the restarted service: it knows
        status = asyncio.run(get_request(stack.direct, stack.operator, raw_id))
        assert status.state == serving_pb2.RequestStatus.DONE


async def get_request(target: str, credentials, request_id: str) -> serving_pb2.RequestStatus:
    options = pinned(own_connection(), Role.QUEUE_SERVICE)
    async with grpc.aio.secure_channel(target, credentials, options=options) as channel:
        return await serving_pb2_grpc.TierflowStub(channel).GetRequest(
            serving_pb2.GetRequestRequest(request_id=request_id), timeout=60, wait_for_ready=True
        )
