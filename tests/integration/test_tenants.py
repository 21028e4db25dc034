"""Tenants apart, through the real edge: Envoy, the gateway, the OpenAI-compatible service, the
queue service, Kafka and a worker (tiny-llama), each a real process.

Request ids are scoped to the API key: one key never sees, joins or cancels another key's
request, whatever id it sends, on every path (gRPC, JSON over HTTP/1.1 and HTTP/2, the OpenAI
API). A retry from the same key joins only when it is the same request. Keys are accepted with
surrounding whitespace on every path alike. The stack knows two keys of the critical tier (the
demo key and ``CRITICAL_2``), so that "scoped per key" cannot pass as "scoped per tier".
"""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import threading

import grpc
import pytest

from gateway.demo_keys import DEMO_KEYS
from gateway.keys import hash_key
from tests.integration.json_http import post_generate
from tests.integration.test_edge import KEYS_FILE, edge_stack, ids, kinds
from tierflow.client import TierflowClient
from tierflow.v1 import serving_pb2, serving_pb2_grpc

MODEL = "tiny-llama"


# A second customer of the critical tier (its key label: second-critical).
CRITICAL_2 = "tf-test-critical-two-0123456789abcdef"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, kafka):
    tmp = tmp_path_factory.mktemp("tenants")
    keys = tmp / "keys.toml"
    keys.write_text(
        KEYS_FILE.read_text()
        + f'\n[keys.second-critical]\nsha256 = "{hash_key(CRITICAL_2)}"\ntier = "critical"\n'
    )
    with edge_stack(tmp, kafka, model=MODEL, chunk_size=64, openai=True, keys=keys) as stack:
        yield stack


def token_ids(events) -> list[int]:
    return [
        getattr(e, e.WhichOneof("event")).token_id
        for e in events
        if e.WhichOneof("event") in ("first_token", "token")
    ]


def generate(stack, key: str, prompt, request_id: str, **kw) -> list:
    """The events of a Generate call through Envoy with ``key``."""
    with grpc.insecure_channel(stack.target) as channel:
        request = serving_pb2.GenerateRequest(
            token_ids=serving_pb2.TokenIds(ids=prompt), request_id=request_id, **kw
        )
        call = serving_pb2_grpc.TierflowStub(channel).Generate(
            request, metadata=[("x-api-key", key)], timeout=120
        )
        return list(call)


def grpc_status(stack, key: str, request_id: str, extra=()) -> serving_pb2.RequestStatus:
    with grpc.insecure_channel(stack.target) as channel:
        return serving_pb2_grpc.TierflowStub(channel).GetRequest(
            serving_pb2.GetRequestRequest(request_id=request_id),
            metadata=[("x-api-key", key), *extra],
            timeout=30,
        )


def grpc_status_code(stack, key: str, request_id: str, extra=()) -> grpc.StatusCode:
    try:
        grpc_status(stack, key, request_id, extra)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def get_http1(stack, key: str, request_id: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
    try:
        conn.request("GET", f"/v1/requests/{request_id}", headers={"x-api-key": key})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"{}")
    finally:
        conn.close()


