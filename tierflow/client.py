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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from tierflow.tiers import API_KEY_HEADER, KEY_ID_HEADER, TIER_HEADER
from tierflow.v1 import serving_pb2, serving_pb2_grpc


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


def _failure(event: serving_pb2.GenerateEvent) -> tuple[grpc.StatusCode, str] | None:
    """(code, message) when ``event`` is the terminal error event."""
    if event.WhichOneof("event") != "error":
        return None
    return status_code(event.error.code), event.error.message


@dataclass(frozen=True)
class Completion:
    """The events of one Generate call, collected."""

    request_id: str
    tier: str
    first_token_text: str
    text: str
    ttft_ms: float
    timings: serving_pb2.Timings
    events: tuple[serving_pb2.GenerateEvent, ...]


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
    api_key: str | None, tier: str | None, key_id: str | None = None
) -> tuple[tuple[str, str], ...]:
    metadata = []
    if api_key is not None:
        metadata.append((API_KEY_HEADER, api_key))
    if tier is not None:
        metadata.append((TIER_HEADER, tier))
    if key_id:
        metadata.append((KEY_ID_HEADER, key_id))
    return tuple(metadata)


class TierflowClient:
    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        tier: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self._channel = (
            grpc.secure_channel(target, credentials)
            if credentials is not None
            else grpc.insecure_channel(target)
        )
        self._stub = serving_pb2_grpc.TierflowStub(self._channel)
        self._metadata = _metadata(api_key, tier)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        timeout: float | None = None,
        **params,
    ) -> Iterator[serving_pb2.GenerateEvent]:
        """Streams the request's events; raises ``grpc.RpcError`` with the status on failure.
        Closing the iterator early cancels the request. ``params``: see ``generate_request``."""
        call = self._stub.Generate(
            generate_request(prompt, **params), metadata=self._metadata, timeout=timeout
        )
        try:
            for event in call:
                failure = _failure(event)
                if failure is not None:
                    raise StreamError(*failure)
                yield event
        finally:
            call.cancel()  # no-op when the stream already ended

    def complete(self, prompt: str | Sequence[int], **kwargs) -> Completion:
        events = tuple(self.generate(prompt, **kwargs))
        by_kind = {e.WhichOneof("event"): e for e in events}
        done = by_kind["done"].done
        # A retried request that had already finished is answered with its Done event alone.
        first = by_kind["first_token"].first_token if "first_token" in by_kind else None
        return Completion(
            request_id=events[0].request_id,
            tier=by_kind["queued"].queued.tier if "queued" in by_kind else "",
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

    def __init__(self, target: str, *, api_key: str | None = None) -> None:
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = serving_pb2_grpc.TierflowStub(self._channel)
        self._api_key = api_key

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        tier: str | None = None,
        key_id: str | None = None,
        timeout: float | None = None,
        **params,
    ) -> EventStream:
        """The Generate call: ``await call.read()`` (or ``async for``) gives its events and
        raises ``grpc.aio.AioRpcError`` with the status on failure; ``call.cancel()`` cancels
        the request. ``tier`` and ``key_id`` are sent as the trusted headers that the edge sets
        (a caller behind the edge: the request is in that key's scope); ``params``: see
        ``generate_request``."""
        call = self._stub.Generate(
            generate_request(prompt, **params),
            metadata=_metadata(self._api_key, tier, key_id),
            timeout=timeout,
        )
        return EventStream(call)

    async def close(self) -> None:
        await self._channel.close()


class EventStream:
    """A Generate call for asyncio: ``read()`` gives the next event or ``grpc.aio.EOF``, and
    raises ``grpc.aio.AioRpcError`` for the status or the terminal error event."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    async def read(self) -> serving_pb2.GenerateEvent | object:
        event = await self._call.read()
        if event is grpc.aio.EOF:
            return event
        failure = _failure(event)
        if failure is not None:
            self._call.cancel()
            code, details = failure
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
        return event

    def cancel(self) -> bool:
        return self._call.cancel()

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> serving_pb2.GenerateEvent:
        event = await self.read()
        if event is grpc.aio.EOF:
            raise StopAsyncIteration
        return event
