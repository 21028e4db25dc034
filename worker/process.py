"""The worker process: one per device, attached to the queue service by one control stream.

It loads the model once, builds the engine (``worker.batch_engine``) and its runner
(``worker.batch_runner``: one prefill at a time, preemptible at layer boundaries, while every
request past its first token decodes in one batch; ``kv_slots`` 1 serves one request at a
time), and dials ``WorkerControl.Attach``. Threads:

* the control thread dials, sends ``Hello`` first, then reads ``ControlMessage``s and calls the
  runner the moment each arrives. A ``Preempt`` raises the engine's preemption flag from this
  thread (``BatchRunner.preempt``): no queue stands between the wire and the layer loop, which
  reads the flag at its next boundary.
* the engine thread reports what it did through ``_on_event``; each event is
  converted by ``worker.wire`` and queued on the session's outgoing queue, which the stream's
  request iterator drains (gRPC sends it from its own thread).
* a heartbeat thread per session reports suspended bytes and the running request.

``run`` (the worker's command) runs the engine on the main thread, the one that loaded the
model, and watches for a drain on a thread of its own: on a CPU, torch's parallel ops are
slower on any other thread once the main thread has run some (``worker.batch_runner``).
``start`` runs everything on threads, for tests that hold a worker in their own process.

If the stream breaks, everything the engine holds is cancelled and freed before the worker
dials again: the queue service re-queues those requests when it sees the worker leave, and a
new session must start from an empty engine (a request re-assigned under the same id must never
meet its own old task). Redials back off exponentially, with jitter.
"""

from __future__ import annotations

import threading
import time

import grpc
import structlog

from tierflow.identity import Identity, TlsFiles, open_channel
from tierflow.metrics import serve_metrics
from tierflow.v1 import worker_pb2, worker_pb2_grpc
from worker import wire
from worker.backoff import Backoff
from worker.batch_engine import BatchEngine
from worker.batch_runner import BatchRunner
from worker.config import WorkerConfig
from worker.event_log import log_event
from worker.events import Cancelled, Failed, Finished, RunnerEvent
from worker.health import HealthEndpoint
from worker.metrics import WorkerMetrics
from worker.models import LoadedModel, load_model
from worker.request import GenerationRequest, InvalidRequestError
from worker.session import Session

log = structlog.get_logger(__name__)

# A session that lasted this long, or received a command, was healthy: the backoff restarts.
_HEALTHY_SESSION_S = 10.0
# channel_ready_future watches the channel from a gRPC thread that notices it is no longer
# needed only at its next 0.2 s poll; closing the channel before then makes that thread raise
# "Channel closed!" (grpc/grpc#29848). Closing waits this long after the last wait settled.
_CONNECTIVITY_POLL_S = 0.25


