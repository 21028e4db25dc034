"""The worker process against a real gRPC server standing in for the queue service.

A small ``WorkerControl`` servicer runs in-process on 127.0.0.1 (port 0); the worker is a real
``WorkerProcess`` on the tiny-llama model, dialing it over a real channel. To make a Preempt land
mid-prefill whatever the machine's speed, a forward pre-hook holds the engine thread inside one
decoder layer (sleeping, so the GIL is free) until the preemption flag is raised or the test
releases it. Tests assert orderings, not times: CI runs on two shared cores.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierflow.v1 import serving_pb2, worker_pb2, worker_pb2_grpc
from worker import wire
from worker.backoff import Backoff
from worker.batch_engine import BatchEngine
from worker.config import BatchConfig, EngineConfig, WorkerConfig
from worker.events import Preempted
from worker.health import LIVENESS
from worker.process import WorkerProcess
from worker.request import InvalidRequestError
from worker.task import ResumePoint

WAIT_S = 30.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- the stand-in queue service


@dataclass(frozen=True)
class Received:
    seq: int  # position on the stream, heartbeats included
    kind: str
    body: Any


class FakeSession:
    """One Attach stream as the queue service sees it."""

    def __init__(self) -> None:
        self._seq = itertools.count()
        self._events: queue.Queue[Received | None] = queue.Queue()  # None: the stream ended
        self._heartbeats: queue.Queue[Received] = queue.Queue()
        self.outbox: queue.Queue[worker_pb2.ControlMessage | None] = queue.Queue()

    def receive(self, message: worker_pb2.WorkerMessage | None) -> None:
        if message is None:
            self._events.put(None)
            return
        kind = message.WhichOneof("event")
        item = Received(next(self._seq), kind, getattr(message, kind))
        (self._heartbeats if kind == "heartbeat" else self._events).put(item)

    def send(self, **command: Any) -> None:
        self.outbox.put(worker_pb2.ControlMessage(**command))

    def close(self) -> None:
        self.outbox.put(None)

    def next(self) -> Received | None:
        return self._events.get(timeout=WAIT_S)

    def until(self, kind: str, *, layer_progress: bool = False) -> list[Received]:
        """Every event (not heartbeat) up to and including the first ``kind``; progress
        reports from inside a chunk only if ``layer_progress``."""
        seen: list[Received] = []
        while True:
            item = self.next()
            assert item is not None, f"stream ended before {kind}; saw {[r.kind for r in seen]}"
            inside_chunk = item.kind == "progress" and item.body.layers_done > 0
            if layer_progress or not inside_chunk:
                seen.append(item)
            if item.kind == kind:
                return seen

    def heartbeat(self, where: Callable[[Any], bool], after_seq: int = -1) -> Received:
        """The first heartbeat sent after ``after_seq`` for which ``where(body)`` holds."""
        deadline = time.monotonic() + WAIT_S
        while True:
            item = self._heartbeats.get(timeout=max(0.0, deadline - time.monotonic()))
            if item.seq > after_seq and where(item.body):
                return item


class FakeQueueService(worker_pb2_grpc.WorkerControlServicer):
    def __init__(self) -> None:
        self.sessions: queue.Queue[FakeSession] = queue.Queue()
        self._all: list[FakeSession] = []
        self.address = ""

    def Attach(self, request_iterator, context):
        session = FakeSession()
        self._all.append(session)
        # The handler ends when the worker goes: unblock its wait for the next command.
        context.add_callback(session.close)

        def pump() -> None:
            try:
                for message in request_iterator:
                    session.receive(message)
            except Exception:  # the stream was cancelled or broke: it ended all the same
                pass
            finally:
                session.receive(None)
                session.close()  # as the queue service does: the worker's side ended, so end ours

        threading.Thread(target=pump, name="fake-pump", daemon=True).start()
        self.sessions.put(session)
        while (command := session.outbox.get()) is not None:
            yield command

    def next_session(self, timeout: float = WAIT_S) -> FakeSession:
        return self.sessions.get(timeout=timeout)

    def close_all(self) -> None:
        for session in self._all:
            session.close()


@pytest.fixture
def queue_service():
    service = FakeQueueService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    worker_pb2_grpc.add_WorkerControlServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    service.address = f"127.0.0.1:{port}"
    yield service
    service.close_all()
    server.stop(None).wait(WAIT_S)


# ---------------------------------------------------------------- the worker under test


class LayerGate:
    """Once armed, holds the engine thread in the pre-hook of one decoder layer's attention
    (called once a layer: a prefill runs a layer as its halves, in one row block each for
    these short chunks; decode steps run their own fused layers) until the preemption flag is
    raised or ``release`` is set. Sleeping there releases the GIL, so the control thread keeps
    receiving commands meanwhile."""

    def __init__(self, layers: torch.nn.ModuleList, worker: WorkerProcess) -> None:
        self._worker = worker
        self._skip: int | None = None
        self.reached = threading.Event()
        self.release = threading.Event()
        self._handles = [layer.self_attn.register_forward_pre_hook(self._hook) for layer in layers]

    def arm(self, after_layers: int) -> None:
        """Hold at the layer call that follows ``after_layers`` calls."""
        self.reached.clear()
        self.release.clear()
        self._skip = after_layers

    def _hook(self, module: torch.nn.Module, args: tuple) -> None:
        if self._skip is None:
            return
        if self._skip > 0:
            self._skip -= 1
            return
        self._skip = None
        self.reached.set()
        deadline = time.monotonic() + WAIT_S
        channel = self._worker.runner.channel
        while channel.signal is None and not self.release.is_set():
            assert time.monotonic() < deadline, "gate was never opened"
            time.sleep(0.001)

    def remove(self) -> None:
        self.release.set()
        for handle in self._handles:
            handle.remove()


@pytest.fixture
def worker(queue_service, tiny_llama):
    config = WorkerConfig(
        queue_service=queue_service.address,
        worker_id="w-test",
        chunk_size=16,
        progress_interval_ms=0,  # every layer's report: the tests read them as steps
        heartbeat_interval_s=0.05,
        reconnect_min_s=0.05,
        reconnect_max_s=0.2,
    )
    process = WorkerProcess(config, loaded_model=tiny_llama)
    # Hooks go on the shared session model: removed below, whatever the test did.
    process.gate = LayerGate(tiny_llama.model.model.layers, process)
    process.start()
    yield process
    process.gate.remove()
    process.stop()
    assert process.wait(WAIT_S), "worker did not stop"


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


def greedy_first_token(loaded, ids: list[int]) -> int:
    with torch.no_grad():
        return int(loaded.model(torch.tensor([ids])).logits[0, -1].argmax())


def assign(request_id: str, ids: list[int], max_new_tokens: int = 1, **sampling: Any):
    return worker_pb2.Assign(
        request_id=request_id,
        prompt_ids=ids,
        max_new_tokens=max_new_tokens,
        sampling=serving_pb2.SamplingParams(**sampling),
    )


def attached(queue_service) -> FakeSession:
    session = queue_service.next_session()
    hello = session.next()
    assert hello is not None and hello.kind == "hello"
    return session


def preempt_mid_prefill(worker, session: FakeSession, request_id: str, ids: list[int]) -> Received:
    """Assign, hold it in layer 1 of chunk 1, see it running, preempt it; the Preempted event."""
    worker.gate.arm(after_layers=5)  # 4 layers of chunk 0, then layer 0 of chunk 1
    session.send(assign=assign(request_id, ids))
    assert worker.gate.reached.wait(WAIT_S)
    session.heartbeat(lambda hb: hb.running_request_id == request_id)
    session.send(preempt=worker_pb2.Preempt(request_id=request_id))
    seen = session.until("preempted")
    assert [r.kind for r in seen] == ["progress", "preempted"]
    assert seen[0].body.tokens_done == 16
    return seen[-1]


# ---------------------------------------------------------------- tests


def test_hello_first_then_assign_streams_progress_first_token_and_done(
    worker, queue_service, tiny_llama
):
    session = queue_service.next_session()
    hello = session.next()
    assert hello.seq == 0 and hello.kind == "hello"
    assert hello.body.worker_id == "w-test"
    assert (hello.body.model, hello.body.device, hello.body.dtype) == (
        "tiny-llama",
        "cpu",
        "float32",
    )
    assert (hello.body.num_layers, hello.body.chunk_size, hello.body.check) == (4, 16, "block")
    assert (hello.body.kv_slots, hello.body.max_batch_size) == (24, 16)  # batched by default
    assert hello.body.preempt_budget_ms == EngineConfig.preempt_budget_ms  # stops within it
    ids = prompt(40, 1)
    expected = greedy_first_token(tiny_llama, ids)

    request = assign("a", ids, max_new_tokens=3)
    request.stop_at_eos = False
    session.send(assign=request)
    seen = session.until("done", layer_progress=True)
    # Progress inside each of the 3 chunks after layers 1, 2 and 3 of 4 (per-layer reports).
    inside = [r.body for r in seen if r.kind == "progress" and r.body.layers_done]
    assert [(p.tokens_done, p.chunk_end, p.layers_done) for p in inside] == [
        (start, min(start + 16, 40), k) for start in (0, 16, 32) for k in (1, 2, 3)
    ]
    assert all(p.num_layers == 4 for p in inside)
    seen = [r for r in seen if not (r.kind == "progress" and r.body.layers_done)]

    assert [r.kind for r in seen] == [
        "progress",
        "progress",
        "first_token",
        "decode_step",
        "decode_step",
        "done",
    ]
    assert [r.body.tokens_done for r in seen[:2]] == [16, 32]
    first, done = seen[2].body, seen[-1].body
    assert first.token_id == expected and first.prompt_tokens == 40 and first.prefill_busy_ms > 0
    steps = [r.body.tokens for r in seen[3:5]]
    assert [[(t.request_id, t.index) for t in step] for step in steps] == [[("a", 1)], [("a", 2)]]
    assert list(done.output_ids) == [expected, steps[0][0].token_id, steps[1][0].token_id]
    assert done.busy_ms > 0 and done.preemptions == 0
    assert all(r.body.request_id == "a" for r in seen if r.kind != "decode_step")


def test_preempt_while_running_then_resume_gives_the_uninterrupted_token(
    worker, queue_service, tiny_llama
):
    session = attached(queue_service)
    ids = prompt(200, 2)
    expected = greedy_first_token(tiny_llama, ids)

    preempted = preempt_mid_prefill(worker, session, "long", ids).body
    # Held in layer 1's attention, chunk 1: it stops at the next boundary, after that half
    # (its 16 rows are one block).
    assert preempted.resume_point == worker_pb2.ResumePoint(
        chunk=1, layer=1, half=1, tokens_done=16
    )
    assert preempted.held_bytes > 0 and not preempted.state_dropped
    assert preempted.latency_ms >= 0
    session.heartbeat(lambda hb: hb.suspended_bytes == preempted.held_bytes)

    session.send(resume=worker_pb2.Resume(request_id="long"))
    seen = session.until("done")
    first = next(r.body for r in seen if r.kind == "first_token")
    assert first.token_id == expected
    assert list(seen[-1].body.output_ids) == [expected] and seen[-1].body.preemptions == 1
    # Progress resumes from the chunk it stopped in: nothing before it is redone.
    progress = [r.body.tokens_done for r in seen if r.kind == "progress"]
    assert progress == list(range(32, 200, 16))


def test_cancel_of_a_suspended_request_frees_its_memory(worker, queue_service):
    session = attached(queue_service)
    preempt_mid_prefill(worker, session, "s", prompt(200, 3))

    session.send(cancel=worker_pb2.Cancel(request_id="s"))
    cancelled = session.until("cancelled")
    assert [r.kind for r in cancelled] == ["cancelled"]
    session.heartbeat(lambda hb: hb.suspended_bytes == 0, after_seq=cancelled[-1].seq)
    assert worker.runner.suspended_bytes == 0

    session.send(assign=assign("next", prompt(20, 4)))
    assert session.until("done")[-1].body.request_id == "next"


def test_invalid_assign_fails_and_the_worker_keeps_serving(worker, queue_service):
    session = attached(queue_service)

    session.send(assign=assign("empty", []))
    failed = session.until("failed")[-1].body
    assert failed.request_id == "empty" and failed.invalid_request and "empty" in failed.error

    session.send(assign=assign("hot", prompt(10, 5), temperature=500.0))
    failed = session.until("failed")[-1].body
    assert failed.request_id == "hot" and failed.invalid_request and "temperature" in failed.error

    session.send(assign=assign("ok", prompt(10, 6)))
    assert session.until("done")[-1].body.request_id == "ok"


def test_stream_closed_by_the_queue_service_frees_everything_and_reconnects(worker, queue_service):
    session = attached(queue_service)
    preempt_mid_prefill(worker, session, "orphan", prompt(200, 7))

    session.close()  # the queue service ends the stream (or restarts)
    assert session.next() is None  # nothing more is sent on the old stream

    again = queue_service.next_session()
    hello = again.next()
    assert hello.seq == 0 and hello.kind == "hello" and hello.body.worker_id == "w-test"
    # The orphan was cancelled and freed before the worker attached again.
    assert again.heartbeat(lambda hb: True).body == worker_pb2.Heartbeat()
    again.send(assign=assign("after", prompt(20, 8)))
    assert again.until("done")[-1].body.request_id == "after"


def test_drain_finishes_running_work_refuses_new_and_exits(worker, queue_service):
    session = attached(queue_service)
    worker.gate.arm(after_layers=0)
    session.send(assign=assign("last", prompt(20, 9)))
    assert worker.gate.reached.wait(WAIT_S)

    session.send(drain=worker_pb2.Drain())
    session.send(assign=assign("late", prompt(20, 10)))
    refused = session.until("failed")[-1].body
    assert refused.request_id == "late" and not refused.invalid_request

    worker.gate.release.set()
    assert session.until("done")[-1].body.request_id == "last"
    assert session.next() is None  # then the worker closes the stream
    assert worker.wait(WAIT_S)
    assert queue_service.sessions.empty()  # and does not come back


def test_main_attaches_and_exits_0_on_sigterm(queue_service):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TIERFLOW_LOG_LEVEL": "INFO"}
    command = [
        sys.executable,
        "-m",
        "worker.process",
        "--queue-service",
        queue_service.address,
        "--model",
        "tiny-llama",
        "--device",
        "cpu",
        "--worker-id",
        "w-main",
        "--plaintext",
    ]
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        session = queue_service.next_session(timeout=180)  # imports torch: slow on busy CPUs
        hello = session.next()
        assert hello.kind == "hello" and hello.body.worker_id == "w-main"
        proc.send_signal(signal.SIGTERM)
        # SIGTERM drains: the worker asks for no new work and leaves once told none follows.
        assert session.until("draining")[-1].kind == "draining"
        session.send(drain=worker_pb2.Drain())
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    events = [line["event"] for line in lines if line.get("worker_id") == "w-main"]
    assert [
        e for e in events if e in ("attached", "draining", "drain acknowledged", "stopped")
    ] == ["attached", "draining", "drain acknowledged", "stopped"]


# ---------------------------------------------------------------- drain and health


def health_status(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=WAIT_S
        )
    return reply.status


def wait_health(port: int, service: str, status: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while health_status(port, service) != status:
        assert time.monotonic() < deadline, f"health of {service!r} never became {status}"
        time.sleep(0.02)


@pytest.fixture
def running(request, queue_service, tiny_llama):
    """A worker run as ``python -m worker.process`` runs it (``run()``, on a thread here), with
    a health endpoint, held inside a layer when its gate is armed; (process, exit_codes:
    waits for ``run()`` to return and gives what it returned). The drain timeout is the
    test's parameter, else WAIT_S."""
    config = WorkerConfig(
        queue_service=queue_service.address,
        worker_id="w-drain",
        chunk_size=16,
        heartbeat_interval_s=0.05,
        drain_timeout_s=getattr(request, "param", WAIT_S),
        health_port=0,
    )
    process = WorkerProcess(config, loaded_model=tiny_llama)
    process.gate = LayerGate(tiny_llama.model.model.layers, process)
    codes: list[int] = []
    thread = threading.Thread(
        target=lambda: codes.append(process.run()), name="worker-main", daemon=True
    )
    thread.start()

    def exit_codes() -> list[int]:
        thread.join(WAIT_S)
        return codes

    yield process, exit_codes
    process.gate.remove()
    process.stop()
    thread.join(WAIT_S)
    assert not thread.is_alive(), "worker did not stop"


