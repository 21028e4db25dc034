"""One request's life on the queue service, as an OpenAI response needs it: refused (an
``OpenAIError``) or started, then the completion's text piece by piece, then why it ended and
the token counts.

A streamed response starts (HTTP 200) once the request is running on a worker (its first
prefill progress or token), or once it has waited in its queue for the queue service's
heartbeat interval (``StillWaiting``), whichever comes first. Until then the scheduler may
still refuse it (a shed batch request), and that reaches the client as a status (429), not as
an event inside a 200; a request that waits longer than that must not be cut by a proxy's idle
timeout, so its stream starts and carries a keep-alive (an SSE comment) per heartbeat.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from openai_api.errors import OpenAIError, from_grpc
from openai_api.stops import StopScanner
from tierflow.v1 import serving_pb2

_CONTENT = ("first_token", "token", "done")
# A piece of ``pieces()`` that says only "still waiting": a stream sends a keep-alive for it.
KEEP_ALIVE = ""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


class Generation:
    """Reads a ``Tierflow/Generate`` call. ``close()`` cancels it (and so the request) unless
    it already ended."""

    def __init__(
        self, call: grpc.aio.UnaryStreamCall, stops: tuple[str, ...], *, retry_after_s: int
    ) -> None:
        self._call = call
        self._scanner = StopScanner(stops)
        self._retry_after_s = retry_after_s
        self._started = False
        self._first: serving_pb2.GenerateEvent | None = None  # read by start(), not yet used
        self.tier = ""  # the tier that serves it (Queued.tier)
        self.requested_tier = ""  # the tier asked for, when it is served at a lower one
        self.finish_reason: str | None = None
        self._prompt_tokens = 0
        self._completion_tokens = 0
        self._usage: Usage | None = None  # from Done
        self._full_text: str | None = None  # from Done

    async def start(self) -> None:
        """Returns once the request runs; raises OpenAIError if it was refused or failed."""
        if self._started:
            return
        while True:
            event = await self._read()
            if event is None:
                raise OpenAIError(502, "the queue service ended the request without an answer")
            kind = event.WhichOneof("event")
            if kind == "queued":
                self.tier = event.queued.tier
                self.requested_tier = event.queued.requested_tier
                self._prompt_tokens = event.queued.prompt_tokens
                continue
            if kind in _CONTENT or kind == "still_waiting":
                self._first = event
            self._started = True
            return

    async def pieces(self) -> AsyncIterator[str]:
        """The completion's text as it is generated, until it is done or hits a stop string;
        ``KEEP_ALIVE`` for each heartbeat of a request that still waits."""
        await self.start()
        event, self._first = self._first, None
        while self.finish_reason is None:
            if event is None:
                event = await self._read()
                if event is None:
                    raise OpenAIError(502, "the queue service ended the request before Done")
            if event.WhichOneof("event") == "still_waiting":
                yield KEEP_ALIVE
                event = None
                continue
            piece = self._apply(event)
            event = None
            if piece:
                yield piece

    async def text(self) -> str:
        """The whole completion."""
        pieces = [piece async for piece in self.pieces()]
        # Done's text is decoded in one go (no per-token decoding seams); with stop strings the
        # pieces are what was checked against them.
        return self._full_text if self._full_text is not None else "".join(pieces)

    @property
    def usage(self) -> Usage:
        return self._usage or Usage(self._prompt_tokens, self._completion_tokens)

    def close(self) -> None:
        self._call.cancel()  # no-op once the call ended

    def _apply(self, event: serving_pb2.GenerateEvent) -> str:
        kind = event.WhichOneof("event")
        if kind == "first_token" or kind == "token":
            self._completion_tokens += 1
            piece = self._scanner.feed(getattr(event, kind).text)
            if self._scanner.hit:
                self.finish_reason = "stop"
                self.close()  # the rest is not wanted: free the worker now
            return piece
        if kind == "done":
            done = event.done
            self.finish_reason = done.finish_reason or "length"
            self._usage = Usage(done.usage.prompt_tokens, done.usage.completion_tokens)
            self._full_text = done.text if not self._scanner.stops else None
            return self._scanner.flush()
        return ""  # progress (and a queued event of a rejoined request): nothing to say

    async def _read(self) -> serving_pb2.GenerateEvent | None:
        try:
            event = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            # The queue service's own retry-after (a tier at capacity) wins over the default.
            trailers = exc.trailing_metadata() or ()
            told = next((str(v) for k, v in trailers if k == "retry-after"), "")
            retry_after_s = int(told) if told.isdigit() else self._retry_after_s
            raise from_grpc(exc.code(), exc.details(), retry_after_s=retry_after_s) from None
        return None if event is grpc.aio.EOF else event
