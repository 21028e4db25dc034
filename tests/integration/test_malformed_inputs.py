"""Malformed inputs, each with its exact status, against the real stack (Envoy, the gateway, the
queue service, Kafka, a tiny-llama worker): through Envoy as gRPC and as JSON over HTTP/1.1,
and straight to the queue service. A table of hand-picked cases, then field values generated
with ``hypothesis`` (derandomized: the same examples on every run, so never flaky). Afterwards
the service is healthy: SERVING, no unhandled exception in its log, and requests still answered.

Nothing here reaches a worker: every case is refused at the edge or at admission, so the table
runs in seconds.
"""

from __future__ import annotations

import http.client
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.demo_keys import DEMO_KEYS
from queue_service.clients.admission import MAX_REQUEST_ID_LEN
from queue_service.config import QueueServiceConfig
from tests.integration.test_edge import edge_stack, kinds
from tierflow.catalogue import load_model_info
from tierflow.client import TierflowClient
from tierflow.v1 import serving_pb2

MODEL = "tiny-llama"
INFO = load_model_info(MODEL)
VOCAB, CONTEXT = INFO.vocab_size, INFO.max_positions
MAX_NEW = QueueServiceConfig.max_new_tokens
KEY = DEMO_KEYS["standard"]
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXAMPLES = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, kafka):
    with edge_stack(
        tmp_path_factory.mktemp("malformed"), kafka, model=MODEL, chunk_size=64
    ) as stack:
        yield stack


# ---------------------------------------------------------------- ways to send


def direct_target(stack) -> str:
    return stack.queue_service.args[stack.queue_service.args.index("--listen") + 1]


