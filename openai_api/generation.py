"""One request's life on the queue service, as an OpenAI response needs it: refused (an
``OpenAIError``) or started, then the completion's text piece by piece, then why it ended and
the token counts.

A streamed response starts (HTTP 200) only once the request is running on a worker (its first
prefill progress or token): until then the scheduler may still refuse it (a shed batch
request), and that must reach the client as a status (429), not as an event inside a 200.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from openai_api.errors import OpenAIError, from_grpc
from openai_api.stops import StopScanner
from tierflow.v1 import serving_pb2

_CONTENT = ("first_token", "token", "done")


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
        self.tier = ""
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
                self._prompt_tokens = event.queued.prompt_tokens
                continue
            if kind in _CONTENT:
                self._first = event
            self._started = True
            return

    async def pieces(self) -> AsyncIterator[str]:
        """The completion's text as it is generated, until it is done or hits a stop string."""
        await self.start()
        event, self._first = self._first, None
        while self.finish_reason is None:
            if event is None:
                event = await self._read()
                if event is None:
                    raise OpenAIError(502, "the queue service ended the request before Done")
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
            raise from_grpc(exc.code(), exc.details(), retry_after_s=self._retry_after_s) from None
        return None if event is grpc.aio.EOF else event