def test_a_drained_worker_finishes_what_it_holds_then_leaves_and_health_follows(
    running, queue_service
):
    process, exit_codes = running
    session = attached(queue_service)
    port = process.health_endpoint.port
    wait_health(port, "", SERVING)
    wait_health(port, LIVENESS, SERVING)
    process.gate.arm(after_layers=0)
    session.send(assign=assign("held", prompt(20, 11), max_new_tokens=4))
    assert process.gate.reached.wait(WAIT_S)

    assert process.runner.engine_thread.name == "worker-main"  # run() serves on its caller
    process.drain()  # what SIGTERM calls
    assert session.until("draining")[-1].kind == "draining"
    wait_health(port, "", NOT_SERVING)  # not ready any more, still alive
    assert health_status(port, LIVENESS) == SERVING
    session.send(drain=worker_pb2.Drain())
    process.gate.release.set()
    seen = session.until("done")
    assert seen[-1].body.request_id == "held" and "cancelled" not in [r.kind for r in seen]
    assert session.next() is None  # then it closes the stream
    assert process.wait(WAIT_S) and exit_codes() == [0]
    assert queue_service.sessions.empty()  # and does not dial again


@pytest.mark.parametrize("running", [0.5], indirect=True)
def test_a_drain_nobody_answers_stops_at_its_timeout(running, queue_service):
    process, exit_codes = running
    session = attached(queue_service)
    process.gate.arm(after_layers=0)
    session.send(assign=assign("held", prompt(20, 12), max_new_tokens=4))
    assert process.gate.reached.wait(WAIT_S)
    process.drain()
    assert session.until("draining")[-1].kind == "draining"
    # No Drain comes: after the timeout the worker stops; what it held reruns elsewhere.
    while (item := session.next()) is not None:
        assert item.kind != "done"
    assert process.wait(WAIT_S) and exit_codes() == [0]
    assert queue_service.sessions.empty()


