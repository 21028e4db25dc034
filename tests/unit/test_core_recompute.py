"""The queue service's core between a real scheduler and recorded worker handles: what each
client stream receives when a request must run again after its first token.

The workers are handles that record the commands they get (this is a unit test of the core);
their reports are the wire messages a worker process sends. The end-to-end cases (a real worker
killed mid-decode) are in tests/integration/test_faults.py.
"""

from __future__ import annotations

import asyncio
import time

from queue_service.core.service_core import ServiceCore, Transport
from queue_service.scheduler import PrefillTimePredictor, Scheduler, SchedulerConfig
from tests.tiers import UNIT_TIERS
from tests.unit.test_service_core_requests import RecordingWorker
from tierflow.v1 import queue_pb2, serving_pb2, worker_pb2

EOS = 2


class RecordedWorker(RecordingWorker):
    """Also keeps the Kafka record of each request it is assigned."""

    def __init__(self, core: ServiceCore) -> None:
        super().__init__()
        self.core = core
        self.assigned: list[queue_pb2.QueuedRequest] = []

    def assign(self, request_id: str) -> None:
        self.assigned.append(self.core.record_for(request_id))
        super().assign(request_id)


def make_core() -> tuple[ServiceCore, list]:
    finished: list = []
    scheduler = Scheduler("flowprefill", UNIT_TIERS, PrefillTimePredictor(), SchedulerConfig())
    core = ServiceCore(
        scheduler,
        Transport(finished=finished.append, publish_reply=lambda *_: None),
        instance_id="qs",
        decode=lambda ids: " ".join(map(str, ids)),
        eos_ids=frozenset({EOS}),
    )
    return core, finished


def deliver(
    core: ServiceCore, request_id: str, *, tier: str = "standard", max_new_tokens: int = 6
) -> asyncio.Queue:
    record = queue_pb2.QueuedRequest(
        request_id=request_id,
        tier=tier,
        prompt_ids=[11, 12, 13],
        max_new_tokens=max_new_tokens,
        stop_at_eos=True,
        arrival_unix_ms=int(time.time() * 1000),
        reply_to="qs",
    )
    queue = core.open_client(request_id)
    core.on_delivered(record, delivery=f"offset-of-{request_id}")
    return queue


def report(core: ServiceCore, worker_id: str, **event) -> None:
    core.on_worker_message(worker_id, worker_pb2.WorkerMessage(**event))


def first_token(rid: str, token: int) -> dict:
    return {"first_token": worker_pb2.WorkerFirstToken(request_id=rid, token_id=token)}


def token(rid: str, token: int, index: int) -> dict:
    return {"token": worker_pb2.WorkerToken(request_id=rid, token_id=token, index=index)}


def step(*rows: tuple[str, int, int]) -> dict:
    """One decode step: (request id, token, index) per row."""
    tokens = [worker_pb2.WorkerToken(request_id=r, token_id=t, index=i) for r, t, i in rows]
    return {"decode_step": worker_pb2.DecodeStep(tokens=tokens)}


def done(rid: str, output: list[int]) -> dict:
    return {"done": worker_pb2.WorkerDone(request_id=rid, output_ids=output)}


def drain(queue: asyncio.Queue) -> list[serving_pb2.GenerateEvent]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def streamed_tokens(events) -> list[int]:
    out = []
    for e in events:
        kind = e.WhichOneof("event")
        if kind in ("first_token", "token"):
            out.append(getattr(e, kind).token_id)
    return out


def test_a_request_whose_worker_died_mid_decode_streams_no_token_twice():
    async def scenario():
        core, finished = make_core()
        w1, w2 = RecordedWorker(core), RecordedWorker(core)
        core.worker_joined("w1", w1, kv_slots=4)
        client = deliver(core, "r")
        assert w1.commands == [("assign", "r")]
        report(core, "w1", **first_token("r", 7))
        report(core, "w1", **token("r", 8, 1))
        report(core, "w1", **token("r", 9, 2))
        core.worker_left("w1")  # killed mid-decode
        core.worker_joined("w2", w2, kv_slots=4)
        assert w2.commands == [("assign", "r")]  # runs again from token 0...
        report(core, "w2", **first_token("r", 7))
        for index, tok in enumerate([8, 9, 10, 11, 12], start=1):
            report(core, "w2", **token("r", tok, index))
        report(core, "w2", **done("r", [7, 8, 9, 10, 11, 12]))
        events = drain(client)
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds.count("first_token") == 1 and kinds[-1] == "done"
        assert streamed_tokens(events) == [7, 8, 9, 10, 11, 12]  # ...but each reaches it once
        assert events[-1].done.usage.completion_tokens == 6
        assert events[-1].done.text == "7 8 9 10 11 12"
        assert finished == ["offset-of-r"]  # committed once

    asyncio.run(scenario())


def test_a_request_whose_worker_died_after_its_last_token_is_completed_not_run_again():
    async def scenario():
        core, finished = make_core()
        w1, w2 = RecordedWorker(core), RecordedWorker(core)
        core.worker_joined("w1", w1, kv_slots=4)
        client = deliver(core, "eos", max_new_tokens=6)
        report(core, "w1", **first_token("eos", 7))
        report(core, "w1", **token("eos", EOS, 1))  # the end, but Done never came
        core.worker_left("w1")
        core.worker_joined("w2", w2, kv_slots=4)
        assert w2.commands == []
        events = drain(client)
        assert streamed_tokens(events) == [7, EOS]
        assert events[-1].WhichOneof("event") == "done"
        assert events[-1].done.finish_reason == "stop"
        assert finished == ["offset-of-eos"]

    asyncio.run(scenario())


def test_a_decoding_request_dropped_for_recompute_streams_no_token_or_progress_again():
    async def scenario():
        core, _ = make_core()
        w1 = RecordedWorker(core)
        core.worker_joined("w1", w1, kv_slots=1)  # one slot: a newcomer needs d's
        client = deliver(core, "d", max_new_tokens=500)
        report(core, "w1", **first_token("d", 7))
        report(core, "w1", **step(("d", 8, 1)))
        # A critical request needs the only KV slot: the decoding lower-tier request's state
        # is dropped for it...
        deliver(core, "c", tier="critical", max_new_tokens=1)
        assert w1.commands[-1] == ("pause_decode", "d")
        report(core, "w1", preempted=worker_pb2.Preempted(request_id="d", state_dropped=True))
        assert w1.commands[-1] == ("assign", "c")
        report(core, "w1", **first_token("c", 5))
        report(core, "w1", **done("c", [5]))
        assert w1.commands[-1] == ("assign", "d")  # ...so it is recomputed
        # The worker recomputes its prompt and tokens (progress), rejoins and decodes on.
        report(core, "w1", progress=worker_pb2.Progress(request_id="d", tokens_done=4))
        rejoined = worker_pb2.DecodeRejoined(request_id="d", recomputed_tokens=5)
        report(core, "w1", decode_rejoined=rejoined)
        report(core, "w1", **step(("d", 9, 2)))
        report(core, "w1", **done("d", [7, 8, 9]))
        events = drain(client)
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds == ["first_token", "token", "token", "done"]
        assert streamed_tokens(events) == [7, 8, 9]
        assert events[-1].done.usage.completion_tokens == 3

    asyncio.run(scenario())