def grpc_raw(channel: grpc.Channel, method: str, body: bytes, metadata, timeout: float = 30):
    """The status of one call whose request is ``body`` as it is (no client-side encoding)."""
    with channel:
        path = f"/tierflow.v1.Tierflow/{method}"
        try:
            if method == "Generate":
                call = channel.unary_stream(path)(body, metadata=metadata, timeout=timeout)
                for _ in call:
                    pass
            else:
                channel.unary_unary(path)(body, metadata=metadata, timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code()
    return OK


def message(**fields) -> bytes:
    return serving_pb2.GenerateRequest(**fields).SerializeToString()


def text_field(raw: bytes) -> bytes:
    """A GenerateRequest whose ``text`` (field 1, length-delimited) is ``raw``, valid UTF-8 or
    not: what a client with its own encoder can put on the wire."""
    return b"\x0a" + _varint(len(raw)) + raw + message(max_new_tokens=1)


def request_id_field(raw: bytes) -> bytes:
    return message(text="hi") + b"\x2a" + _varint(len(raw)) + raw  # field 5


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def json_status(stack, method: str, path: str, body: bytes | None, key: str | None = KEY) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
    try:
        headers = {"content-type": "application/json"} | ({"x-api-key": key} if key else {})
        conn.request(method, path, body=body, headers=headers)
        reply = conn.getresponse()
        reply.read()
        return reply.status
    finally:
        conn.close()


def to_queue(stack, body: bytes, *, tier: str | None = "critical", extra=(), method="Generate"):
    metadata = ([("x-tierflow-tier", tier)] if tier else []) + list(extra)
    return grpc_raw(stack.direct_channel(), method, body, metadata)


def via_envoy(stack, body: bytes, *, key: str | None = KEY, method="Generate"):
    return grpc_raw(
        grpc.insecure_channel(stack.target), method, body, [("x-api-key", key)] if key else []
    )


def json_body(value) -> bytes:
    return json.dumps(value).encode()


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class Case:
    name: str
    send: Callable
    expected: grpc.StatusCode | int


BAD_UTF8 = b"caf\xc3 \xff\xfe"
CASES = [
    # Straight to the queue service (the tier header is trusted there).
    Case("q: blank text", lambda s: to_queue(s, message(text="   ")), INVALID),
    Case("q: no prompt", lambda s: to_queue(s, message(max_new_tokens=1)), INVALID),
    Case("q: empty token ids", lambda s: to_queue(s, message(token_ids={})), INVALID),
    Case(
        "q: token id = vocab", lambda s: to_queue(s, message(token_ids={"ids": [VOCAB]})), INVALID
    ),
    Case(
        "q: prompt over the context",
        lambda s: to_queue(s, message(token_ids={"ids": [7] * CONTEXT})),
        INVALID,
    ),
    Case(
        "q: max_new_tokens 0", lambda s: to_queue(s, message(text="hi", max_new_tokens=0)), INVALID
    ),
    Case(
        "q: max_new_tokens -1",
        lambda s: to_queue(s, message(text="hi", max_new_tokens=-1)),
        INVALID,
    ),
    Case(
        "q: max_new_tokens over the limit",
        lambda s: to_queue(s, message(text="hi", max_new_tokens=MAX_NEW + 1)),
        INVALID,
    ),
    Case(
        "q: temperature NaN",
        lambda s: to_queue(s, message(text="hi", sampling={"temperature": math.nan})),
        INVALID,
    ),
    Case(
        "q: temperature -inf",
        lambda s: to_queue(s, message(text="hi", sampling={"temperature": -math.inf})),
        INVALID,
    ),
    Case(
        "q: top_p 1.5", lambda s: to_queue(s, message(text="hi", sampling={"top_p": 1.5})), INVALID
    ),
    Case(
        "q: timeout_ms over an hour",
        lambda s: to_queue(s, message(text="hi", timeout_ms=3_600_001)),
        INVALID,
    ),
    Case(
        "q: request_id too long",
        lambda s: to_queue(s, message(text="hi", request_id="x" * (MAX_REQUEST_ID_LEN + 1))),
        INVALID,
    ),
    Case(
        "q: request_id with the scope separator (it could name another key's request)",
        lambda s: to_queue(s, message(text="hi", request_id="demo-critical/x")),
        INVALID,
    ),
    Case(
        "q: request_id with a newline",
        lambda s: to_queue(s, message(text="hi", request_id="a\nb")),
        INVALID,
    ),
    Case("q: invalid UTF-8 text", lambda s: to_queue(s, text_field(BAD_UTF8)), INVALID),
    Case(
        "q: invalid UTF-8 request_id", lambda s: to_queue(s, request_id_field(b"\xc0\xaf")), INVALID
    ),
    Case("q: truncated message", lambda s: to_queue(s, message(text="hello")[:-2]), INVALID),
    Case("q: garbage bytes", lambda s: to_queue(s, b"\xff\xff\xff\xff\x0f"), INVALID),
    Case(
        "q: GetRequest invalid UTF-8",
        lambda s: to_queue(s, b"\x0a\x02\xff\xfe", method="GetRequest"),
        INVALID,
    ),
    Case(
        "q: GetRequest unknown id",
        lambda s: to_queue(s, b"\x0a\x03abc", method="GetRequest"),
        grpc.StatusCode.NOT_FOUND,
    ),
    Case(
        "q: no tier header",
        lambda s: to_queue(s, message(text="hi"), tier=None),
        grpc.StatusCode.UNAUTHENTICATED,
    ),
    Case("q: unknown tier", lambda s: to_queue(s, message(text="hi"), tier="gold"), INVALID),
    Case(
        "q: tier header twice",
        lambda s: to_queue(s, message(text="hi"), extra=[("x-tierflow-tier", "batch")]),
        INVALID,
    ),
    Case(
        "q: key id with a slash",
        lambda s: to_queue(s, message(text="hi"), extra=[("x-tierflow-key-id", "a/b")]),
        INVALID,
    ),
    # Through Envoy, gRPC.
    Case("edge: invalid UTF-8 text", lambda s: via_envoy(s, text_field(BAD_UTF8)), INVALID),
    Case("edge: garbage bytes", lambda s: via_envoy(s, b"\x08\x80\x80\x80"), INVALID),
    Case("edge: blank text", lambda s: via_envoy(s, message(text=" \n\t ")), INVALID),
    Case(
        "edge: temperature 1e9",
        lambda s: via_envoy(s, message(text="hi", sampling={"temperature": 1e9})),
        INVALID,
    ),
    Case(
        "edge: no key",
        lambda s: via_envoy(s, message(text="hi"), key=None),
        grpc.StatusCode.UNAUTHENTICATED,
    ),
    Case(
        "edge: unknown key",
        lambda s: via_envoy(s, message(text="hi"), key="tf-not-a-key-0123456789"),
        grpc.StatusCode.UNAUTHENTICATED,
    ),
    Case(
        "edge: unknown method",
        lambda s: via_envoy(s, b"", method="Nope"),
        grpc.StatusCode.UNIMPLEMENTED,
    ),
    # Through Envoy, JSON over HTTP/1.1: the transcoder's answers and the service's statuses
    # as HTTP statuses.
    Case("json: not JSON", lambda s: json_status(s, "POST", "/v1/generate", b"{text: hi"), 400),
    Case(
        "json: invalid UTF-8",
        lambda s: json_status(s, "POST", "/v1/generate", b'{"text": "caf\xc3 \xff"}'),
        400,
    ),
    Case(
        "json: wrong type",
        lambda s: json_status(
            s, "POST", "/v1/generate", json_body({"text": "hi", "max_new_tokens": "many"})
        ),
        400,
    ),
    Case(
        # Not refused: the proto3 JSON mapping drops unknown fields and Envoy's transcoder has no
        # option to refuse them. A "tier" in the body is such a field: it changes nothing.
        "json: unknown field, ignored",
        lambda s: json_status(s, "POST", "/v1/generate", json_body({"text": "hi", "tier": "x"})),
        200,
    ),
    Case(
        "json: negative token id",
        lambda s: json_status(s, "POST", "/v1/generate", json_body({"token_ids": {"ids": [-1]}})),
        400,
    ),
    Case("json: empty object", lambda s: json_status(s, "POST", "/v1/generate", b"{}"), 400),
    Case(
        "json: temperature NaN",
        lambda s: json_status(
            s, "POST", "/v1/generate", json_body({"text": "hi", "sampling": {"temperature": "NaN"}})
        ),
        400,
    ),
    Case(
        "json: max_new_tokens 0",
        lambda s: json_status(
            s, "POST", "/v1/generate", json_body({"text": "hi", "max_new_tokens": 0})
        ),
        400,
    ),
    Case("json: unknown request", lambda s: json_status(s, "GET", "/v1/requests/nope", None), 404),
    Case(
        "json: no key",
        lambda s: json_status(s, "POST", "/v1/generate", b'{"text":"hi"}', None),
        401,
    ),
    Case("json: unknown path", lambda s: json_status(s, "POST", "/v1/nothing", b"{}"), 404),
]


def test_each_malformed_input_gets_its_exact_status(stack):
    assert len(CASES) >= 30
    got = {case.name: case.send(stack) for case in CASES}
    assert got == {case.name: case.expected for case in CASES}


# ---------------------------------------------------------------- generated values


NOT_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
NEGATIVE = st.floats(max_value=-(2.0**-20), width=32)


@EXAMPLES
@given(st.floats(min_value=100, exclude_min=True, width=32) | NEGATIVE | NOT_FINITE)
def test_generated_temperatures_out_of_range_are_invalid_argument(stack, temperature):
    body = message(text="hi", sampling={"temperature": temperature})
    assert to_queue(stack, body) is INVALID


@EXAMPLES
@given(st.floats(min_value=1, exclude_min=True, width=32) | NEGATIVE | NOT_FINITE)
def test_generated_top_p_out_of_range_is_invalid_argument(stack, top_p):
    assert via_envoy(stack, message(text="hi", sampling={"top_p": top_p})) is INVALID


@EXAMPLES
@given(st.integers(min_value=-(2**31), max_value=0) | st.integers(MAX_NEW + 1, 2**31 - 1))
def test_generated_max_new_tokens_out_of_range_are_invalid_argument(stack, max_new_tokens):
    assert to_queue(stack, message(text="hi", max_new_tokens=max_new_tokens)) is INVALID


@EXAMPLES
@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=20))
def test_generated_token_ids_outside_the_vocabulary_are_invalid_argument(stack, ids):
    ids = [*ids, VOCAB + ids[0] % (2**32 - VOCAB)]  # at least one outside
    assert to_queue(stack, message(token_ids={"ids": ids})) is INVALID