def curl_http2(stack, key: str, method: str, path: str, body: dict | None = None):
    """(HTTP status, body) of a request over HTTP/2 (prior knowledge, no TLS) with curl."""
    curl = shutil.which("curl")
    assert curl, "the HTTP/2 checks need curl on PATH"
    args = [curl, "-sS", "--http2-prior-knowledge", "-X", method, "-H", f"x-api-key: {key}"]
    if body is not None:
        args += ["-H", "content-type: application/json", "--data", json.dumps(body)]
    args += ["-w", "\n%{http_code} %{http_version}", f"http://{stack.target}{path}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
    text, _, trailer = out.rpartition("\n")
    status, version = trailer.split()
    assert version == "2", out
    return int(status), text


def post_http1(stack, key: str, body: dict) -> tuple[int, list[dict]]:
    conn, reply = post_generate(stack.port, key, body)
    try:
        raw = reply.read()
        if reply.status != 200:
            return reply.status, [json.loads(raw or b"{}")]
        return 200, [json.loads(line) for line in raw.splitlines() if line.strip()]
    finally:
        conn.close()


CRITICAL, STANDARD, BATCH = (DEMO_KEYS[t] for t in ("critical", "standard", "batch"))


def test_a_reused_id_never_hands_one_key_another_keys_result(stack):
    mine, theirs = ids(30, seed=1), ids(12, seed=2)
    first = generate(stack, CRITICAL, mine, "shared-1", max_new_tokens=4)
    assert kinds(first)[0] == "queued" and kinds(first)[-1] == "done"
    # Another key of the same tier sending the same id gets a request of its own, run for its
    # own prompt: not the first key's completion.
    other = generate(stack, CRITICAL_2, theirs, "shared-1", max_new_tokens=2)
    assert kinds(other)[0] == "queued" and kinds(other)[-1] == "done", kinds(other)
    assert other[0].request_id == "shared-1" and other[0].queued.tier == "critical"
    assert other[-1].done.usage.prompt_tokens == len(theirs)
    # The same over JSON (HTTP/1.1) for a third key.
    status, events = post_http1(
        stack, BATCH, {"token_ids": {"ids": theirs}, "request_id": "shared-1"}
    )
    assert status == 200 and "queued" in events[0] and "done" in events[-1], events
    assert events[-1]["done"]["usage"]["prompt_tokens"] == len(theirs)
    # Each key reads its own request under that id.
    assert grpc_status(stack, CRITICAL, "shared-1").usage.prompt_tokens == len(mine)
    assert grpc_status(stack, CRITICAL_2, "shared-1").usage.prompt_tokens == len(theirs)
    # The same key retrying the same request joins it: its tokens and result again, not a second
    # run (no Queued).
    again = generate(stack, CRITICAL, mine, "shared-1", max_new_tokens=4)
    assert kinds(again) == kinds(first)[1:] and again[-1].done.text == first[-1].done.text
    assert token_ids(again) == token_ids(first)
    # The same key with a different request under that id is refused, clearly.
    for changed in ({"max_new_tokens": 5}, {"max_new_tokens": 4, "sampling": {"seed": 7}}):
        with pytest.raises(grpc.RpcError) as err:
            generate(stack, CRITICAL, mine, "shared-1", **changed)
        assert err.value.code() is grpc.StatusCode.ALREADY_EXISTS, changed
        assert "different request" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        generate(stack, CRITICAL, theirs, "shared-1", max_new_tokens=4)
    assert err.value.code() is grpc.StatusCode.ALREADY_EXISTS


def test_another_keys_request_is_not_found_on_every_path(stack):
    done = generate(stack, CRITICAL, ids(20, seed=3), "private-1", max_new_tokens=2)
    assert kinds(done)[-1] == "done"
    # gRPC: NOT_FOUND, also when the caller sends the owner's key label itself (the gateway
    # overwrites it).
    spoof = [("x-tierflow-key-id", "demo-critical")]
    for other in (CRITICAL_2, STANDARD):  # another key of the same tier, and of another tier
        assert grpc_status_code(stack, other, "private-1") is grpc.StatusCode.NOT_FOUND
        assert grpc_status_code(stack, other, "private-1", spoof) is grpc.StatusCode.NOT_FOUND
    assert grpc_status(stack, CRITICAL, "private-1").state == serving_pb2.RequestStatus.DONE
    # JSON over HTTP/1.1 and HTTP/2: 404 for another key, the same body as an unknown id.
    status, body = get_http1(stack, CRITICAL_2, "private-1")
    assert status == 404 and "private-1" in json.dumps(body)
    assert get_http1(stack, STANDARD, "never-used")[0] == 404
    status, text = curl_http2(stack, CRITICAL_2, "GET", "/v1/requests/private-1")
    assert status == 404, text
    status, body = get_http1(stack, CRITICAL, "private-1")
    assert status == 200 and body["state"] == "DONE" and body["request_id"] == "private-1"
    status, text = curl_http2(stack, CRITICAL, "GET", "/v1/requests/private-1")
    assert status == 200 and json.loads(text)["state"] == "DONE"
    # The OpenAI API: its request id (x-tierflow-request-id) is in its key's scope too.
    status, headers, _ = openai_completion(stack, CRITICAL)
    assert status == 200
    openai_id = headers["x-tierflow-request-id"]
    assert grpc_status(stack, CRITICAL, openai_id).state == serving_pb2.RequestStatus.DONE
    assert grpc_status_code(stack, CRITICAL_2, openai_id) is grpc.StatusCode.NOT_FOUND
    assert get_http1(stack, BATCH, openai_id)[0] == 404
    assert curl_http2(stack, STANDARD, "GET", f"/v1/requests/{openai_id}")[0] == 404


def openai_completion(stack, key: str) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=120)
    try:
        body = {"model": MODEL, "prompt": ids(10, seed=4), "max_tokens": 2}
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body),
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        )
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), json.loads(reply.read())
    finally:
        conn.close()


def test_one_key_cannot_join_or_cancel_another_keys_running_request(stack):
    owner_events: list = []
    owner_started = threading.Event()

    def owner() -> None:
        with TierflowClient(stack.target, api_key=CRITICAL) as client:
            for event in client.generate(
                ids(40, seed=5), max_new_tokens=300, request_id="running-1", timeout=120
            ):
                owner_events.append(event)
                owner_started.set()

    thread = threading.Thread(target=owner)
    thread.start()
    assert owner_started.wait(60)
    # Another key of the same tier opens the same id while the owner's request runs, then walks
    # away: that queued and then cancelled a request of its own, not the owner's.
    with TierflowClient(stack.target, api_key=CRITICAL_2) as client:
        stream = client.generate(
            ids(8, seed=6), max_new_tokens=300, request_id="running-1", timeout=60
        )
        first = next(stream)
        stream.close()
    assert first.WhichOneof("event") == "queued" and first.queued.tier == "critical"
    status, events = post_http1(
        stack, BATCH, {"token_ids": {"ids": ids(8, seed=6)}, "request_id": "running-1"}
    )
    assert status == 200 and "queued" in events[0], events
    thread.join(120)
    assert kinds(owner_events)[-1] == "done", kinds(owner_events)
    owner_done = owner_events[-1].done
    assert owner_done.usage.prompt_tokens == 40 and owner_done.usage.completion_tokens == 300
    assert grpc_status(stack, CRITICAL, "running-1").state == serving_pb2.RequestStatus.DONE


def test_a_key_with_surrounding_whitespace_is_the_key_on_every_path(stack):
    for padded in (f" {CRITICAL}", f"{CRITICAL} ", f"  {CRITICAL}  "):
        events = generate(stack, padded, ids(10, seed=8), "", max_new_tokens=1)  # gRPC, h2
        assert kinds(events)[-1] == "done" and events[0].queued.tier == "critical"
        status, events = post_http1(stack, padded, {"text": "hello"})  # JSON over HTTP/1.1
        assert status == 200 and events[0]["queued"]["tier"] == "critical", events
        status, text = curl_http2(stack, padded, "POST", "/v1/generate", {"text": "hello"})
        assert status == 200 and json.loads(text.splitlines()[0])["queued"]["tier"] == "critical"
    # Whitespace inside a key is not stripped: that is another (unknown) key.
    with pytest.raises(grpc.RpcError) as err:
        generate(stack, CRITICAL[:8] + " " + CRITICAL[8:], ids(10, seed=8), "")
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