# ---------------------------------------------------------------- a batched worker


@pytest.fixture
def batched_worker(queue_service, tiny_llama):
    config = WorkerConfig(
        queue_service=queue_service.address,
        worker_id="w-batched",
        chunk_size=16,
        heartbeat_interval_s=0.05,
        kv_slots=4,
        max_batch_size=3,
        slot_tokens=128,
    )
    process = WorkerProcess(config, loaded_model=tiny_llama).start()
    yield process
    process.stop()
    assert process.wait(WAIT_S), "worker did not stop"


def streamed_tokens(seen: list[Received]) -> dict[str, list[int]]:
    """Per request, the tokens of first_token and decode_step messages, in stream order;
    each position must come exactly once, in order."""
    tokens: dict[str, list[int]] = {}
    for item in seen:
        if item.kind == "first_token":
            triples = [(item.body.request_id, item.body.token_id, 0)]
        elif item.kind == "decode_step":
            triples = [(t.request_id, t.token_id, t.index) for t in item.body.tokens]
        else:
            continue
        for rid, token, index in triples:
            assert index == len(tokens.setdefault(rid, [])), (rid, index)
            tokens[rid].append(token)
    return tokens


def test_a_batched_worker_packs_decodes_together_and_streams_each_token_once(
    batched_worker, queue_service, tiny_llama
):
    from tests.unit.test_batch_engine import reference

    session = attached_hello(queue_service)
    assert (session.hello.kv_slots, session.hello.max_batch_size) == (4, 3)
    assert session.hello.slot_tokens == 128
    ids = {"p": prompt(12, 11), "q": prompt(20, 12), "r": prompt(33, 13)}
    members = [no_eos(assign(name, ids[name], 10), tbt_slo_s=0.5) for name in ("p", "q")]
    session.send(assign_packed=worker_pb2.AssignPacked(members=members))
    session.send(assign=no_eos(assign("r", ids["r"], 10), tbt_slo_s=0.5))
    seen = until_done(session, {"p", "q", "r"})
    firsts = {r.body.request_id: r.body for r in seen if r.kind == "first_token"}
    assert (firsts["p"].pack_size, firsts["p"].pack_tokens) == (2, 32)
    assert firsts["r"].pack_size == 0  # prefilled alone
    tokens = streamed_tokens(seen)
    for name, p in ids.items():
        assert tokens[name] == reference(tiny_llama.model, p, 10)[0], name
    assert max(len(r.body.tokens) for r in seen if r.kind == "decode_step") > 1
    assert not any(r.kind == "token" for r in seen)  # a step carries its rows' tokens

    # A request larger than a KV slot fails clearly; the worker keeps serving.
    session.send(assign=assign("big", prompt(120, 14), 20))
    failed = session.until("failed")[-1].body
    assert failed.request_id == "big" and failed.invalid_request
    assert "larger than a KV slot" in failed.error
    session.send(assign=assign("after", prompt(10, 15), 2))
    assert session.until("done")[-1].body.request_id == "after"


