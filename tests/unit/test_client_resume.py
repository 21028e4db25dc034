"""The client's rules for a stream that broke off (``tierflow.resume``), on their own. The
integration test (tests/integration/test_recovery.py) kills a real queue service under them."""

from __future__ import annotations

import grpc
import pytest

from tierflow.resume import Resume, StreamError
from tierflow.v1 import serving_pb2

Event = serving_pb2.GenerateEvent


class Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "test"


def queued(request_id: str = "r1") -> Event:
    return Event(request_id=request_id, queued=serving_pb2.Queued(tier="critical"))


def first(token_id: int) -> Event:
    return Event(request_id="r1", first_token=serving_pb2.FirstToken(token_id=token_id))


def token(token_id: int) -> Event:
    return Event(request_id="r1", token=serving_pb2.Token(token_id=token_id))


def error(code: grpc.StatusCode) -> Event:
    return Event(request_id="r1", error=serving_pb2.StreamError(code=code.value[0], message="m"))


def test_a_reattached_stream_gives_each_token_once_and_queued_once():
    resume = Resume(serving_pb2.GenerateRequest(text="hi"), reattach_s=60)
    assert resume.request().request_id == ""  # the service assigns it...
    seen = [resume.accept(e) for e in (queued("assigned-1"), first(7), token(8))]
    assert all(e is not None for e in seen)
    assert resume.request().request_id == "assigned-1"  # ...and a reattach sends it back
    # The request restarted from scratch on a restarted service: it streams everything again.
    again = [resume.accept(e) for e in (queued("assigned-1"), first(7), token(8), token(9))]
    assert [e and e.WhichOneof("event") for e in again] == [None, None, None, "token"]
    assert again[-1].token.token_id == 9 and resume.delivered == 3


def test_a_terminal_error_event_is_raised_as_its_status():
    resume = Resume(serving_pb2.GenerateRequest(text="hi"), reattach_s=60)
    resume.accept(queued())
    with pytest.raises(StreamError) as err:
        resume.accept(error(grpc.StatusCode.DEADLINE_EXCEEDED))
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED and err.value.details() == "m"
    assert not resume.may_reattach(err.value, None)  # the service's answer: final


def test_only_a_lost_connection_after_queued_is_reattached():
    resume = Resume(serving_pb2.GenerateRequest(text="hi"), reattach_s=60)
    lost = Status(grpc.StatusCode.INTERNAL)  # Envoy's RST_STREAM when the upstream died
    assert not resume.may_reattach(lost, None)  # before Queued: nothing is known to be durable
    resume.accept(queued())
    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
        assert resume.may_reattach(Status(code), None), code
    for code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
        assert not resume.may_reattach(Status(code), None), code
    # A stopping service says UNAVAILABLE in its terminal event: reattach; any other: final.
    assert resume.may_reattach(StreamError(grpc.StatusCode.UNAVAILABLE, "stopping"), None)
    assert not resume.may_reattach(StreamError(grpc.StatusCode.INTERNAL, "worker failed"), None)


def test_reattaching_stops_after_reattach_s_or_at_the_deadline(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("tierflow.resume.time.monotonic", lambda: now[0])
    resume = Resume(serving_pb2.GenerateRequest(text="hi"), reattach_s=10)
    resume.accept(queued())
    lost = Status(grpc.StatusCode.UNAVAILABLE)
    assert resume.may_reattach(lost, None)
    now[0] = 109.0
    assert resume.may_reattach(lost, None)
    now[0] = 110.5
    assert not resume.may_reattach(lost, None)  # 10 s since the loss without an event
    resume.accept(first(1))  # an event: the next loss has its own 10 s
    assert resume.may_reattach(lost, None)
    assert not resume.may_reattach(lost, deadline=now[0])  # the caller's timeout is up
    assert [resume.pause() for _ in range(6)] == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
