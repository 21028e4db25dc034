"""Nothing inside trusts the network: the queue service over mTLS, with a real broker, a real
queue service process and real worker processes (tiny-llama), each holding a certificate of a
CA of the test run's own (the ``certs`` fixture: what ``tierflow certs`` makes).

What a peer may do follows from the identity in its certificate (``queue_service/trust.py``):
the client API takes the tier and key headers from the edge's identities and the operator only,
and a worker attaches only under the worker id its certificate names.
"""

from __future__ import annotations

import http.client
import shutil
import ssl
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from google.rpc import code_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.demo_keys import DEMO_KEYS
from launch.certs import ensure
from launch.processes import REPO
from tests.integration.processes import (
    operator,
    start_gateway,
    start_openai_api,
    start_queue_service,
    start_worker,
    stop_started,
)
from tierflow.client import TierflowClient
from tierflow.identity import Identity, Role, TlsFiles, client_context, open_channel
from tierflow.tiers import KEY_ID_HEADER, TIER_HEADER
from tierflow.v1 import serving_pb2, serving_pb2_grpc

MODEL = "tiny-llama"
KEYS_FILE = REPO / "config" / "keys.toml"  # the shipped demo keys


@pytest.fixture
def secured(request, tmp_path, kafka_settings, certs):
    """A queue service over mTLS and worker w0 attached with its own certificate; more
    processes may be added to ``started`` (all stopped, logs printed on failure)."""
    qs, target = start_queue_service(tmp_path, kafka_settings, model=MODEL, tls_dir=certs)
    started = [qs]
    started.append(start_worker(tmp_path, target, "w0", model=MODEL, tls_dir=certs))

    class Secured:
        pass

    stack = Secured()
    stack.qs, stack.target, stack.started, stack.tmp = qs, target, started, tmp_path
    yield stack
    stop_started(request, started)


def as_identity(certs: Path, presented: Identity, stem: Identity, tmp: Path) -> Path:
    """A directory in which ``stem``'s files hold ``presented``'s certificate and key: what a
    process that claims to be ``stem`` but holds ``presented``'s certificate loads."""
    directory = tmp / f"as-{presented.file_stem}-for-{stem.file_stem}"
    directory.mkdir()
    shutil.copy(certs / "ca.pem", directory / "ca.pem")
    for suffix in (".pem", ".key"):
        shutil.copy(
            certs / f"{presented.file_stem}{suffix}", directory / f"{stem.file_stem}{suffix}"
        )
    return directory


def test_the_operator_is_served_end_to_end_over_mtls(secured, certs):
    with TierflowClient(secured.target, tier="critical", credentials=operator(certs)) as client:
        done = client.complete([5, 6, 7, 8, 9], max_new_tokens=3, timeout=120)
    assert done.tier == "critical" and done.timings.ttft_ms > 0
    assert secured.qs.wait_for_log("worker attached", worker_id="w0")


def generate_status(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    """The status a Generate call ends with (OK when it completes)."""
    channel = open_channel(target, credentials)
    request = serving_pb2.GenerateRequest(token_ids=serving_pb2.TokenIds(ids=[5, 6, 7]))
    metadata = [(TIER_HEADER, "critical")]
    try:
        with channel:
            list(
                serving_pb2_grpc.TierflowStub(channel).Generate(
                    request, metadata=metadata, timeout=30
                )
            )
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_a_caller_without_a_certificate_of_the_ca_is_refused(secured, certs, tmp_path):
    assert generate_status(secured.target, operator(certs)) is grpc.StatusCode.OK
    # Plaintext; TLS that trusts the CA but presents no certificate of its own; a certificate
    # of another CA (a second `tierflow certs` elsewhere): the handshake fails for each.
    anonymous = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
    other = tmp_path / "other-ca"
    ensure(other, [Identity(Role.OPERATOR)])
    # Trusts our CA (so the server's certificate is fine) but presents the other CA's.
    foreign_files = TlsFiles.load(other, Identity(Role.OPERATOR))
    foreign = grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.pem").read_bytes(),
        private_key=foreign_files.key,
        certificate_chain=foreign_files.cert,
    )
    for credentials in (None, anonymous, foreign):
        assert generate_status(secured.target, credentials) is grpc.StatusCode.UNAVAILABLE