def attached_hello(queue_service) -> FakeSession:
    session = queue_service.next_session()
    hello = session.next()
    assert hello is not None and hello.kind == "hello"
    session.hello = hello.body
    return session


def no_eos(message: worker_pb2.Assign, **fields: Any) -> worker_pb2.Assign:
    message.stop_at_eos = False
    for name, value in fields.items():
        setattr(message, name, value)
    return message


def until_done(session: FakeSession, names: set[str]) -> list[Received]:
    seen: list[Received] = []
    left = set(names)
    while left:
        item = session.next()
        assert item is not None, "stream ended"
        seen.append(item)
        if item.kind in ("done", "failed"):
            assert item.kind == "done", item.body
            left.discard(item.body.request_id)
    return seen


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (dict(kv_slots=2, max_batch_size=0), "max_batch_size must be >= 1"),
        (dict(kv_slots=0), "kv_slots must be >= 1"),
        (dict(kv_slots=1, max_batch_size=2), "cannot exceed pool_slots"),
        (dict(kv_slots=2, max_batch_size=3), "cannot exceed pool_slots"),
        (dict(kv_slots=2, slot_tokens=0), "slot_tokens must be >= 1"),
    ],
)
def test_batch_and_pool_sizes_are_checked_with_a_clear_error(sizes, message, capsys):
    with pytest.raises(ValueError, match=message):
        WorkerConfig(queue_service="127.0.0.1:1", **sizes)
    from worker.cli import main

    argv = ["--queue-service", "127.0.0.1:1", "--plaintext"]
    for name, value in sizes.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


