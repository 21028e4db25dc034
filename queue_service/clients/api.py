"""The client API servicer (``tierflow.v1.Tierflow``): admission, Kafka, then the event stream.

Generate: read the tier from the edge's header, validate and tokenise, place it against its
tier's capacity (``queue_service/core/capacity_board.py``: served at its tier, at the next tier
down, or refused with RESOURCE_EXHAUSTED and ``retry-after``), register the client's stream,
write the request to its served tier's Kafka topic and wait for the broker's acknowledgement,
then answer ``Queued`` (the tier that serves it, and the one asked for when they differ) and
relay the request's events until ``Done`` or an error. The request
reaches the scheduler when the priority consumer reads it back from Kafka, so what the client
was told is queued is durable. A client that cancels, disconnects or runs out of time cancels
its request: a running prefill stops at the next layer boundary.

Once ``Queued`` was sent, every stream ends with a terminal event: ``Done``, or a
``StreamError`` (code and message) followed by the same gRPC status. Envoy's transcoder writes
that event as a JSON line, so a JSON client over HTTP/1.1, which never sees trailers, learns
how its stream ended. Before ``Queued`` a refusal is the status alone (an HTTP status for JSON).

Deadlines: the call ends ``deadline_margin_s`` before the gRPC deadline it was given (at most
a quarter of it), so that its terminal event and status reach the client before the edge's
timer for the same deadline (Envoy enforces the client's grpc-timeout too, and resets a stream
it times out, which a client sees as INTERNAL).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import structlog

from queue_service.clients.admission import (
    AdmissionError,
    AdmissionLimits,
    admit,
    check_request_id,
    key_id_from_metadata,
    key_weight_from_metadata,
    request_digest,
    scoped_request_id,
    tier_from_metadata,
)
from queue_service.clients.wire import Unparsable
from queue_service.core.capacity_board import CapacityBoard
from queue_service.core.live import LiveRequest, Outcome
from queue_service.core.service_core import ClientError, ClientItem, ServiceCore
from queue_service.trust import PLAINTEXT, Trust
from tierflow.tiers import TierTable
from tierflow.v1 import queue_pb2, serving_pb2, serving_pb2_grpc

log = structlog.get_logger("queue_service.clients.api")


class ClientApi(serving_pb2_grpc.TierflowServicer):
    def __init__(
        self,
        core: ServiceCore,
        tiers: TierTable,
        limits: AdmissionLimits,
        *,
        publish: Callable[[queue_pb2.QueuedRequest], None],
        board: CapacityBoard,
        tokenize: Callable[[str], list[int]],
        vocab_size: int,
        deadline_margin_s: float = 0.5,
        heartbeat_s: float = 10.0,
        deployment: str = "",
        refused: Callable[[queue_pb2.QueuedRequest], None] = lambda record: None,
        unjudged: Callable[[str, str], None] = lambda tier, reason: None,
        trust: Trust = PLAINTEXT,
    ) -> None:
        self.trust = trust
        self.core = core
        self.tiers = tiers
        self.limits = limits
        self.publish = publish  # blocking until the broker acknowledged (acks=all)
        self.board = board
        self.tokenize = tokenize
        self.vocab_size = vocab_size
        self.deadline_margin_s = deadline_margin_s
        self.heartbeat_s = heartbeat_s
        # The request log's record of a request refused for load before it was queued.
        self.refused = refused
        # (tier, reason): a tier with an overflow rule admitted a request without judging it.
        self.unjudged = unjudged
        self.deployment = deployment

    async def Generate(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateEvent]:
        await self._authorize(context)
        if isinstance(request, Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        intake = await self._admit(request, context)
        client_id, request_id = intake.client_id, intake.record.request_id
        known = await self._known_request(intake, context)
        if known is not None and known.outcome is Outcome.DONE:
            # Idempotent retry of a finished request: its tokens and its result again.
            for event in self.core.tokens_so_far(known, client_id):
                yield event
            yield self._done_again(known, client_id)
            return
        queue = self.core.open_client(request_id)
        # Taken with the queue opened and no await in between: every token is in exactly one.
        joined = [] if known is None else self.core.tokens_so_far(known, client_id)
        finished = False
        try:
            if known is None:  # a new request: durable in Kafka before we say Queued
                yield await self._enqueue(intake, context)
            else:
                log.info("client joined a live request", request_id=request_id)
            for event in joined:  # the tokens it produced before this client joined
                yield event
            queued_at = time.monotonic()
            deadline = None if intake.timeout_s is None else queued_at + intake.timeout_s
            while True:
                item = await self._next_item(queue, deadline, self.heartbeat_s)
                if item is HEARTBEAT:
                    waited_ms = int((time.monotonic() - queued_at) * 1000)
                    yield serving_pb2.GenerateEvent(
                        request_id=client_id,
                        still_waiting=serving_pb2.StillWaiting(waited_ms=waited_ms),
                    )
                    continue
                if item is None or isinstance(item, ClientError):
                    # The service ended it (failed, rejected, stopping): the request is done with
                    # here. Its deadline passed: the finally clause cancels it.
                    finished = item is not None
                    error = item or ClientError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"request {client_id} did not finish within its deadline",
                    )
                    yield error_event(client_id, error)
                    await context.abort(error.code, error.message)
                item.request_id = client_id  # the service's name is scoped to the key
                yield item
                if item.WhichOneof("event") == "done":
                    finished = True
                    return
        finally:
            # Reached on done, on error, and when the client cancels or disconnects (the
            # generator is closed): in the last cases the request is cancelled too.
            if finished:
                self.core.close_client(request_id)
            else:
                self.core.client_gone(request_id)

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        """The call ends with PERMISSION_DENIED unless the peer's identity may call the client
        API: the tier and key headers are taken only from the edge (``queue_service/trust``)."""
        refusal = self.trust.refuses_client(context)
        if refusal is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)

    async def _admit(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> Intake:
        """The validated and tokenised request, as it would be queued; or the call ends with
        the status that says why not."""
        metadata = context.invocation_metadata() or ()
        try:
            tier = tier_from_metadata(metadata, self.tiers)
            key_id = key_id_from_metadata(metadata)
            key_weight = key_weight_from_metadata(metadata)
            admitted = admit(request, tier, self.limits, self.tokenize, self.vocab_size)
        except AdmissionError as exc:
            await context.abort(exc.code, exc.message)
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline already passed")
        if remaining is not None:  # end before the edge's timer for the same deadline
            remaining -= min(self.deadline_margin_s, remaining / 4)
        timeout_s = _earliest(remaining, admitted.timeout_ms / 1000 or None)
        now = time.time()
        record = queue_pb2.QueuedRequest(
            request_id=scoped_request_id(key_id, admitted.request_id),
            tier=tier,
            prompt_ids=admitted.prompt_ids,
            max_new_tokens=admitted.max_new_tokens,
            sampling=serving_pb2.SamplingParams(
                temperature=admitted.temperature, top_p=admitted.top_p, seed=admitted.seed
            ),
            stop_at_eos=True,
            arrival_unix_ms=int(now * 1000),
            deadline_unix_ms=int((now + timeout_s) * 1000) if timeout_s else 0,
            reply_to=self.core.instance_id,
            key_id=key_id,
            key_weight=key_weight,
        )
        return Intake(admitted.request_id, record, timeout_s)

    async def _known_request(
        self, intake: Intake, context: grpc.aio.ServicerContext
    ) -> LiveRequest | None:
        """What this instance knows of the request's id in its key's scope (a retry): live or
        done. Ends the call when the id names a different request, when another client streams
        it, or when it ended otherwise than done."""
        request_id, client_id = intake.record.request_id, intake.client_id
        known = self.core.lookup(request_id)
        if known is not None and request_digest(known.record) != request_digest(intake.record):
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {client_id!r} was already used for a different request (prompt "
                "or parameters differ); send this one with a new request_id",
            )
        if request_id in self.core.clients:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request {client_id} is already being streamed to another client",
            )
        if known is not None and known.outcome not in (Outcome.LIVE, Outcome.DONE):
            await context.abort(
                grpc.StatusCode.ABORTED,
                f"request {client_id} already ended ({known.outcome.value}); "
                "send it again with a new request_id",
            )
        return known

    def _done_again(self, known: LiveRequest, client_id: str) -> serving_pb2.GenerateEvent:
        return serving_pb2.GenerateEvent(
            request_id=client_id,
            done=serving_pb2.Done(
                usage=known.usage(),
                timings=known.timings(self.core.clock()),
                text=self.core.decode(known.output_ids),
            ),
        )

    async def _enqueue(
        self, intake: Intake, context: grpc.aio.ServicerContext
    ) -> serving_pb2.GenerateEvent:
        """Write the request to its served tier's topic; ``Queued`` once the broker
        acknowledged it. A request its tier's overflow rule refuses, or that the scheduler
        would shed, is refused here, before it is queued."""
        record = intake.record
        await self._place(record, context)
        shed = self.core.shed_reason(record.tier)
        if shed is not None:
            log.info("shed at admission", request_id=record.request_id, reason=shed)
            self.refused(record)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, shed)
        position = self.core.queue_position(record.tier)
        log_ = log.bind(request_id=record.request_id, tier=record.tier)
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.publish, record)
        except Exception as exc:  # broker unreachable or refused: nothing was queued
            log_.error("kafka publish failed", error=str(exc))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"request queue unavailable: {exc}")
        self.board.admitted(
            record.tier,
            record.arrival_unix_ms,
            len(record.prompt_ids),
            record.key_id,
            record.key_weight or 1.0,
        )
        log_.info("queued", prompt_tokens=len(record.prompt_ids))
        return serving_pb2.GenerateEvent(
            request_id=intake.client_id,
            queued=serving_pb2.Queued(
                tier=record.tier,
                requested_tier=record.requested_tier,
                position=position,
                prompt_tokens=len(record.prompt_ids),
                deployment=self.deployment,
            ),
        )

    async def _place(self, record: queue_pb2.QueuedRequest, context) -> None:
        """Apply the tier's overflow rule: ``record`` moves to the tier that serves it (the
        asked tier kept in ``requested_tier``), or the call ends with RESOURCE_EXHAUSTED and a
        ``retry-after`` in seconds."""
        placement = self.board.place(
            record.tier, len(record.prompt_ids), record.key_id, record.key_weight or 1.0
        )
        if placement.unjudged is not None and placement.served_tier is not None:
            self.unjudged(placement.served_tier, placement.unjudged)
        # The owner measures admission's error against it (0: not judged).
        record.admission_predicted_ttft_s = placement.predicted_ttft_s or 0.0
        record.key_over_share = placement.over_share
        if placement.served_tier is None:
            refusal = placement.refusal
            log.info("refused at capacity", request_id=record.request_id, tier=record.tier)
            if refusal.tier != record.tier:  # refused further down, after a downgrade
                record.requested_tier, record.tier = record.tier, refusal.tier
            self.refused(record)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                refusal.reason() + "; send it again later",
                (("retry-after", str(refusal.retry_after_s)),),
            )
        if placement.downgraded:
            judged = placement.verdicts[0]
            log.info(
                "downgraded at capacity",
                request_id=record.request_id,
                requested_tier=record.tier,
                served_tier=placement.served_tier,
                predicted_ttft_s=round(judged.predicted_ttft_s, 3),
                # The prediction's parts: switch + wait + own + margin * inflated + error.
                **{
                    f"{part}_s": round(getattr(judged, f"{part}_s"), 3)
                    for part in ("switch", "wait", "own", "inflated", "error")
                },
                margin=round(judged.margin, 3),
            )
            record.requested_tier = record.tier
            record.tier = placement.served_tier

    @staticmethod
    async def _next_item(
        queue: asyncio.Queue[ClientItem], deadline: float | None, heartbeat_s: float
    ) -> ClientItem | object | None:
        """The request's next event or error; HEARTBEAT when nothing came for ``heartbeat_s``;
        None when its deadline passes first."""
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        wait = heartbeat_s if left is None else min(left, heartbeat_s)
        try:
            return await asyncio.wait_for(queue.get(), wait)
        except TimeoutError:
            return None if left is not None and left <= heartbeat_s else HEARTBEAT

    def end_streams(self, code: grpc.StatusCode, message: str) -> int:
        """End every open client stream with ``code`` (terminal event, then status) without
        cancelling its request: what a stopping service does. Returns how many there were."""
        streams = list(self.core.clients.values())
        for queue in streams:
            queue.put_nowait(ClientError(code, message))
        return len(streams)

    async def GetRequest(
        self, request: serving_pb2.GetRequestRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.RequestStatus:
        """The request of that id in the caller's key's scope; another key's is NOT_FOUND,
        exactly like an id nobody used."""
        await self._authorize(context)
        if isinstance(request, Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            key_id = key_id_from_metadata(context.invocation_metadata() or ())
            check_request_id(request.request_id)
        except AdmissionError as exc:
            await context.abort(exc.code, exc.message)
        live = self.core.lookup(scoped_request_id(key_id, request.request_id))
        if live is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no request {request.request_id!r} on this instance"
            )
        return serving_pb2.RequestStatus(
            request_id=request.request_id,
            tier=live.record.tier,
            requested_tier=live.record.requested_tier,
            state=live.state,
            usage=live.usage(),
            timings=live.timings(self.core.clock()),
            text=self.core.decode(live.output_ids),
            error=live.error,
        )


HEARTBEAT = object()  # _next_item: nothing happened for a heartbeat interval


@dataclass(frozen=True)
class Intake:
    """An admitted request: the client's id for it, and the record to queue (its id scoped)."""

    client_id: str
    record: queue_pb2.QueuedRequest
    timeout_s: float | None  # how long the client waits; None: no limit


def error_event(request_id: str, error: ClientError) -> serving_pb2.GenerateEvent:
    """The terminal event of a stream that fails after it started (the status follows it)."""
    return serving_pb2.GenerateEvent(
        request_id=request_id,
        error=serving_pb2.StreamError(code=error.code.value[0], message=error.message),
    )


def _earliest(*timeouts: float | None) -> float | None:
    given = [t for t in timeouts if t is not None]
    return min(given) if given else None