@EXAMPLES
@given(st.binary(min_size=1, max_size=64).filter(lambda b: not _is_utf8(b)))
def test_generated_invalid_utf8_is_invalid_argument_direct_and_through_envoy(stack, raw):
    assert to_queue(stack, text_field(raw)) is INVALID
    assert via_envoy(stack, request_id_field(raw)) is INVALID


@EXAMPLES
@given(
    st.text(max_size=20),
    st.characters(categories=["Cc", "Cf", "Zl", "Zp", "Co"]),
    st.text(max_size=20),
)
def test_generated_request_ids_with_unprintable_characters_are_invalid_argument(
    stack, before, bad, after
):
    request_id = before + bad + after
    assert not request_id.isprintable()
    assert to_queue(stack, message(text="hi", request_id=request_id)) is INVALID


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# ---------------------------------------------------------------- and then


def test_the_service_is_healthy_after_all_of_them(stack):
    # Run last in this module (pytest keeps file order): after the table and the generated cases.
    with stack.direct_channel() as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="tierflow.v1.Tierflow"), timeout=10
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with TierflowClient(stack.target, api_key=KEY) as client:
        events = list(client.generate("still there?", max_new_tokens=2, timeout=120))
    assert kinds(events)[0] == "queued" and kinds(events)[-1] == "done"
    direct = direct_target(stack)
    with TierflowClient(direct, tier="batch", credentials=stack.operator()) as client:
        assert client.complete([5, 6, 7], max_new_tokens=1, timeout=120).text is not None
    assert json_status(stack, "POST", "/v1/generate", json_body({"text": "hi"})) == 200
    assert stack.queue_service.alive() and stack.worker.alive()
    log = stack.queue_service.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "Exception calling application" not in log
