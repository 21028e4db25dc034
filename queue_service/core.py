"""The queue service's heart: scheduler events in, worker commands and client events out.

Everything here runs on the service's asyncio loop, one callback at a time, so the scheduler (a
pure state machine) is only ever touched by one thread and needs no lock. I/O is injected:
- ``Transport.send_to_worker``: put a ControlMessage on a worker's control stream;
- ``Transport.finished``: tell the Kafka consumer a delivery is finished (commit its offset);
- ``Transport.publish_reply``: hand an event to the instance that holds the client's stream.

Client streams register a queue per request id; events for a request whose client is on another
instance (``record.reply_to``) go to that instance through ``publish_reply``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from queue_service.live import LiveRequest, Outcome
from queue_service.scheduler import (
    Assign,
    Cancel,
    Preempt,
    PreemptionAcked,
    PrefillFinished,
    PrefillProgress,
    Reject,
    RequestArrived,
    RequestCancelled,
    RequestDone,
    Resume,
    Scheduler,
    WorkerJoined,
    WorkerLeft,
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


@dataclass(frozen=True)
class Transport:
    send_to_worker: Callable[[str, worker_pb2.ControlMessage], None]
    finished: Callable[[Any], None]
    publish_reply: Callable[[str, queue_pb2.ReplyRecord], None]


class ServiceCore:
    def __init__(
        self,
        scheduler: Scheduler,
        transport: Transport,
        *,
        instance_id: str,
        decode: Callable[[list[int]], str],
        clock: Callable[[], float] = time.monotonic,
        remember_finished: int = 10_000,
    ) -> None:
        self.scheduler = scheduler
        self.transport = transport
        self.instance_id = instance_id
        self.decode = decode
        self.clock = clock
        self.live: dict[str, LiveRequest] = {}
        self.finished: RecentMap[str, LiveRequest] = RecentMap(remember_finished)
        self.clients: dict[str, asyncio.Queue[ClientItem]] = {}
        self.workers: set[str] = set()

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
            self._apply(self.scheduler.handle(RequestCancelled(request_id), self.clock()))
            self._end(live, Outcome.CANCELLED, Status.CANCELLED, "client cancelled")

    def queue_position(self, tier: str) -> int:
        return self.scheduler.queue_depth().get(tier, 0)

    def lookup(self, request_id: str) -> LiveRequest | None:
        return self.live.get(request_id) or self.finished.get(request_id)

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
        commands = self.scheduler.handle(
            RequestArrived(request_id, record.tier, len(record.prompt_ids), record.max_new_tokens),
            self.clock(),
        )
        self._apply(commands)

    def _arrival(self, record: queue_pb2.QueuedRequest) -> float:
        # Arrival on this service's clock, from the wall-clock stamp taken at admission, so that
        # a request replayed after a restart keeps its original arrival (and deadline).
        age_s = max(0.0, time.time() - record.arrival_unix_ms / 1000)
        return self.clock() - age_s

    # ------------------------------------------------------------------ workers

    def worker_joined(self, worker_id: str) -> None:
        self.workers.add(worker_id)
        self._apply(self.scheduler.handle(WorkerJoined(worker_id), self.clock()))

    def worker_left(self, worker_id: str) -> None:
        if worker_id not in self.workers:
            return
        self.workers.discard(worker_id)
        for live in self.live.values():
            if live.worker_id == worker_id:
                live.worker_id = None
                live.state = Status.QUEUED
                live.output_ids.clear()
        log.warning("worker left; its requests are re-queued", worker_id=worker_id)
        self._apply(self.scheduler.handle(WorkerLeft(worker_id), self.clock()))

    def on_worker_message(self, worker_id: str, msg: worker_pb2.WorkerMessage) -> None:
        kind = msg.WhichOneof("event")
        body = getattr(msg, kind)
        live = self.live.get(getattr(body, "request_id", ""))
        now = self.clock()
        if kind == "heartbeat" or live is None or live.worker_id != worker_id:
            return  # heartbeats are read by the session; stale events of a moved request dropped
        if kind == "progress":
            live.tokens_done = body.tokens_done
            self._emit(
                live,
                progress=serving_pb2.PrefillProgress(
                    tokens_done=body.tokens_done,
                    prompt_tokens=body.prompt_tokens,
                    preemptions=live.preemptions,
                ),
            )
            self._apply(
                self.scheduler.handle(
                    PrefillProgress(live.request_id, worker_id, body.tokens_done), now
                )
            )
        elif kind == "first_token":
            live.first_token_at = now
            live.prefill_busy_ms = body.prefill_busy_ms
            live.output_ids = [body.token_id]
            live.state = Status.RUNNING
            self._emit(
                live,
                first_token=serving_pb2.FirstToken(
                    token_id=body.token_id,
                    text=self.decode([body.token_id]),
                    ttft_ms=(now - live.arrived_at) * 1000,
                ),
            )
            self._apply(
                self.scheduler.handle(
                    PrefillFinished(
                        live.request_id, worker_id, body.prompt_tokens, body.prefill_busy_ms / 1000
                    ),
                    now,
                )
            )
        elif kind == "token":
            live.output_ids.append(body.token_id)
            self._emit(
                live,
                token=serving_pb2.Token(token_id=body.token_id, text=self.decode([body.token_id])),
            )
        elif kind == "preempted":
            live.preemptions += 1
            live.state = Status.SUSPENDED
            if body.state_dropped:
                live.output_ids.clear()
            else:
                live.suspended_since = now
            log.info(
                "preempted",
                request_id=live.request_id,
                worker_id=worker_id,
                latency_ms=round(body.latency_ms, 2),
                dropped=body.state_dropped,
                tokens_done=body.resume_point.tokens_done,
            )
            self._apply(
                self.scheduler.handle(
                    PreemptionAcked(
                        live.request_id,
                        worker_id,
                        body.resume_point.tokens_done,
                        body.state_dropped,
                    ),
                    now,
                )
            )
        elif kind == "done":
            live.output_ids = list(body.output_ids)
            self._emit(
                live,
                done=serving_pb2.Done(
                    usage=live.usage(),
                    timings=live.timings(now),
                    text=self.decode(live.output_ids),
                    finish_reason="length"
                    if len(live.output_ids) >= live.record.max_new_tokens
                    else "stop",
                ),
            )
            self._end(live, Outcome.DONE, Status.DONE)
            self._apply(self.scheduler.handle(RequestDone(live.request_id, worker_id), now))
        elif kind == "failed":
            code = (
                grpc.StatusCode.INVALID_ARGUMENT
                if body.invalid_request
                else grpc.StatusCode.INTERNAL
            )
            self._fail(live, code, body.error)
            self._apply(self.scheduler.handle(RequestDone(live.request_id, worker_id), now))
        # "cancelled": the scheduler already freed the request when it sent Cancel.

    # ------------------------------------------------------------------ commands

    def _apply(self, commands) -> None:
        now = self.clock()
        for cmd in commands:
            live = self.live.get(cmd.request_id)
            if isinstance(cmd, Assign):
                if live is None:
                    continue
                live.worker_id = cmd.worker_id
                live.started_at = live.started_at or now
                self._end_suspension(live, now)
                live.state = Status.RUNNING
                r = live.record
                self.transport.send_to_worker(
                    cmd.worker_id,
                    worker_pb2.ControlMessage(
                        assign=worker_pb2.Assign(
                            request_id=r.request_id,
                            prompt_ids=r.prompt_ids,
                            max_new_tokens=r.max_new_tokens,
                            sampling=r.sampling,
                            stop_at_eos=r.stop_at_eos,
                        )
                    ),
                )
            elif isinstance(cmd, Resume):
                if live is not None:
                    self._end_suspension(live, now)
                    live.state = Status.RUNNING
                self.transport.send_to_worker(
                    cmd.worker_id,
                    worker_pb2.ControlMessage(resume=worker_pb2.Resume(request_id=cmd.request_id)),
                )
            elif isinstance(cmd, Preempt):
                self.transport.send_to_worker(
                    cmd.worker_id,
                    worker_pb2.ControlMessage(
                        preempt=worker_pb2.Preempt(
                            request_id=cmd.request_id, drop_state=cmd.drop_state
                        )
                    ),
                )
            elif isinstance(cmd, Cancel):
                self.transport.send_to_worker(
                    cmd.worker_id,
                    worker_pb2.ControlMessage(cancel=worker_pb2.Cancel(request_id=cmd.request_id)),
                )
            elif isinstance(cmd, Reject) and live is not None:
                log.info("rejected", request_id=cmd.request_id, reason=cmd.reason)
                code = (
                    grpc.StatusCode.RESOURCE_EXHAUSTED
                    if cmd.overload
                    else grpc.StatusCode.INVALID_ARGUMENT
                )
                self._send(live, ClientError(code, cmd.reason))
                self._end(live, Outcome.REJECTED, Status.REJECTED, cmd.reason)

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
        self.live.pop(live.request_id, None)
        self.finished[live.request_id] = live
        if live.delivery is not None:
            self.transport.finished(live.delivery)


def _status_code(value: int) -> grpc.StatusCode:
    return next((c for c in grpc.StatusCode if c.value[0] == value), grpc.StatusCode.UNKNOWN)
