"""The worker control servicer (``tierflow.v1.WorkerControl``): one bidirectional stream per
attached worker process.

The first message must be ``Hello``. From then on, commands the core sends to the worker go
through the session's outbox onto the response stream, and what the worker reports goes to the
core. A worker is considered gone when its stream closes or errors, or when no message
(heartbeats included) arrived for ``heartbeat_timeout_s``: the core then re-queues what it held,
so another worker completes it and nothing is lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import structlog

from queue_service.config import QueueServiceConfig
from queue_service.core.service_core import ServiceCore
from queue_service.trust import PLAINTEXT, Trust
from tierflow.v1 import worker_pb2, worker_pb2_grpc

log = structlog.get_logger("queue_service.workers.api")

_CLOSE = object()  # put in an outbox to end that worker's response stream


class RemoteWorker:
    """The dispatcher's ``WorkerHandle`` for an attached worker: each command becomes one
    ``ControlMessage`` on its stream. An Assign carries the queued record's prompt and
    sampling, and its tier's TBT target (a batched worker slots decode steps into a prefill by
    it); the worker treats an Assign of a request it holds as "recompute"."""

    def __init__(self, outbox: asyncio.Queue, core: ServiceCore) -> None:
        self._outbox = outbox
        self._core = core

    def _assign_message(self, request_id: str) -> worker_pb2.Assign:
        r = self._core.record_for(request_id)
        return worker_pb2.Assign(
            request_id=r.request_id,
            prompt_ids=r.prompt_ids,
            max_new_tokens=r.max_new_tokens,
            sampling=r.sampling,
            stop_at_eos=r.stop_at_eos,
            tbt_slo_s=self._core.tbt_slo_s(request_id) or 0.0,  # 0 on the wire: no target
        )

    def assign(self, request_id: str) -> None:
        assign = self._assign_message(request_id)
        self._outbox.put_nowait(worker_pb2.ControlMessage(assign=assign))

    def assign_packed(self, request_ids: tuple[str, ...]) -> None:
        members = [self._assign_message(rid) for rid in request_ids]
        packed = worker_pb2.AssignPacked(members=members)
        self._outbox.put_nowait(worker_pb2.ControlMessage(assign_packed=packed))

    def pause_decode(self, request_id: str, drop_state: bool) -> None:
        pause = worker_pb2.PauseDecode(request_id=request_id, drop_state=drop_state)
        self._outbox.put_nowait(worker_pb2.ControlMessage(pause_decode=pause))

    def resume(self, request_id: str) -> None:
        resume = worker_pb2.Resume(request_id=request_id)
        self._outbox.put_nowait(worker_pb2.ControlMessage(resume=resume))

    def preempt(self, request_id: str, drop_state: bool) -> None:
        # Logged when decided: a preemption that the worker acknowledges late, or never, shows.
        log.info("preempt sent", request_id=request_id, drop_state=drop_state)
        preempt = worker_pb2.Preempt(request_id=request_id, drop_state=drop_state)
        self._outbox.put_nowait(worker_pb2.ControlMessage(preempt=preempt))

    def cancel(self, request_id: str) -> None:
        cancel = worker_pb2.Cancel(request_id=request_id)
        self._outbox.put_nowait(worker_pb2.ControlMessage(cancel=cancel))

    def drain(self) -> None:
        self._outbox.put_nowait(worker_pb2.ControlMessage(drain=worker_pb2.Drain()))


@dataclass
class WorkerSession:
    worker_id: str
    hello: worker_pb2.Hello
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_seen: float = field(default_factory=time.monotonic)
    suspended_bytes: int = 0


class WorkerApi(worker_pb2_grpc.WorkerControlServicer):
    def __init__(
        self,
        core: ServiceCore,
        *,
        heartbeat_timeout_s: float = QueueServiceConfig.heartbeat_timeout_s,
        trust: Trust = PLAINTEXT,
    ) -> None:
        self.core = core
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.trust = trust
        self.sessions: dict[str, WorkerSession] = {}

    async def Attach(
        self,
        request_iterator: AsyncIterator[worker_pb2.WorkerMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.ControlMessage]:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("event") != "hello" or not first.hello.worker_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "first message must be Hello")
        hello = first.hello
        refusal = self.trust.refuses_attach(context, hello.worker_id)
        if refusal is not None:
            # Before anything changes: a refused peer never replaces the worker of that id.
            log.warning("attach refused", worker_id=hello.worker_id, reason=refusal)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        if hello.kv_slots < 1:
            # A worker from before every worker batched (0 meant "unbatched"): the scheduler
            # has no such worker any more, so it is told, not half-served.
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "worker has no KV slots (an unbatched worker): upgrade it; kv_slots must be >= 1",
            )
        if hello.worker_id in self.sessions:
            # A reconnect after a silent failure: the old session is gone with its state.
            self._drop(hello.worker_id, "replaced by a new connection")
        session = WorkerSession(hello.worker_id, hello)
        self.sessions[hello.worker_id] = session
        log.info(
            "worker attached",
            worker_id=hello.worker_id,
            model=hello.model,
            device=hello.device,
            chunk_size=hello.chunk_size,
            check=hello.check,
            kv_slots=hello.kv_slots,
            max_batch_size=hello.max_batch_size,
        )
        reader = asyncio.create_task(self._read(session, request_iterator))
        try:
            handle = RemoteWorker(session.outbox, self.core)
            budget_s = hello.preempt_budget_ms / 1000
            self.core.worker_joined(hello.worker_id, handle, hello.kv_slots, budget_s)
            while True:
                message = await session.outbox.get()
                if message is _CLOSE:
                    return
                yield message
        finally:
            reader.cancel()
            self._drop(hello.worker_id, "stream ended", session)

    async def _read(self, session: WorkerSession, stream) -> None:
        try:
            async for message in stream:
                session.last_seen = time.monotonic()
                if message.WhichOneof("event") == "heartbeat":
                    session.suspended_bytes = message.heartbeat.suspended_bytes
                    continue
                self.core.on_worker_message(session.worker_id, message)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            session.outbox.put_nowait(_CLOSE)

    def _drop(self, worker_id: str, why: str, session: WorkerSession | None = None) -> None:
        current = self.sessions.get(worker_id)
        if current is None or (session is not None and current is not session):
            return
        del self.sessions[worker_id]
        current.outbox.put_nowait(_CLOSE)
        log.warning("worker detached", worker_id=worker_id, why=why)
        self.core.worker_left(worker_id)

    async def watch_heartbeats(self) -> None:
        """Runs for the life of the server: drops workers that went silent."""
        interval = self.heartbeat_timeout_s / 3
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for worker_id, session in list(self.sessions.items()):
                if now - session.last_seen > self.heartbeat_timeout_s:
                    self._drop(worker_id, "missed heartbeats", session)
