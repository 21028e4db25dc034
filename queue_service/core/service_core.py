"""The queue service's heart: scheduler events in, worker commands and client events out.

Everything here runs on the service's asyncio loop, one callback at a time, so the scheduler (a
pure state machine) is only ever touched by one thread and needs no lock. Scheduler commands
reach the workers through the shared dispatcher (``queue_service.core.dispatcher``): each attached
worker is a ``RemoteWorker`` handle (``queue_service.workers.api``), and wake-ups are timers on
this loop. Other I/O is injected:
- ``Transport.finished``: tell the Kafka consumer a delivery is finished (commit its offset);
- ``Transport.publish_reply``: hand an event to the instance that holds the client's stream.

Client streams register a queue per request id; events for a request whose client is on another
instance (``record.reply_to``) go to that instance through ``publish_reply``.

Each output token reaches the client once: tokens carry their position in the output, and one
the client has already (produced again by a recompute from token 0, after a dropped state or on
another worker after this one left) is not sent again. Batched workers send one ``DecodeStep``
per step with every row's token. A request whose worker died after its last token but before
``Done`` is completed here, not run again.

While no worker is attached, a waiting request's client is told so (a ``Waiting`` event), and a
request that waited ``no_worker_timeout_s`` like that ends with UNAVAILABLE without being run
(``expire_unattended``, called periodically by the service).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import grpc
import structlog

from queue_service.core.capacity_board import PublishedLoad
from queue_service.core.dispatcher import Dispatcher, WorkerHandle
from queue_service.core.live import LiveRequest, Outcome
from queue_service.scheduler import (
    DecodeStepDone,
    PreemptionAcked,
    PrefillFinished,
    PrefillProgress,
    Reject,
    RequestArrived,
    RequestCancelled,
    RequestDone,
    Scheduler,
)
from tierflow.recent import RecentMap
from tierflow.v1 import queue_pb2, serving_pb2, worker_pb2

log = structlog.get_logger("queue_service")

Status = serving_pb2.RequestStatus


@dataclass(frozen=True)
class ClientError:
    """Ends a client stream with this gRPC status."""

    code: grpc.StatusCode
    message: str


ClientItem = serving_pb2.GenerateEvent | ClientError


def _ignore(*_: Any) -> None:
    pass


@dataclass(frozen=True)
class Transport:
    finished: Callable[[Any], None]
    publish_reply: Callable[[str, queue_pb2.ReplyRecord], None]
    # Observers (the request log, the metrics), called on the loop; they must not block.
    request_ended: Callable[[LiveRequest, float], None] = _ignore  # (request, now)
    preempted: Callable[[str, float, bool], None] = _ignore  # (tier, latency_s, state_dropped)


class LoopTimers:
    """The dispatcher's wake-ups as ``call_later`` handles on the running asyncio loop."""

    def __init__(self, fire: Callable[[str], None], clock: Callable[[], float]) -> None:
        self._fire = fire
        self._clock = clock
        self._handles: dict[str, asyncio.TimerHandle] = {}

    def set(self, request_id: str, at_s: float) -> None:
        self.cancel(request_id)
        delay = max(0.0, at_s - self._clock())
        loop = asyncio.get_running_loop()
        self._handles[request_id] = loop.call_later(delay, self._due, request_id)

    def cancel(self, request_id: str) -> None:
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            handle.cancel()

    def _due(self, request_id: str) -> None:
        self._handles.pop(request_id, None)
        self._fire(request_id)