# ---------------------------------------------------------------- wire and backoff, no server


def test_wire_assign_defaults_follow_the_client_api():
    request = wire.request_from_assign(worker_pb2.Assign(request_id="r", prompt_ids=[5, 6]))
    assert request.prompt_ids == (5, 6) and request.max_new_tokens == 1
    assert (request.sampling.temperature, request.sampling.top_p) == (0.0, 1.0)
    with pytest.raises(InvalidRequestError):
        wire.request_from_assign(assign("r", [5], top_p=1.5))


def test_wire_preempted_latency_and_hello(tiny_llama):
    event = Preempted("r", ResumePoint(1, 2, 1, 16), 100, False, at=10.5, signalled_at=10.498)
    message = wire.event_message(event).preempted
    assert message.latency_ms == pytest.approx(2.0)
    assert message.resume_point.half == 1 and message.held_bytes == 100
    engine = BatchEngine(
        tiny_llama.model, EngineConfig(chunk_size=None, check="half"), BatchConfig(1, 1)
    )
    hello = wire.hello("w", "tiny-llama", engine).hello
    assert (hello.chunk_size, hello.check, hello.max_positions) == (0, "half", 4096)
    assert (hello.kv_slots, hello.max_batch_size, hello.slot_tokens) == (1, 1, 4096)


def test_backoff_grows_to_its_cap_with_jitter_and_resets():
    backoff = Backoff(0.1, 1.0)
    delays = [backoff.next_delay() for _ in range(8)]
    ceilings = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    backoff.reset()
    assert backoff.next_delay() <= 0.1
