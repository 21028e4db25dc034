"""A small client for programs: wraps the generated stub of ``tierflow.v1.Tierflow``.

    with TierflowClient("127.0.0.1:8080", api_key="...") as client:
        for event in client.generate("What is the capital of France?", max_new_tokens=16):
            ...

Through the edge, pass ``api_key`` (sent as ``x-api-key``; the edge derives the tier). Talking
to a queue service directly (tests, a trusted network), pass ``tier`` instead (sent as
``x-tierflow-tier``, which the edge would overwrite). ``AsyncTierflowClient`` is the same for
asyncio programs (the OpenAI-compatible service uses it).

A stream that fails after it started ends with a ``StreamError`` event before its status; both
clients raise it as the status it announces (``StreamError``, ``grpc.aio.AioRpcError``), so the
caller sees one error either way, even when a proxy reset the stream before the status.

Both recover by themselves when the queue service dies, restarts or stops under a stream: once
``Queued`` arrived, a stream that breaks off without a terminal event (or ends UNAVAILABLE) is
reattached with the request id that ``Queued`` carried, for up to ``reattach_s`` seconds and
within the call's timeout, and the caller sees one stream (``tierflow.resume`` has the rules).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import structlog

from tierflow.identity import open_channel, pinned
from tierflow.resume import Resume, StreamError, time_left
from tierflow.tiers import API_KEY_HEADER, KEY_ID_HEADER, KEY_WEIGHT_HEADER, TIER_HEADER
from tierflow.v1 import serving_pb2, serving_pb2_grpc

__all__ = ["AsyncTierflowClient", "Completion", "EventStream", "StreamError", "TierflowClient"]

log = structlog.get_logger("tierflow.client")

REATTACH_S = 60.0  # how long a client keeps reattaching a stream that broke off
# A channel whose service went away redials with a backoff that grows to 120 s by default; a
# reattach wants the service back as soon as it is (a restart takes seconds).
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


@dataclass(frozen=True)
class Completion:
    """The events of one Generate call, collected."""

    request_id: str
    tier: str  # the tier that served it
    first_token_text: str
    text: str
    ttft_ms: float
    timings: serving_pb2.Timings
    events: tuple[serving_pb2.GenerateEvent, ...]
    requested_tier: str = ""  # the tier asked for, when it was served at a lower one


def generate_request(
    prompt: str | Sequence[int],
    *,
    max_new_tokens: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    request_id: str = "",
) -> serving_pb2.GenerateRequest:
    """The GenerateRequest for a text prompt (tokenised by the service) or token ids."""
    request = serving_pb2.GenerateRequest(
        max_new_tokens=max_new_tokens,
        sampling=serving_pb2.SamplingParams(temperature=temperature, top_p=top_p, seed=seed),
        request_id=request_id,
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def _metadata(
    api_key: str | None,
    tier: str | None,
    key_id: str | None = None,
    key_weight: str | None = None,
) -> tuple[tuple[str, str], ...]:
    metadata = []
    if api_key is not None:
        metadata.append((API_KEY_HEADER, api_key))
    if tier is not None:
        metadata.append((TIER_HEADER, tier))
    if key_id:
        metadata.append((KEY_ID_HEADER, key_id))
    if key_weight:
        metadata.append((KEY_WEIGHT_HEADER, key_weight))
    return tuple(metadata)


class TierflowClient:
    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        tier: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        reattach_s: float = REATTACH_S,
    ) -> None:
        self._channel = open_channel(target, credentials, CHANNEL_OPTIONS)
        self._stub = serving_pb2_grpc.TierflowStub(self._channel)
        self._metadata = _metadata(api_key, tier)
        self._reattach_s = reattach_s

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        timeout: float | None = None,
        **params,
    ) -> Iterator[serving_pb2.GenerateEvent]:
        """Streams the request's events; raises ``grpc.RpcError`` with the status on failure.
        Closing the iterator early cancels the request. A stream that broke off after Queued is
        reattached (module docstring). ``params``: see ``generate_request``."""
        resume = Resume(generate_request(prompt, **params), self._reattach_s)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            call = self._stub.Generate(
                resume.request(), metadata=self._metadata, timeout=time_left(deadline)
            )
            try:
                for event in call:
                    event = resume.accept(event)
                    if event is not None:
                        yield event
                return
            except grpc.RpcError as exc:
                if not resume.may_reattach(exc, deadline):
                    raise
                _log_reattach(resume, exc)
            finally:
                call.cancel()  # no-op when the stream already ended
            time.sleep(resume.pause())

    def complete(self, prompt: str | Sequence[int], **kwargs) -> Completion:
        events = tuple(self.generate(prompt, **kwargs))
        by_kind = {e.WhichOneof("event"): e for e in events}
        done = by_kind["done"].done
        # A retried request that had already finished is answered with its Done event alone.
        first = by_kind["first_token"].first_token if "first_token" in by_kind else None
        queued = by_kind["queued"].queued if "queued" in by_kind else serving_pb2.Queued()
        return Completion(
            request_id=events[0].request_id,
            tier=queued.tier,
            requested_tier=queued.requested_tier,
            first_token_text=first.text if first else "",
            text=done.text,
            ttft_ms=first.ttft_ms if first else done.timings.ttft_ms,
            timings=done.timings,
            events=events,
        )

    def status(self, request_id: str, timeout: float = 10.0) -> serving_pb2.RequestStatus:
        return self._stub.GetRequest(
            serving_pb2.GetRequestRequest(request_id=request_id),
            metadata=self._metadata,
            timeout=timeout,
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> TierflowClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncTierflowClient:
    """``TierflowClient.generate`` for asyncio. Create it inside the running loop (a grpc.aio
    channel binds to the loop it was created on)."""

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        reattach_s: float = REATTACH_S,
    ) -> None:
        self._channel = (
            grpc.aio.secure_channel(target, credentials, options=pinned(CHANNEL_OPTIONS))
            if credentials is not None
            else grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        )
        self._stub = serving_pb2_grpc.TierflowStub(self._channel)
        self._api_key = api_key
        self._reattach_s = reattach_s

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        tier: str | None = None,
        key_id: str | None = None,
        key_weight: str | None = None,
        timeout: float | None = None,
        **params,
    ) -> EventStream:
        """The Generate call: ``await call.read()`` (or ``async for``) gives its events and
        raises ``grpc.aio.AioRpcError`` with the status on failure; ``call.cancel()`` cancels
        the request. A stream that broke off after Queued is reattached (module docstring).
        ``tier``, ``key_id`` and ``key_weight`` are sent as the trusted headers that the edge
        sets (a caller behind the edge: the request is in that key's scope); ``params``: see
        ``generate_request``."""
        metadata = _metadata(self._api_key, tier, key_id, key_weight)
        return EventStream(
            lambda request, left: self._stub.Generate(request, metadata=metadata, timeout=left),
            Resume(generate_request(prompt, **params), self._reattach_s),
            None if timeout is None else time.monotonic() + timeout,
        )

    async def close(self) -> None:
        await self._channel.close()


class EventStream:
    """A Generate call for asyncio, across its reattaches: ``read()`` gives the next event or
    ``grpc.aio.EOF``, and raises ``grpc.aio.AioRpcError`` for the status or the terminal error
    event."""

    def __init__(
        self,
        start: Callable[[serving_pb2.GenerateRequest, float | None], grpc.aio.UnaryStreamCall],
        resume: Resume,
        deadline: float | None,
    ) -> None:
        self._start = start
        self._resume = resume
        self._deadline = deadline
        self._cancelled = False
        self._call = start(resume.request(), time_left(deadline))

    async def read(self) -> serving_pb2.GenerateEvent | object:
        while True:
            try:
                event = await self._call.read()
                if event is grpc.aio.EOF:
                    return event
                event = self._resume.accept(event)
                if event is not None:
                    return event
            except grpc.RpcError as exc:
                self._call.cancel()
                if self._cancelled or not self._resume.may_reattach(exc, self._deadline):
                    raise _as_aio_error(exc) from None
                _log_reattach(self._resume, exc)
                await asyncio.sleep(self._resume.pause())
                if self._cancelled:
                    raise asyncio.CancelledError from None
                self._call = self._start(self._resume.request(), time_left(self._deadline))

    def cancel(self) -> bool:
        self._cancelled = True
        return self._call.cancel()

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> serving_pb2.GenerateEvent:
        event = await self.read()
        if event is grpc.aio.EOF:
            raise StopAsyncIteration
        return event


def _as_aio_error(exc: grpc.RpcError) -> grpc.aio.AioRpcError:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc
    return grpc.aio.AioRpcError(exc.code(), grpc.aio.Metadata(), grpc.aio.Metadata(), exc.details())


def _log_reattach(resume: Resume, exc: grpc.RpcError) -> None:
    log.warning(
        "stream broke off; reattaching",
        request_id=resume.request_id,
        code=exc.code().name,
        details=exc.details(),
        attempt=resume.reattached,
    )