class WorkerProcess:
    """The worker: ``run()`` blocks until ``stop()`` (or a drain) and returns the exit code.

    ``loaded_model`` skips loading (tests share one loaded model); ``config.model`` and
    ``config.device`` are then ignored.
    """

    def __init__(self, config: WorkerConfig, *, loaded_model: LoadedModel | None = None) -> None:
        self.config = config
        self._log = log.bind(worker_id=config.worker_id)
        started = time.perf_counter()
        self.model = loaded_model or load_model(config.model, device=config.device)
        self.engine = BatchEngine(self.model.model, config.engine_config(), config.batch_config())
        self._log.info(
            "engine ready",
            model=self.model.name,
            device=str(self.engine.device),
            dtype=str(self.engine.dtype).removeprefix("torch."),
            layers=len(self.engine.layers),
            chunk_size=config.chunk_size,
            check=config.check,
            kv_slots=config.kv_slots,
            load_s=round(time.perf_counter() - started, 3),
        )
        name = f"engine-{config.worker_id}"
        self.runner = BatchRunner(self.engine, self._on_event, name=name)
        self.metrics = WorkerMetrics(config.deployment, config.worker_id)
        self.metrics_endpoint = None
        self.health_endpoint: HealthEndpoint | None = None
        self._hello = wire.hello(config.worker_id, self.model.name, self.engine)
        self._cond = threading.Condition()
        # Guarded by _cond:
        self._held: set[str] = set()  # assigned and not yet finished, cancelled or failed
        self._session: Session | None = None
        self._connecting: grpc.Future | None = None
        self._draining = False  # the queue service sent Drain: no new request follows
        self._stopping = threading.Event()
        self._drain_asked = threading.Event()  # drain() was called (SIGTERM)
        self._ready_settled_at = 0.0  # monotonic time the last wait for a connection ended
        # Daemon: should the main thread die without stop(), a dangling stream must not keep
        # the process alive.
        self._thread = threading.Thread(
            target=self._control_loop, name="worker-control", daemon=True
        )

    # ------------------------------------------------------------ lifecycle (any thread)

    def start(self) -> WorkerProcess:
        """Start the worker with its engine on a thread of its own; returns at once."""
        self.runner.start()
        self._start_services()
        return self

    def _start_services(self) -> None:
        """Everything but the engine loop: metrics, health, the control thread."""
        self.metrics.start_sampling(
            lambda: self.runner.running_request_id,
            self.runner.busy.seconds,
            lambda: self.runner.suspended_bytes,
            lambda: len(self._held),
            decoding=lambda: len(self.engine.rows),
        )
        self.metrics_endpoint = serve_metrics(
            self.metrics.registry, self.config.metrics_port, self.config.metrics_host
        )
        if self.config.health_port is not None:
            self.health_endpoint = HealthEndpoint(
                self.config.health_host, self.config.health_port, self.ready, self.alive
            ).start()
        self._thread.start()

    def ready(self) -> bool:
        """Attached to a queue service, and not shutting down (``worker.health``)."""
        with self._cond:
            attached = self._session is not None
        return attached and not (self._draining or self._drain_asked.is_set())

    def alive(self) -> bool:
        """The engine thread and the control thread run (``worker.health``)."""
        return self.runner.alive and self._thread.is_alive()

    def stop(self) -> None:
        """Ask the worker to shut down; returns at once (safe in a signal handler)."""
        self._stopping.set()
        with self._cond:
            session, connecting = self._session, self._connecting
        if connecting is not None:
            connecting.cancel()
        if session is not None:
            session.cancel()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the worker has shut down (stopped, or drained)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def drain(self) -> None:
        """Shut down gracefully (SIGTERM); returns at once (safe in a signal handler).

        ``run`` then tells the queue service, which sends no new request and answers Drain;
        the worker finishes what it holds (running, decoding, suspended), closes its stream
        and exits. After ``config.drain_timeout_s`` it stops anyway: what it still holds is
        cancelled and reruns elsewhere, as when a worker is lost."""
        self._drain_asked.set()

    def run(self) -> int:
        """The worker's command: the engine loop on this (the main) thread until the worker
        stops; a second thread turns a SIGTERM's ``drain`` into a drain of the session."""
        self._start_services()
        threading.Thread(target=self._watch_for_drain, name="worker-drain", daemon=True).start()
        try:
            self.runner.run()  # returns once the control loop stops it
        finally:
            self.stop()  # after an engine bug, ends the control loop too (else a no-op)
            self.wait()
        return 0

    def _watch_for_drain(self) -> None:
        while not self.wait(0.1):
            if self._drain_asked.is_set():
                self._drain_or_stop()

    def _drain_or_stop(self) -> None:
        """Ask the queue service for no new work, then wait for the drain to end the session;
        past ``drain_timeout_s`` (or when not attached) stop instead."""
        with self._cond:
            session, held = self._session, len(self._held)
        if session is None:  # not attached: nothing to finish, nobody to tell
            self._log.info("draining while detached: stopping")
            self.stop()
            return
        self._log.info("draining", requests=held, timeout_s=self.config.drain_timeout_s)
        session.send(wire.draining())
        give_up_at = time.monotonic() + self.config.drain_timeout_s
        while not self.wait(0.1):
            if time.monotonic() > give_up_at:
                with self._cond:
                    held_ids = sorted(self._held)
                self._log.warning("drain timed out; stopping", requests=held_ids)
                self.stop()
                return

    # ------------------------------------------------------------ control thread

    def _channel(self) -> grpc.Channel:
        """To the queue service: with this worker's identity under mTLS, else plaintext."""
        # gRPC's own redial schedule while the queue service is down, in our bounds.
        options = [
            ("grpc.initial_reconnect_backoff_ms", int(self.config.reconnect_min_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(self.config.reconnect_max_s * 1000)),
        ]
        credentials = None
        if self.config.tls_dir is not None:
            tls = TlsFiles.load(self.config.tls_dir, Identity.worker(self.config.worker_id))
            credentials = tls.channel_credentials()
        return open_channel(self.config.queue_service, credentials, options)

    def _control_loop(self) -> None:
        backoff = Backoff(self.config.reconnect_min_s, self.config.reconnect_max_s)
        channel = self._channel()
        try:
            while not self._stopping.is_set():
                healthy = self._attach_once(channel)
                self._release_held()
                if self._stopping.is_set() or self._draining or self._drain_asked.is_set():
                    break  # a worker that is shutting down does not dial again
                if healthy:
                    backoff.reset()
                delay = backoff.next_delay()
                self._log.warning("reconnecting", delay_s=round(delay, 3))
                self._stopping.wait(delay)
        except Exception:
            self._log.exception("control loop failed")
            raise
        finally:
            self._release_held()
            self.runner.stop()
            self.metrics.stop()
            if self.metrics_endpoint is not None:
                self.metrics_endpoint.close()
            if self.health_endpoint is not None:
                self.health_endpoint.close()
            time.sleep(max(0.0, self._ready_settled_at + _CONNECTIVITY_POLL_S - time.monotonic()))
            channel.close()
            self._log.info("stopped", drained=self._draining)

    def _attach_once(self, channel: grpc.Channel) -> bool:
        """One session: wait for the queue service, send Hello, serve commands until the stream
        ends. True when the session was healthy (so the redial backoff can start over)."""
        if not self._wait_for_queue_service(channel):
            return False
        session = self._open_session(channel)
        heartbeats = threading.Thread(
            target=self._heartbeats, args=(session,), name="worker-heartbeat", daemon=True
        )
        heartbeats.start()
        try:
            self._serve(session)
        finally:
            with self._cond:
                self._session = None  # from here on, events of this session go nowhere
            session.end()
            session.cancel()
            heartbeats.join()
        lasted = time.monotonic() - session.started
        return session.received > 0 or lasted >= _HEALTHY_SESSION_S

    def _wait_for_queue_service(self, channel: grpc.Channel) -> bool:
        """Block until the channel connects; False when stop() cancelled the wait."""
        self._log.info("connecting", queue_service=self.config.queue_service)
        ready = grpc.channel_ready_future(channel)
        with self._cond:
            self._connecting = ready
        if self._stopping.is_set():  # stop() may have run before _connecting was set
            ready.cancel()
        try:
            ready.result()
            return True
        except grpc.FutureCancelledError:
            return False
        finally:
            with self._cond:
                self._connecting = None
            self._ready_settled_at = time.monotonic()

    def _open_session(self, channel: grpc.Channel) -> Session:
        session = Session(self._hello)
        session.call = worker_pb2_grpc.WorkerControlStub(channel).Attach(session.outgoing())
        with self._cond:
            self._session = session
        if self._stopping.is_set():  # stop() may have run before _session was set
            session.cancel()
        self._log.info(
            "attached",
            queue_service=self.config.queue_service,
            metrics_port=self.metrics_endpoint.port if self.metrics_endpoint else None,
            model=self.model.name,
            device=str(self.engine.device),
        )
        return session

    def _serve(self, session: Session) -> None:
        """Run each command as it arrives, until the stream ends or breaks."""
        try:
            for message in session.call:
                session.received += 1
                try:
                    self._handle(message, session)
                except Exception:  # a bug in one command must not take the worker down
                    self._log.exception("command failed", command=message.WhichOneof("command"))
            if self._draining:
                self._log.info("stream closed after the drain")
            else:
                self._log.warning("stream closed by the queue service")
        except grpc.RpcError as exc:
            if not self._stopping.is_set():
                self._log.warning("stream broken", code=exc.code().name, details=exc.details())

    def _handle(self, message: worker_pb2.ControlMessage, session: Session) -> None:
        command = message.WhichOneof("command")
        # Preempt first: it is the command whose latency counts.
        if command == "preempt":
            preempt = message.preempt
            if not self.runner.preempt(preempt.request_id, drop_state=preempt.drop_state):
                self._log.info("preempt ignored: not running", request_id=preempt.request_id)
        elif command == "assign":
            self._assign(message.assign)
        elif command == "assign_packed":
            self._assign_packed(message.assign_packed)
        elif command == "pause_decode":
            self._pause_decode(message.pause_decode)
        elif command == "resume":
            self._resume(message.resume.request_id)
        elif command == "cancel":
            self._cancel(message.cancel.request_id)
        elif command == "drain":
            self._drain(session)
        else:
            self._log.warning("unknown command ignored", command=command)

    def _assign(self, assign: worker_pb2.Assign) -> None:
        request = self._accept(assign)
        if request is None:
            return
        try:  # an invalid prompt comes back at once as Failed
            self.runner.assign(request, wire.tbt_slo_s(assign))
        except Exception as exc:
            self._failed(request.request_id, exc)

    def _assign_packed(self, packed: worker_pb2.AssignPacked) -> None:
        """Several prompts to prefill in one forward."""
        accepted = [(a, r) for a in packed.members if (r := self._accept(a)) is not None]
        if not accepted:
            return
        requests = [r for _, r in accepted]
        try:
            self.runner.assign_packed(requests, [wire.tbt_slo_s(a) for a, _ in accepted])
        except Exception as exc:
            for request in requests:
                self._failed(request.request_id, exc)

    def _accept(self, assign: worker_pb2.Assign) -> GenerationRequest | None:
        """The engine's request, now held; None when refused (reported as Failed)."""
        request_id = assign.request_id
        try:
            request = wire.request_from_assign(assign)
        except InvalidRequestError as exc:
            self._on_event(Failed(request_id, str(exc), True, time.perf_counter()))
            return None
        with self._cond:
            # A held id is assigned again only after its state was dropped (recompute policy,
            # memory cap): the runner then recomputes its own task (BatchRunner.assign).
            draining = self._draining and request_id not in self._held
            if not draining:
                self._held.add(request_id)
        if draining:
            # Not invalid_request: the queue service should run it elsewhere.
            self._on_event(Failed(request_id, "worker is draining", False, time.perf_counter()))
            return None
        self._log.info(
            "assigned",
            request_id=request_id,
            prompt_tokens=len(request.prompt_ids),
            max_new_tokens=request.max_new_tokens,
        )
        return request

    def _failed(self, request_id: str, exc: Exception) -> None:
        self._on_event(
            Failed(request_id, f"{type(exc).__name__}: {exc}", False, time.perf_counter())
        )

    def _pause_decode(self, pause: worker_pb2.PauseDecode) -> None:
        self.runner.pause_decode(pause.request_id, drop_state=pause.drop_state)

    def _resume(self, request_id: str) -> None:
        with self._cond:
            held = request_id in self._held
        if not held:
            self._log.info("resume ignored: not held", request_id=request_id)
            return
        self._log.info("resumed", request_id=request_id)
        self.runner.resume(request_id)

    def _cancel(self, request_id: str) -> None:
        with self._cond:
            held = request_id in self._held
        if not held:
            self._log.info("cancel ignored: not held", request_id=request_id)
            return
        self.runner.cancel(request_id)

    def _drain(self, session: Session) -> None:
        with self._cond:
            self._draining = True
            idle = not self._held
            held = len(self._held)
        self._log.info("drain acknowledged", requests=held)
        if idle:
            session.close_after_drain()

    def _release_held(self) -> None:
        """Cancel whatever the engine still holds and, unless stopping, wait until it is freed."""
        with self._cond:
            held = sorted(self._held)
        if not held:
            return
        self._log.warning("cancelling requests of the ended session", requests=held)
        for request_id in held:
            self.runner.cancel(request_id)
        with self._cond:
            # On stop, runner.stop() finishes the job: the queued cancels run before it ends.
            while self._held and not self._stopping.is_set():
                self._cond.wait(0.1)

    def _heartbeats(self, session: Session) -> None:
        while not session.ended.wait(self.config.heartbeat_interval_s):
            session.send(
                wire.heartbeat(self.runner.suspended_bytes, self.runner.running_request_id)
            )

    # ------------------------------------------------------------ engine thread

    def _on_event(self, event: RunnerEvent) -> None:
        """Called on the engine thread (and on the control thread for refused assigns)."""
        request_id = event.request_id
        drained = False
        with self._cond:
            session = self._session
            if isinstance(event, Finished | Cancelled | Failed):
                self._held.discard(request_id)
                if not self._held:
                    self._cond.notify_all()
                    drained = self._draining
        if session is not None:
            session.send(wire.event_message(event))
            if drained:
                session.close_after_drain()
        self.metrics.observe(event)
        log_event(self._log, event)


if __name__ == "__main__":  # `python -m worker.process`: what the stack, compose and tests run
    from worker.cli import main

    raise SystemExit(main())
