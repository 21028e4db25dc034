"""Batch shedding, end to end through Envoy: a request the scheduler would shed is refused at
admission with RESOURCE_EXHAUSTED, before it is queued (gRPC: the status with no Queued event;
JSON over HTTP/1.1: 429). Real queue service (shedding after 2 waiting batch requests, no worker
so that they keep waiting), real gateway, real Envoy."""

from __future__ import annotations

import http.client
import json

import grpc

from gateway.demo_keys import DEMO_KEYS
from tests.integration.load import stream_until
from tests.integration.processes import start_edge, start_gateway, start_queue_service
from tests.integration.test_edge import KEYS_FILE
from tests.tiers import SERVICE_TIERS_TOML
from tierflow.client import TierflowClient


def test_a_batch_request_that_would_be_shed_is_refused_before_it_is_queued(
    tmp_path, kafka_settings
):
    tiers = tmp_path / "tiers.toml"
    tiers.write_text(SERVICE_TIERS_TOML)
    started = []
    try:
        qs, qs_target = start_queue_service(
            tmp_path, kafka_settings, model="tiny-llama", tiers=tiers,
            extra=["--max-queued-sheddable", "2", "--no-worker-timeout", "600"],
        )  # fmt: skip
        started.append(qs)
        gateway, gateway_target = start_gateway(tmp_path, keys=KEYS_FILE, tiers=tiers)
        started.append(gateway)
        envoy, port, _ = start_edge(tmp_path, queue_service=qs_target, gateway=gateway_target)
        started.append(envoy)
        edge = f"127.0.0.1:{port}"
        # Two batch requests wait (no worker): the shedding limit is reached.
        waiting = [
            stream_until(
                edge,
                None,
                f"wait-{i}",
                [5, 6, 7],
                until=lambda k: "queued" in k,
                api_key=DEMO_KEYS["batch"],
            )
            for i in range(2)
        ]
        with TierflowClient(edge, api_key=DEMO_KEYS["batch"]) as watcher:  # ids are per key
            for i in range(2):  # until the scheduler holds them
                _wait_scheduled(watcher, f"wait-{i}")
        # gRPC through Envoy: refused with the scheduler's reason, and never queued.
        with TierflowClient(edge, api_key=DEMO_KEYS["batch"]) as client:
            events = []
            try:
                for event in client.generate([5, 6, 7], request_id="shed-grpc"):
                    events.append(event.WhichOneof("event"))
                raise AssertionError(f"not refused: {events}")
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                assert "overloaded" in exc.details()
            assert events == []  # no Queued before the refusal
        # JSON over HTTP/1.1 through Envoy's transcoder: a 429, not a 200 stream.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request(
            "POST", "/v1/generate",
            body=json.dumps({"tokenIds": {"ids": [5, 6, 7]}, "requestId": "shed-json"}),
            headers={"content-type": "application/json", "x-api-key": DEMO_KEYS["batch"]},
        )  # fmt: skip
        reply = conn.getresponse()
        body = reply.read().decode()
        assert reply.status == 429, (reply.status, body)
        assert "overloaded" in body
        with TierflowClient(edge, api_key=DEMO_KEYS["batch"]) as watcher:  # ids are per key
            for request_id in ("shed-grpc", "shed-json"):
                try:
                    watcher.status(request_id)
                    raise AssertionError(f"{request_id} was queued")
                except grpc.RpcError as exc:
                    assert exc.code() is grpc.StatusCode.NOT_FOUND
        # A critical request is not sheddable: it is queued as usual.
        with TierflowClient(edge, api_key=DEMO_KEYS["critical"]) as client:
            stream = client.generate([5, 6, 7], request_id="critical-ok")
            assert next(stream).WhichOneof("event") == "queued"
            stream.close()
        assert all(reached.is_set() for _, reached in waiting)
    finally:
        for proc in reversed(started):
            proc.stop()


def _wait_scheduled(client: TierflowClient, request_id: str, timeout: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            client.status(request_id)
            return
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.NOT_FOUND and time.monotonic() < deadline
            time.sleep(0.1)
