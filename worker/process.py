"""The worker process: one per device, attached to the queue service by one control stream.

It loads the model once, builds the preemptible engine and its runner (``worker.runner``), and
dials ``WorkerControl.Attach``. Threads:

* the control thread dials, sends ``Hello`` first, then reads ``ControlMessage``s and calls the
  runner the moment each arrives. A ``Preempt`` raises the engine's preemption flag from this
  thread (``EngineRunner.preempt``): no queue stands between the wire and the layer loop, which
  reads the flag at its next boundary.
* the engine thread (the runner's) reports what it did through ``_on_event``; each event is
  converted by ``worker.wire`` and queued on the session's outgoing queue, which the stream's
  request iterator drains (gRPC sends it from its own thread).
* a heartbeat thread per session reports suspended bytes and the running request.

If the stream breaks, everything the engine holds is cancelled and freed before the worker
dials again: the queue service re-queues those requests when it sees the worker leave, and a
new session must start from an empty engine (a request re-assigned under the same id must never
meet its own old task). Redials back off exponentially, with jitter.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Any

import grpc
import structlog

from tierflow.logging import configure_logging
from tierflow.v1 import worker_pb2, worker_pb2_grpc
from worker import wire
from worker.engine import CheckGranularity, EngineConfig, PrefillEngine
from worker.events import (
    Cancelled,
    Failed,
    Finished,
    FirstToken,
    Preempted,
    RunnerEvent,
)
from worker.models import LoadedModel, ModelLoadError, load_model
from worker.request import InvalidRequestError
from worker.runner import EngineRunner

log = structlog.get_logger(__name__)

# After a drain the worker half-closes its side and waits for the queue service to end the
# stream; a queue service that never does is cut off after this long.
_DRAIN_CLOSE_GRACE_S = 5.0
# A session that lasted this long, or received a command, was healthy: the backoff restarts.
_HEALTHY_SESSION_S = 10.0
# channel_ready_future watches the channel from a gRPC thread that notices it is no longer
# needed only at its next 0.2 s poll; closing the channel before then makes that thread raise
# "Channel closed!" (grpc/grpc#29848). Closing waits this long after the last wait settled.
_CONNECTIVITY_POLL_S = 0.25


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WorkerConfig:
    queue_service: str  # host:port of the queue service's WorkerControl server
    worker_id: str = field(default_factory=_default_worker_id)
    model: str = "tiny-llama"  # preset, local directory or hub id (worker.models.load_model)
    device: str | None = None  # None: CUDA when available, else CPU
    chunk_size: int | None = 2048  # None: the whole prompt is one chunk
    check: CheckGranularity = "layer"
    memory_cap_bytes: int = 4 << 30  # all suspended requests together
    heartbeat_interval_s: float = 0.5
    reconnect_min_s: float = 0.1
    reconnect_max_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.queue_service:
            raise ValueError("queue_service address is empty")
        if not self.worker_id:
            raise ValueError("worker_id is empty")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if not 0 < self.reconnect_min_s <= self.reconnect_max_s:
            raise ValueError(
                "need 0 < reconnect_min_s <= reconnect_max_s, got "
                f"{self.reconnect_min_s} and {self.reconnect_max_s}"
            )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            chunk_size=self.chunk_size, check=self.check, memory_cap_bytes=self.memory_cap_bytes
        )


class Backoff:
    """Exponential backoff with jitter: min, 2*min, 4*min ... up to max, each drawn from
    [d/2, d] so that workers that lost the same queue service do not redial in lockstep."""

    def __init__(self, min_s: float, max_s: float, rng: random.Random | None = None) -> None:
        self.min_s, self.max_s = min_s, max_s
        self._rng = rng or random.Random()
        self._attempt = 0

    def next_delay(self) -> float:
        ceiling = min(self.max_s, self.min_s * 2 ** min(self._attempt, 32))
        self._attempt += 1
        return self._rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self._attempt = 0


class _Session:
    """One Attach stream: the outgoing queue its request iterator drains, and the call."""

    def __init__(self, hello: worker_pb2.WorkerMessage) -> None:
        self._out: SimpleQueue[worker_pb2.WorkerMessage | None] = SimpleQueue()
        self._out.put(hello)  # queued before anything else can be: Hello is always first
        self._lock = threading.Lock()
        self._half_closed = False
        self._drain_timer: threading.Timer | None = None
        self.ended = threading.Event()
        self.call: Any = None  # grpc's stream-stream call: an iterator with cancel()
        self.started = time.monotonic()
        self.received = 0

    def outgoing(self) -> Iterator[worker_pb2.WorkerMessage]:
        while (message := self._out.get()) is not None:
            yield message

    def send(self, message: worker_pb2.WorkerMessage) -> None:
        with self._lock:
            if not self._half_closed:
                self._out.put(message)

    def close_after_drain(self) -> None:
        """Half-close once everything queued is sent; cut the call if it is not ended soon."""
        with self._lock:
            if self._half_closed:
                return
            self._half_closed = True
            self._out.put(None)
            self._drain_timer = threading.Timer(_DRAIN_CLOSE_GRACE_S, self.cancel)
            self._drain_timer.daemon = True
            self._drain_timer.start()

    def cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()

    def end(self) -> None:
        self.ended.set()
        with self._lock:
            self._half_closed = True
            if self._drain_timer is not None:
                self._drain_timer.cancel()
        # Releases gRPC's thread blocked in ``outgoing`` (it reads until the iterator ends).
        self._out.put(None)


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
        self.engine = PrefillEngine(self.model.model, config.engine_config())
        self._log.info(
            "engine ready",
            model=self.model.name,
            device=str(self.engine.device),
            dtype=str(self.engine.dtype).removeprefix("torch."),
            layers=len(self.engine.layers),
            chunk_size=config.chunk_size,
            check=config.check,
            load_s=round(time.perf_counter() - started, 3),
        )
        self.runner = EngineRunner(self.engine, self._on_event, name=f"engine-{config.worker_id}")
        self._hello = wire.hello(config.worker_id, self.model.name, self.engine)
        self._cond = threading.Condition()
        # Guarded by _cond:
        self._held: set[str] = set()  # assigned and not yet finished, cancelled or failed
        self._session: _Session | None = None
        self._connecting: grpc.Future | None = None
        self._draining = False
        self._stopping = threading.Event()
        self._ready_settled_at = 0.0  # monotonic time the last wait for a connection ended
        # Daemon: should the main thread die without stop(), a dangling stream must not keep
        # the process alive.
        self._thread = threading.Thread(
            target=self._control_loop, name="worker-control", daemon=True
        )

    # ------------------------------------------------------------ lifecycle (any thread)

    def start(self) -> WorkerProcess:
        self.runner.start()
        self._thread.start()
        return self

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

    def run(self) -> int:
        self.start()
        # Short waits keep the calling (main) thread responsive to signals.
        while not self.wait(0.5):
            pass
        return 0

    # ------------------------------------------------------------ control thread

    def _control_loop(self) -> None:
        backoff = Backoff(self.config.reconnect_min_s, self.config.reconnect_max_s)
        channel = grpc.insecure_channel(
            self.config.queue_service,
            # gRPC's own redial schedule while the queue service is down, in our bounds.
            options=[
                ("grpc.initial_reconnect_backoff_ms", int(self.config.reconnect_min_s * 1000)),
                ("grpc.max_reconnect_backoff_ms", int(self.config.reconnect_max_s * 1000)),
            ],
        )
        try:
            while not self._stopping.is_set():
                healthy = self._attach_once(channel)
                self._release_held()
                if self._stopping.is_set() or self._draining:
                    break
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
            time.sleep(max(0.0, self._ready_settled_at + _CONNECTIVITY_POLL_S - time.monotonic()))
            channel.close()
            self._log.info("stopped", drained=self._draining)

    def _attach_once(self, channel: grpc.Channel) -> bool:
        """One session: wait for the queue service, send Hello, serve commands until the stream
        ends. True when the session was healthy (so the redial backoff can start over)."""
        self._log.info("connecting", queue_service=self.config.queue_service)
        ready = grpc.channel_ready_future(channel)
        with self._cond:
            self._connecting = ready
        if self._stopping.is_set():  # stop() may have run before _connecting was set
            ready.cancel()
        try:
            ready.result()
        except grpc.FutureCancelledError:
            return False
        finally:
            with self._cond:
                self._connecting = None
            self._ready_settled_at = time.monotonic()
        session = _Session(self._hello)
        session.call = worker_pb2_grpc.WorkerControlStub(channel).Attach(session.outgoing())
        with self._cond:
            self._session = session
        if self._stopping.is_set():  # stop() may have run before _session was set
            session.cancel()
        heartbeats = threading.Thread(
            target=self._heartbeats, args=(session,), name="worker-heartbeat", daemon=True
        )
        heartbeats.start()
        self._log.info(
            "attached",
            queue_service=self.config.queue_service,
            model=self.model.name,
            device=str(self.engine.device),
        )
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
        finally:
            with self._cond:
                self._session = None  # from here on, events of this session go nowhere
            session.end()
            session.cancel()
            heartbeats.join()
        lasted = time.monotonic() - session.started
        return session.received > 0 or lasted >= _HEALTHY_SESSION_S

    def _handle(self, message: worker_pb2.ControlMessage, session: _Session) -> None:
        command = message.WhichOneof("command")
        # Preempt first: it is the command whose latency counts.
        if command == "preempt":
            preempt = message.preempt
            if not self.runner.preempt(preempt.request_id, drop_state=preempt.drop_state):
                self._log.info("preempt ignored: not running", request_id=preempt.request_id)
        elif command == "assign":
            self._assign(message.assign)
        elif command == "resume":
            self._resume(message.resume.request_id)
        elif command == "cancel":
            self._cancel(message.cancel.request_id)
        elif command == "drain":
            self._drain(session)
        else:
            self._log.warning("unknown command ignored", command=command)

    def _assign(self, assign: worker_pb2.Assign) -> None:
        request_id = assign.request_id
        try:
            request = wire.request_from_assign(assign)
        except InvalidRequestError as exc:
            self._on_event(Failed(request_id, str(exc), True, time.perf_counter()))
            return
        with self._cond:
            draining = self._draining
            duplicate = request_id in self._held
            if not (draining or duplicate):
                self._held.add(request_id)
        if duplicate:
            # The scheduler assigns a request again to the worker that holds it only after its
            # state was dropped (recompute policy, memory cap): run the held task again, from
            # token 0. A second task under a live id would corrupt the first.
            self._log.info("re-assigned after its state was dropped", request_id=request_id)
            self.runner.resume(request_id)
            return
        if draining:
            # Not invalid_request: the queue service should run it elsewhere.
            self._on_event(Failed(request_id, "worker is draining", False, time.perf_counter()))
            return
        self._log.info(
            "assigned",
            request_id=request_id,
            prompt_tokens=len(request.prompt_ids),
            max_new_tokens=request.max_new_tokens,
        )
        try:
            self.runner.assign(request)  # an invalid prompt comes back at once as Failed
        except Exception as exc:
            self._on_event(
                Failed(request_id, f"{type(exc).__name__}: {exc}", False, time.perf_counter())
            )

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

    def _drain(self, session: _Session) -> None:
        with self._cond:
            self._draining = True
            idle = not self._held
            held = len(self._held)
        self._log.info("draining", requests=held)
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

    def _heartbeats(self, session: _Session) -> None:
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
        self._log_event(event)

    def _log_event(self, event: RunnerEvent) -> None:
        # One line per event of interest; never per chunk or per token.
        match event:
            case FirstToken():
                self._log.info(
                    "first token",
                    request_id=event.request_id,
                    prefill_busy_ms=round(event.prefill_busy_s * 1000, 3),
                    prompt_tokens=event.prompt_tokens,
                )
            case Preempted():
                point = event.resume_point
                self._log.info(
                    "preempted",
                    request_id=event.request_id,
                    latency_ms=round(wire.preemption_latency_ms(event), 3),
                    chunk=point.chunk,
                    layer=point.layer,
                    half=point.half,
                    tokens_done=point.tokens_done,
                    held_bytes=event.held_bytes,
                    state_dropped=event.state_dropped,
                )
            case Finished():
                self._log.info(
                    "finished",
                    request_id=event.request_id,
                    output_tokens=len(event.output_ids),
                    busy_ms=round(event.busy_s * 1000, 3),
                    preemptions=event.preemptions,
                )
            case Cancelled():
                self._log.info("cancelled", request_id=event.request_id)
            case Failed():
                self._log.warning(
                    "failed",
                    request_id=event.request_id,
                    error=event.error,
                    invalid_request=event.invalid_request,
                )


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m worker.process",
        description="Run one worker: attach to the queue service and serve its commands.",
    )
    parser.add_argument(
        "--queue-service", required=True, help="host:port of the queue service (WorkerControl)"
    )
    parser.add_argument("--worker-id", help="default: <hostname>-<pid>")
    parser.add_argument("--model", default="tiny-llama", help="preset, local directory or hub id")
    parser.add_argument("--device", help="cuda, cuda:1, cpu ... (default: cuda when present)")
    parser.add_argument(
        "--chunk-size", type=int, default=2048, help="prefill chunk in tokens; 0: whole prompt"
    )
    parser.add_argument(
        "--check",
        choices=("half", "layer", "chunk", "none"),
        default="layer",
        help="where the engine reads the preemption flag",
    )
    parser.add_argument(
        "--memory-cap-bytes",
        type=int,
        default=4 << 30,
        help="cap on what suspended requests hold together",
    )
    parser.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds")
    parser.add_argument("--reconnect-min", type=float, default=0.1, help="seconds")
    parser.add_argument("--reconnect-max", type=float, default=5.0, help="seconds")
    return parser


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    return WorkerConfig(
        queue_service=args.queue_service,
        model=args.model,
        device=args.device,
        chunk_size=args.chunk_size or None,
        check=args.check,
        memory_cap_bytes=args.memory_cap_bytes,
        heartbeat_interval_s=args.heartbeat_interval,
        reconnect_min_s=args.reconnect_min,
        reconnect_max_s=args.reconnect_max,
        **extra,
    )


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging(json=True)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    main_log = log.bind(worker_id=config.worker_id)

    # Installed before the (slow) model load, so a SIGTERM then still exits cleanly.
    stop_requested = threading.Event()
    worker: WorkerProcess | None = None

    def on_signal(signum: int, _frame: object) -> None:
        main_log.info("signal received, shutting down", signal=signal.Signals(signum).name)
        stop_requested.set()
        if worker is not None:
            worker.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        worker = WorkerProcess(config)
    except ModelLoadError as exc:
        main_log.error("cannot load the model", model=config.model, error=str(exc))
        return 1
    if stop_requested.is_set():
        return 0
    return worker.run()


if __name__ == "__main__":
    raise SystemExit(main())