class ServiceCore:
    def __init__(
        self,
        scheduler: Scheduler,
        transport: Transport,
        *,
        instance_id: str,
        decode: Callable[[list[int]], str],
        eos_ids: frozenset[int] = frozenset(),
        no_worker_timeout_s: float = 60.0,
        decode_stream: Callable[[], Callable[[int], str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        remember_finished: int = 10_000,
    ) -> None:
        self.scheduler = scheduler
        self.transport = transport
        self.instance_id = instance_id
        self.decode = decode
        self.eos_ids = eos_ids  # a streamed request that ends with one of these is complete
        self.no_worker_timeout_s = no_worker_timeout_s
        # A new incremental decoder (token id -> text piece) per run of a request; without one,
        # each token is decoded alone (a byte-level token may then show as U+FFFD).
        self.decode_stream = decode_stream or (lambda: lambda token_id: decode([token_id]))
        self.clock = clock
        self.live: dict[str, LiveRequest] = {}
        self.finished: RecentMap[str, LiveRequest] = RecentMap(remember_finished)
        self.clients: dict[str, asyncio.Queue[ClientItem]] = {}
        # Tier -> admitting instance -> the latest admission stamp delivered here: what this
        # instance's published loads count (``capacity_board``).
        self.counted_through: dict[str, dict[str, int]] = {}
        self.dispatcher = Dispatcher(
            scheduler,
            LoopTimers(lambda rid: self.dispatcher.fire_timer(rid), clock),
            clock=clock,
            on_reject=self._rejected,
            on_start=self._started,
        )

    # ------------------------------------------------------------------ clients

    def open_client(self, request_id: str) -> asyncio.Queue[ClientItem]:
        queue: asyncio.Queue[ClientItem] = asyncio.Queue()
        self.clients[request_id] = queue
        return queue

    def close_client(self, request_id: str) -> None:
        self.clients.pop(request_id, None)

    def client_gone(self, request_id: str) -> None:
        """The client cancelled or disconnected: stop its request (next layer boundary)."""
        self.close_client(request_id)
        live = self.live.get(request_id)
        if live is not None and live.outcome is Outcome.LIVE:
            log.info("client gone, cancelling", request_id=request_id)
            self.dispatcher.handle(RequestCancelled(request_id))
            self._end(live, Outcome.CANCELLED, Status.CANCELLED, "client cancelled")

    def shed_reason(self, tier: str) -> str | None:
        """Why a new request of ``tier`` would be shed now (None: it would be admitted)."""
        return self.scheduler.shed_reason(tier, self.clock())

    def queue_position(self, tier: str) -> int:
        return self.scheduler.queue_depth().get(tier, 0)

    def tier_load(self, tier: str) -> PublishedLoad:
        """This instance's load of ``tier``, as it publishes it for admission everywhere."""
        return PublishedLoad(
            instance_id=self.instance_id,
            as_of_s=time.time(),
            load=self.scheduler.tier_load(tier, self.clock()),
            counted_through_ms=dict(self.counted_through.get(tier, {})),
        )

    def lookup(self, request_id: str) -> LiveRequest | None:
        return self.live.get(request_id) or self.finished.get(request_id)

    def tokens_so_far(
        self, live: LiveRequest, client_id: str | None = None
    ) -> list[serving_pb2.GenerateEvent]:
        """The token events ``live`` has produced so far, from its first: what a client that
        joins it (a reattach, a retry) is sent before anything new, so that tokens produced
        while no client listened are not lost. A client skips the ones it already had by their
        position, as after a restart from token 0 (``tierflow.resume``). The events carry
        ``client_id`` (the id that client knows the request by) when given."""
        text_step = self.decode_stream()
        events = []
        for i, token_id in enumerate(live.output_ids):
            text = text_step(token_id)
            if i == 0:
                ttft_ms = live.timings(self.clock()).ttft_ms
                event = {
                    "first_token": serving_pb2.FirstToken(
                        token_id=token_id, text=text, ttft_ms=ttft_ms
                    )
                }
            else:
                event = {"token": serving_pb2.Token(token_id=token_id, text=text)}
            events.append(
                serving_pb2.GenerateEvent(request_id=client_id or live.request_id, **event)
            )
        return events

    # ------------------------------------------------------------------ Kafka deliveries

    def on_delivered(self, record: queue_pb2.QueuedRequest, delivery: Any) -> None:
        """A request consumed from its tier topic (maybe published by another instance)."""
        request_id = record.request_id
        if request_id in self.live or request_id in self.finished:
            log.info("duplicate delivery ignored", request_id=request_id)
            if request_id in self.finished:
                self.transport.finished(delivery)
            return
        live = LiveRequest(record=record, delivery=delivery, arrived_at=self._arrival(record))
        self.live[request_id] = live
        # When the scheduler first hears of it: a slow Kafka delivery and a decision to let it
        # wait look alike from the client's side.
        log.info(
            "delivered",
            request_id=request_id,
            tier=record.tier,
            since_admission_ms=round((self.clock() - live.arrived_at) * 1000, 1),
            admission_predicted_ms=round(record.admission_predicted_ttft_s * 1000, 1),
        )
        counted = self.counted_through.setdefault(record.tier, {})
        counted[record.reply_to] = max(counted.get(record.reply_to, 0), record.arrival_unix_ms)
        self.dispatcher.handle(
            RequestArrived(
                request_id,
                record.tier,
                len(record.prompt_ids),
                record.max_new_tokens,
                arrival_s=live.arrived_at,  # the deadline counts from admission
                key_id=record.key_id,
                key_weight=record.key_weight or 1.0,
                admission_ttft_s=record.admission_predicted_ttft_s or None,
                key_over_share=record.key_over_share,
            )
        )
        if request_id in self.live and not self.dispatcher.handles:
            self._warn_unattended([live])

    def _arrival(self, record: queue_pb2.QueuedRequest) -> float:
        # Arrival on this service's clock, from the wall-clock stamp taken at admission, so that
        # a request replayed after a restart keeps its original arrival (and deadline).
        age_s = max(0.0, time.time() - record.arrival_unix_ms / 1000)
        return self.clock() - age_s

    # ------------------------------------------------------------------ workers

    @property
    def workers(self) -> frozenset[str]:
        return frozenset(self.dispatcher.handles)

    def worker_joined(
        self, worker_id: str, handle: WorkerHandle, kv_slots: int, interruption_s: float = 0.0
    ) -> None:
        """A worker with ``kv_slots`` KV slots (its Hello said so; >= 1) that stops a prefill
        within ``interruption_s`` (its preemption budget; 0: not bounded in time)."""
        for live in self.live.values():
            live.unattended_since = None
        self.dispatcher.worker_joined(worker_id, handle, kv_slots, interruption_s)

    def worker_left(self, worker_id: str) -> None:
        if worker_id not in self.dispatcher.handles:
            return
        held = [live for live in self.live.values() if live.worker_id == worker_id]
        for live in held:
            if self._streamed_to_the_end(live):
                # It died between its last token and Done: nothing is left to compute.
                self.dispatcher.handle(RequestCancelled(live.request_id))
                self._complete(live, self.clock())
                continue
            live.worker_id = None
            live.state = Status.QUEUED  # its tokens so far stay: they are not sent twice
        log.warning("worker left; its requests are re-queued", worker_id=worker_id)
        self.dispatcher.worker_left(worker_id)
        if not self.dispatcher.handles:
            self._warn_unattended(list(self.live.values()))

    # ------------------------------------------------------------------ no worker attached

    def _warn_unattended(self, waiting: list[LiveRequest]) -> None:
        """Tell these requests' clients, once, that no worker is attached."""
        now = self.clock()
        for live in waiting:
            if live.unattended_since is None:
                live.unattended_since = now
                log.warning("waiting with no worker attached", request_id=live.request_id)
                self._emit(
                    live,
                    waiting=serving_pb2.Waiting(
                        reason="no worker is attached to the queue service",
                        unavailable_in_ms=int(self.no_worker_timeout_s * 1000),
                    ),
                )

    def expire_unattended(self) -> None:
        """End with UNAVAILABLE, not run, the requests that waited ``no_worker_timeout_s`` with
        no worker attached."""
        if self.dispatcher.handles:
            return
        now = self.clock()
        for live in list(self.live.values()):
            since = live.unattended_since
            if since is not None and now - since >= self.no_worker_timeout_s:
                self.dispatcher.handle(RequestCancelled(live.request_id))
                self._fail(
                    live,
                    grpc.StatusCode.UNAVAILABLE,
                    f"no worker attached for {now - since:.0f} s: the request was not run; "
                    "send it again later",
                )

    def _streamed_to_the_end(self, live: LiveRequest) -> bool:
        out = live.output_ids
        if len(out) >= live.record.max_new_tokens:
            return True
        return bool(out) and live.record.stop_at_eos and out[-1] in self.eos_ids

    def record_for(self, request_id: str) -> queue_pb2.QueuedRequest:
        """The queued record of a live request (what an Assign carries to the worker)."""
        return self.live[request_id].record

    def tbt_slo_s(self, request_id: str) -> float | None:
        """The time-between-tokens target of a live request's tier (None: none)."""
        return self.scheduler.tiers[self.live[request_id].record.tier].tbt_slo_s

    def on_worker_message(self, worker_id: str, msg: worker_pb2.WorkerMessage) -> None:
        kind = msg.WhichOneof("event")
        body = getattr(msg, kind)
        if kind == "decode_step":  # every row's token: not one request's event
            self._on_decode_step(worker_id, body)
            return
        if kind == "draining":  # the worker's, not one request's
            log.info("worker draining", worker_id=worker_id)
            self.dispatcher.worker_draining(worker_id)
            return
        live = self.live.get(getattr(body, "request_id", ""))
        if kind == "heartbeat" or live is None or live.worker_id != worker_id:
            return  # heartbeats are read by the session; stale events of a moved request dropped
        handler = self._worker_handlers.get(kind)
        if handler is not None:  # "cancelled": the scheduler freed it when it sent Cancel
            handler(self, live, worker_id, body, self.clock())

    def _on_progress(self, live: LiveRequest, worker_id: str, body, now: float) -> None:
        # Chunk ends reach the client; layer reports, and the recompute of a request whose
        # tokens are streaming already, only decide.
        if body.layers_done == 0 and not live.output_ids:
            live.tokens_done = body.tokens_done
            self._emit(
                live,
                progress=serving_pb2.PrefillProgress(
                    tokens_done=body.tokens_done,
                    prompt_tokens=body.prompt_tokens,
                    preemptions=live.preemptions,
                ),
            )
        self.dispatcher.handle(
            PrefillProgress(
                live.request_id, worker_id, body.tokens_done,
                body.layers_done, body.num_layers, body.chunk_end,
            )
        )  # fmt: skip

    def _on_first_token(self, live: LiveRequest, worker_id: str, body, now: float) -> None:
        live.state = Status.RUNNING
        if not live.output_ids:  # else a recompute from token 0: the client has this one
            live.first_token_at = live.last_token_at = now
            live.prefill_busy_ms = body.prefill_busy_ms
            live.output_ids = [body.token_id]
            live.text_step = self.decode_stream()  # the text of a new output starts afresh
            self._emit(
                live,
                first_token=serving_pb2.FirstToken(
                    token_id=body.token_id,
                    text=live.text_step(body.token_id),
                    ttft_ms=(now - live.arrived_at) * 1000,
                ),
            )
        self.dispatcher.handle(
            PrefillFinished(
                live.request_id, worker_id, body.prompt_tokens, body.prefill_busy_ms / 1000,
                body.pack_tokens,
            )
        )  # fmt: skip

    def _on_decode_rejoined(self, live: LiveRequest, worker_id: str, body, now: float) -> None:
        # A dropped decode recomputed (no token again): it decodes, its prefill is done.
        live.state = Status.RUNNING
        self.dispatcher.handle(
            PrefillFinished(live.request_id, worker_id, body.recomputed_tokens, 0.0)
        )

    def _on_token(self, live: LiveRequest, worker_id: str, body, now: float) -> None:
        self._stream_token(live, body.index, body.token_id, now)

    def _on_decode_step(self, worker_id: str, step: worker_pb2.DecodeStep) -> None:
        now = self.clock()
        for token in step.tokens:
            live = self.live.get(token.request_id)
            if live is not None and live.worker_id == worker_id:
                self._stream_token(live, token.index, token.token_id, now)
        seconds = step.step_ms / 1000
        self.dispatcher.handle(DecodeStepDone(worker_id, len(step.tokens), seconds, step.slotted))

    def _stream_token(self, live: LiveRequest, index: int, token_id: int, now: float) -> None:
        """The ``index``-th output token; one the client has already is not sent again."""
        if index < len(live.output_ids):
            return
        live.output_ids.append(token_id)
        if live.last_token_at is not None:
            live.token_gaps_s.append(now - live.last_token_at)
        live.last_token_at = now
        if live.text_step is None:  # a token without its first token (never expected)
            live.text_step = self.decode_stream()
        text = live.text_step(token_id)
        self._emit(live, token=serving_pb2.Token(token_id=token_id, text=text))

    def _on_preempted(self, live: LiveRequest, worker_id: str, body, now: float) -> None:
        live.preemptions += 1
        live.state = Status.SUSPENDED
        self.transport.preempted(live.record.tier, body.latency_ms / 1000, body.state_dropped)
        # A dropped state keeps the tokens the client has: a recompute does not resend them.
        if not body.state_dropped:
            live.suspended_since = now
        log.info(
            "preempted",
            request_id=live.request_id,
            worker_id=worker_id,
            latency_ms=round(body.latency_ms, 2),
            dropped=body.state_dropped,
            tokens_done=body.resume_point.tokens_done,
        )
        self.dispatcher.handle(
            PreemptionAcked(
                live.request_id,
                worker_id,
                body.resume_point.tokens_done,
                body.state_dropped,
                body.latency_ms / 1000,
            )
        )

    def _on_done(self, live: LiveRequest, worker_id: str, body, now: float) -> None:
        live.output_ids = list(body.output_ids)
        self._complete(live, now)
        self.dispatcher.handle(RequestDone(live.request_id, worker_id))

    def _complete(self, live: LiveRequest, now: float) -> None:
        live.ended_at = now
        finish = "length" if len(live.output_ids) >= live.record.max_new_tokens else "stop"
        self._emit(
            live,
            done=serving_pb2.Done(
                usage=live.usage(),
                timings=live.timings(now),
                text=self.decode(live.output_ids),
                finish_reason=finish,
            ),
        )
        self._end(live, Outcome.DONE, Status.DONE)

    def _on_failed(self, live: LiveRequest, worker_id: str, body, now: float) -> None:
        invalid = body.invalid_request
        code = grpc.StatusCode.INVALID_ARGUMENT if invalid else grpc.StatusCode.INTERNAL
        self._fail(live, code, body.error)
        self.dispatcher.handle(RequestDone(live.request_id, worker_id))

    _worker_handlers: ClassVar[dict[str, Callable]] = {
        "progress": _on_progress,
        "first_token": _on_first_token,
        "decode_rejoined": _on_decode_rejoined,
        "token": _on_token,
        "preempted": _on_preempted,
        "done": _on_done,
        "failed": _on_failed,
    }

    # ------------------------------------------------------------------ dispatcher callbacks

    def _started(self, request_id: str, worker_id: str, resumed: bool) -> None:
        live = self.live.get(request_id)
        if live is None:
            return
        now = self.clock()
        live.worker_id = worker_id
        if not resumed:
            live.started_at = live.started_at or now
        self._end_suspension(live, now)
        live.state = Status.RUNNING

    def _rejected(self, reject: Reject) -> None:
        live = self.live.get(reject.request_id)
        if live is None:
            return
        log.info("rejected", request_id=reject.request_id, reason=reject.reason)
        code = (
            grpc.StatusCode.RESOURCE_EXHAUSTED
            if reject.overload
            else grpc.StatusCode.INVALID_ARGUMENT
        )
        self._send(live, ClientError(code, reject.reason))
        live.shed = reject.overload
        self._end(live, Outcome.REJECTED, Status.REJECTED, reject.reason)

    @staticmethod
    def _end_suspension(live: LiveRequest, now: float) -> None:
        if live.suspended_since is not None:
            live.suspended_s += now - live.suspended_since
            live.suspended_since = None

    # ------------------------------------------------------------------ client events

    def _emit(self, live: LiveRequest, **event) -> None:
        self._send(live, serving_pb2.GenerateEvent(request_id=live.request_id, **event))

    def _send(self, live: LiveRequest, item: ClientItem) -> None:
        queue = self.clients.get(live.request_id)
        if queue is not None:
            queue.put_nowait(item)
            return
        reply_to = live.record.reply_to
        if reply_to and reply_to != self.instance_id:
            if isinstance(item, ClientError):
                reply = queue_pb2.ReplyRecord(
                    request_id=live.request_id,
                    error=queue_pb2.ReplyError(code=item.code.value[0], message=item.message),
                )
            else:
                reply = queue_pb2.ReplyRecord(request_id=live.request_id, event=item)
            self.transport.publish_reply(reply_to, reply)
        # Otherwise nobody listens (the client left or this instance restarted): the request
        # still completes, and a client that retries with the same id joins or gets the result.

    def deliver_reply(self, reply: queue_pb2.ReplyRecord) -> None:
        """An event of one of this instance's clients, run by another instance."""
        queue = self.clients.get(reply.request_id)
        if queue is None:
            return
        if reply.WhichOneof("body") == "error":
            queue.put_nowait(ClientError(_status_code(reply.error.code), reply.error.message))
        else:
            queue.put_nowait(reply.event)

    def _fail(self, live: LiveRequest, code: grpc.StatusCode, message: str) -> None:
        log.warning("request failed", request_id=live.request_id, error=message)
        self._send(live, ClientError(code, message))
        self._end(live, Outcome.FAILED, Status.FAILED, message)

    def _end(self, live: LiveRequest, outcome: Outcome, state: int, error: str = "") -> None:
        live.outcome, live.state, live.error = outcome, state, error
        if live.ended_at is None:
            live.ended_at = self.clock()
        self.live.pop(live.request_id, None)
        self.finished[live.request_id] = live
        if live.delivery is not None:
            self.transport.finished(live.delivery)
        self.transport.request_ended(live, self.clock())


def _status_code(value: int) -> grpc.StatusCode:
    return next((c for c in grpc.StatusCode if c.value[0] == value), grpc.StatusCode.UNKNOWN)
