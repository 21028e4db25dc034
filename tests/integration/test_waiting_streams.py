"""A request that waits in its queue keeps its stream alive, on every path through a real Envoy:
``still_waiting`` events on gRPC and as JSON lines over HTTP/1.1, SSE comments on the OpenAI
API. Envoy's per-stream idle timeout counts data, and HTTP/2 PINGs are not data, so without
them a request queued longer than the route's idle timeout (60 s for critical) would end in a
504 from the edge. No worker is attached here, so the requests wait for as long as the test
reads; the heartbeat interval is shortened to 0.3 s."""

from __future__ import annotations

import http.client
import json

from gateway.demo_keys import DEMO_KEYS
from tests.integration.json_http import post_generate
from tests.integration.processes import (
    start_edge,
    start_gateway,
    start_openai_api,
    start_queue_service,
)
from tests.integration.test_edge import KEYS_FILE
from tests.tiers import SERVICE_TIERS_TOML
from tierflow.client import TierflowClient

MODEL = "tiny-llama"


def test_a_queued_request_gets_heartbeats_on_grpc_json_and_the_openai_api(tmp_path, kafka_settings):
    tiers = tmp_path / "tiers.toml"
    tiers.write_text(SERVICE_TIERS_TOML)
    started = []
    try:
        qs, qs_target = start_queue_service(
            tmp_path, kafka_settings, model=MODEL, tiers=tiers,
            extra=["--stream-heartbeat", "0.3", "--no-worker-timeout", "600"],
        )  # fmt: skip
        started.append(qs)
        gateway, gateway_target = start_gateway(tmp_path, keys=KEYS_FILE, tiers=tiers)
        started.append(gateway)
        openai_api, openai_target = start_openai_api(tmp_path, qs_target, model=MODEL, tiers=tiers)
        started.append(openai_api)
        envoy, port, _ = start_edge(
            tmp_path, queue_service=qs_target, gateway=gateway_target, openai_api=openai_target
        )
        started.append(envoy)
        key = DEMO_KEYS["critical"]

        # gRPC through Envoy: Queued, the no-worker notice, then heartbeats that count up.
        with TierflowClient(f"127.0.0.1:{port}", api_key=key) as client:
            stream = client.generate([5, 6, 7], request_id="wait-grpc")
            kinds, waited = [], []
            for event in stream:
                kinds.append(event.WhichOneof("event"))
                if kinds[-1] == "still_waiting":
                    waited.append(event.still_waiting.waited_ms)
                if len(waited) == 2:
                    break
            stream.close()
        assert kinds[0] == "queued" and kinds[-2:] == ["still_waiting", "still_waiting"]
        assert 0 < waited[0] < waited[1]

        # JSON over HTTP/1.1: the same events, one line each.
        body = {"tokenIds": {"ids": [5, 6, 7]}, "requestId": "wait-json"}
        conn, reply = post_generate(port, key, body, timeout=60)
        try:
            assert reply.status == 200
            lines = []
            while sum("still_waiting" in line for line in lines) < 2:
                lines.append(json.loads(reply.readline()))
            assert "queued" in lines[0]
            assert lines[-1]["still_waiting"]["waited_ms"] > 0
        finally:
            conn.close()

        # The OpenAI API, streamed: the response starts and carries SSE comments.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            conn.request(
                "POST", "/v1/chat/completions", body=json.dumps(chat),
                headers={"content-type": "application/json", "authorization": f"Bearer {key}"},
            )  # fmt: skip
            reply = conn.getresponse()
            assert reply.status == 200
            assert reply.getheader("content-type").startswith("text/event-stream")
            comments = 0
            while comments < 2:
                line = reply.readline().decode()
                assert line, "the stream ended"
                comments += line.startswith(": waiting in the queue")
        finally:
            conn.close()
    finally:
        for proc in reversed(started):
            proc.stop()
