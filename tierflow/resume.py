"""Where a Generate stream stands, so that a client can reattach when it broke off.

The rules a client follows (docs/api.md, "When the queue service dies"), here for
``tierflow.client``:

- Once ``Queued`` arrived, the request is durable in Kafka: a queue service that dies, restarts
  or stops does not lose it (another instance or the restarted one runs it).
- A stream ends with a terminal event: ``done``, or ``error`` (code and message, then the same
  gRPC status). An ``error`` is the service's answer, except UNAVAILABLE, which a stopping
  service sends to say "reattach".
- A stream that breaks off after ``Queued`` without a terminal event (UNAVAILABLE, INTERNAL
  "RST_STREAM" from a proxy, a closed connection) lost its connection, not its request.
- To reattach, send the same request again with the ``request_id`` that ``Queued`` carried: the
  service joins the live request, answers ``Done`` again if it finished, or queues it again
  (duplicates are recognised by id and never run twice). Every stream of a request starts with
  its tokens from the first (those produced while no client listened too), and a request that
  restarted from scratch streams them again; the tokens the caller already had are skipped here.
"""

from __future__ import annotations

import time

import grpc

from tierflow.v1 import serving_pb2

# Statuses of a stream that broke off without a terminal event: the connection was lost (a
# proxy reset the stream, the service died), the request was not refused.
LOST_CONNECTION = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
)
_CONTENT = ("first_token", "token")
MAX_PAUSE_S = 2.0


class StreamError(grpc.RpcError):
    """A stream's terminal ``error`` event, raised like the gRPC status it announces."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def status_code(value: int) -> grpc.StatusCode:
    """The grpc.StatusCode of a numeric code (``StreamError.code`` of the event)."""
    return next((c for c in grpc.StatusCode if c.value[0] == value), grpc.StatusCode.UNKNOWN)


class Resume:
    """One request's stream across the calls that carry it (the first, then each reattach).

    ``request()`` gives the request for the next call; ``accept(event)`` filters its events
    (raises ``StreamError`` for a terminal error, returns None for one the caller already had);
    ``may_reattach(exc, deadline)`` says whether a failed call is worth another one, within
    ``reattach_s`` of the loss and before the call's deadline; ``pause()`` how long to wait.
    """

    def __init__(self, request: serving_pb2.GenerateRequest, reattach_s: float) -> None:
        self._request = request
        self.reattach_s = reattach_s
        self.request_id = request.request_id
        self.queued = False  # Queued arrived: the request is durable
        self.delivered = 0  # tokens (first_token, token) the caller has had
        self.reattached = 0
        self._replayed = 0  # tokens of the current call
        self._lost_since: float | None = None
        self._pauses = 0

    def request(self) -> serving_pb2.GenerateRequest:
        self._request.request_id = self.request_id
        self._replayed = 0
        return self._request

    def accept(self, event: serving_pb2.GenerateEvent) -> serving_pb2.GenerateEvent | None:
        self._lost_since, self._pauses = None, 0
        kind = event.WhichOneof("event")
        if kind == "error":
            raise StreamError(status_code(event.error.code), event.error.message)
        if kind == "queued":
            if self.queued:
                return None  # a reattach queued it again: the caller knows it is queued
            self.queued, self.request_id = True, event.request_id
        elif kind in _CONTENT:
            self._replayed += 1
            if self._replayed <= self.delivered:
                return None  # the request restarted from scratch: this one was delivered
            self.delivered += 1
        return event

    def may_reattach(self, exc: grpc.RpcError, deadline: float | None) -> bool:
        if not self.queued:
            return False  # refused, or never durable: the status is the answer
        code = exc.code()
        said_so = isinstance(exc, StreamError) and code is grpc.StatusCode.UNAVAILABLE
        if not said_so and (isinstance(exc, StreamError) or code not in LOST_CONNECTION):
            return False
        now = time.monotonic()
        if self._lost_since is None:
            self._lost_since = now
        if now - self._lost_since >= self.reattach_s or (deadline is not None and now >= deadline):
            return False
        self.reattached += 1
        return True

    def pause(self) -> float:
        delay = min(MAX_PAUSE_S, 0.25 * 2**self._pauses)
        self._pauses += 1
        return delay


def time_left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