def test_a_direct_call_with_forged_tier_and_key_headers_is_refused(secured, certs):
    """A process of the deployment that is not the edge (here: a worker's certificate) cannot
    name a tier or a key, nor read another tenant's request."""
    forged = [(TIER_HEADER, "critical"), (KEY_ID_HEADER, "demo-critical")]
    credentials = TlsFiles.load(certs, Identity.worker("w1")).channel_credentials()
    with grpc.secure_channel(secured.target, credentials) as channel:
        stub = serving_pb2_grpc.TierflowStub(channel)
        request = serving_pb2.GenerateRequest(
            token_ids=serving_pb2.TokenIds(ids=[5, 6, 7]), request_id="x"
        )
        with pytest.raises(grpc.RpcError) as generate:
            list(stub.Generate(request, metadata=forged, timeout=30))
        with pytest.raises(grpc.RpcError) as status:
            stub.GetRequest(
                serving_pb2.GetRequestRequest(request_id="x"), metadata=forged, timeout=30
            )
    for err in (generate.value, status.value):
        assert err.code() is grpc.StatusCode.PERMISSION_DENIED, err
        assert "worker/w1" in err.details() and "client API" in err.details()


def test_a_worker_without_a_certificate_cannot_attach(secured, certs):
    plain = start_worker(secured.tmp, secured.target, "w-plain", model=MODEL, wait=False)
    secured.started.append(plain)
    plain.wait_for_log("connecting", timeout=120)
    # In the time a worker with its certificate starts and attaches (w1, the control), the
    # plaintext one gets no further than the handshake: it never attaches.
    secured.started.append(
        start_worker(secured.tmp, secured.target, "w1", model=MODEL, tls_dir=certs)
    )
    assert not [e for e in plain.log_events() if e.get("event") == "attached"]
    assert not [e for e in secured.qs.log_events() if e.get("worker_id") == "w-plain"]


def test_a_worker_with_a_certificate_not_issued_as_a_worker_is_refused(secured, certs):
    operator_as_worker = as_identity(
        certs, Identity(Role.OPERATOR), Identity.worker("w9"), secured.tmp
    )
    rogue = start_worker(
        secured.tmp, secured.target, "w9", model=MODEL, tls_dir=operator_as_worker, wait=False
    )
    secured.started.append(rogue)
    broken = rogue.wait_for_log("stream broken", timeout=120)
    assert broken["code"] == "PERMISSION_DENIED" and "not a worker" in broken["details"]
    refused = secured.qs.wait_for_log("attach refused", worker_id="w9")
    assert "operator" in refused["reason"]


def test_a_worker_cannot_take_over_another_workers_id_and_the_first_keeps_its_work(secured, certs):
    # A process holding w1's certificate claims to be w0 while w0 is serving a stream.
    first_token = threading.Event()
    result: dict = {}

    def stream() -> None:
        with TierflowClient(secured.target, tier="standard", credentials=operator(certs)) as c:
            events = []
            for event in c.generate(list(range(5, 60)), max_new_tokens=400, timeout=180):
                events.append(event)
                if event.WhichOneof("event") == "first_token":
                    first_token.set()
            result["events"] = events

    call = threading.Thread(target=stream)
    call.start()
    assert first_token.wait(120)
    impostor_dir = as_identity(certs, Identity.worker("w1"), Identity.worker("w0"), secured.tmp)
    impostor = start_worker(
        secured.tmp, secured.target, "w0", model=MODEL, tls_dir=impostor_dir, wait=False
    )
    secured.started.append(impostor)
    broken = impostor.wait_for_log("stream broken", timeout=120)
    call.join(timeout=180)
    assert broken["code"] == "PERMISSION_DENIED"
    assert "worker/w1" in broken["details"] and "'w0'" in broken["details"]
    # The first w0 kept its session: the stream it was serving ended with done, and the queue
    # service never detached it.
    kinds = [e.WhichOneof("event") for e in result["events"]]
    assert kinds[-1] == "done" and kinds.count("token") >= 1
    events = secured.qs.log_events()
    assert not [e for e in events if e.get("event") == "worker detached"]
    assert [e for e in events if e.get("event") == "attach refused" and e["worker_id"] == "w0"]


def test_only_the_edge_may_ask_the_gateway_about_a_key(request, tmp_path, certs):
    """Under mTLS the gateway answers Envoy only: to anyone else it would say which API keys
    are valid and what tier each buys."""
    gateway, target = start_gateway(tmp_path, keys=KEYS_FILE, tls_dir=certs)
    try:
        check = external_auth_pb2.CheckRequest()
        check.attributes.request.http.headers["x-api-key"] = DEMO_KEYS["critical"]
        answers = {}
        for identity in (Identity(Role.EDGE), Identity(Role.OPERATOR), Identity.worker("w0")):
            credentials = TlsFiles.load(certs, identity).channel_credentials()
            with grpc.secure_channel(target, credentials) as channel:
                stub = external_auth_pb2_grpc.AuthorizationStub(channel)
                try:
                    answers[identity.common_name] = stub.Check(check, timeout=30).status.code
                except grpc.RpcError as err:
                    answers[identity.common_name] = err.code()
    finally:
        stop_started(request, [gateway])
    assert answers == {
        "edge": code_pb2.OK,  # the key is valid
        "operator": grpc.StatusCode.PERMISSION_DENIED,
        "worker/w0": grpc.StatusCode.PERMISSION_DENIED,
    }


def test_a_client_takes_only_the_service_it_means_for_that_service(request, tmp_path, certs):
    """Every service's certificate is of the same CA and names 127.0.0.1: a client meaning
    the queue service must still refuse the gateway's certificate (``open_channel`` pins the
    role), or whoever runs the gateway could pose as the queue service."""
    gateway, target = start_gateway(tmp_path, keys=KEYS_FILE, tls_dir=certs)
    answers = {}
    try:
        for meant in (Role.GATEWAY, Role.QUEUE_SERVICE):
            with open_channel(target, operator(certs), server=meant) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                try:
                    answers[meant] = stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status
                except grpc.RpcError as err:
                    answers[meant] = err.code()
    finally:
        stop_started(request, [gateway])
    assert answers == {
        Role.GATEWAY: health_pb2.HealthCheckResponse.SERVING,
        Role.QUEUE_SERVICE: grpc.StatusCode.UNAVAILABLE,  # the handshake failed
    }


def health_status(url: str, context: ssl.SSLContext | None) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=10, context=context) as reply:
            return reply.status
    except (OSError, http.client.HTTPException) as err:  # the handshake or the connection
        return type(err).__name__


def test_only_the_edge_may_call_the_openai_service(secured, certs):
    """uvicorn does not show the app its peer's certificate, so the handshake itself accepts the
    edge's certificate and no other: not the operator's, not a worker's, not plaintext."""
    proc, target = start_openai_api(secured.tmp, secured.target, model=MODEL, tls_dir=certs)
    secured.started.append(proc)
    url = f"https://{target}/health"
    assert health_status(url, client_context(certs, Identity(Role.EDGE))) == 200
    for other in (Identity(Role.OPERATOR), Identity.worker("w0"), Identity(Role.OPENAI_API)):
        assert health_status(url, client_context(certs, other)) != 200, other
    assert health_status(f"http://{target}/health", None) != 200
