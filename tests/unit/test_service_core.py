"""The queue service's core: each output token reaches the client's stream exactly once, whatever
the worker does in between (batched decode steps, a dropped and recomputed decode, a worker
that leaves and a second one that starts the request again from token 0)."""

from __future__ import annotations

import asyncio
import time

from queue_service.core.service_core import ServiceCore, Transport
from queue_service.scheduler import PrefillTimePredictor, Scheduler, make_policy
from tests.tiers import UNIT_TIERS
from tierflow.v1 import queue_pb2, worker_pb2


class Handle:
    """A worker handle that records what the dispatcher asked of it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def assign(self, request_id):
        self.calls.append(("assign", request_id))

    def assign_packed(self, request_ids):
        self.calls.append(("assign_packed", request_ids))

    def resume(self, request_id):
        self.calls.append(("resume", request_id))

    def preempt(self, request_id, drop_state):
        self.calls.append(("preempt", request_id, drop_state))

    def pause_decode(self, request_id, drop_state):
        self.calls.append(("pause_decode", request_id, drop_state))

    def cancel(self, request_id):
        self.calls.append(("cancel", request_id))

    def drain(self):
        self.calls.append(("drain",))


def message(**event) -> worker_pb2.WorkerMessage:
    return worker_pb2.WorkerMessage(**event)


def first(rid: str, token: int) -> worker_pb2.WorkerMessage:
    return message(first_token=worker_pb2.WorkerFirstToken(request_id=rid, token_id=token))


def step(*tokens: tuple[str, int, int]) -> worker_pb2.WorkerMessage:
    rows = [worker_pb2.WorkerToken(request_id=r, token_id=t, index=i) for r, t, i in tokens]
    return message(decode_step=worker_pb2.DecodeStep(tokens=rows, step_ms=5.0))


def token(rid: str, tok: int, index: int) -> worker_pb2.WorkerMessage:
    return message(token=worker_pb2.WorkerToken(request_id=rid, token_id=tok, index=index))


def streamed(queue: asyncio.Queue) -> list[tuple[str, int]]:
    out = []
    while not queue.empty():
        event = queue.get_nowait()
        kind = event.WhichOneof("event")
        body = getattr(event, kind)
        out.append((kind, getattr(body, "token_id", -1)))
    return out


async def scenario() -> None:
    scheduler = Scheduler(make_policy("fifo"), UNIT_TIERS, PrefillTimePredictor())
    transport = Transport(finished=lambda d: None, publish_reply=lambda to, r: None)
    core = ServiceCore(scheduler, transport, instance_id="qs", decode=lambda ids: str(ids))
    w1, w2 = Handle(), Handle()
    core.worker_joined("w1", w1, kv_slots=4)
    now_ms = int(time.time() * 1000)
    records = {
        rid: queue_pb2.QueuedRequest(
            request_id=rid,
            tier="batch",
            prompt_ids=[5, 6, 7],
            max_new_tokens=8,
            arrival_unix_ms=now_ms,
        )
        for rid in ("a", "b")
    }
    clients = {rid: core.open_client(rid) for rid in records}
    for record in records.values():
        core.on_delivered(record, None)
    assert w1.calls == [("assign", "a")]
    core.on_worker_message("w1", first("a", 10))
    assert w1.calls[-1] == ("assign", "b")  # a decodes; b prefills beside it
    core.on_worker_message("w1", first("b", 20))
    core.on_worker_message("w1", step(("a", 11, 1), ("b", 21, 1)))
    core.on_worker_message("w1", step(("a", 12, 2), ("b", 22, 2)))
    # a's decode is dropped, recomputed and rejoins: its tokens go on from index 3.
    dropped = worker_pb2.Preempted(request_id="a", state_dropped=True)
    core.on_worker_message("w1", message(preempted=dropped))
    rejoined = worker_pb2.DecodeRejoined(request_id="a", recomputed_tokens=5)
    core.on_worker_message("w1", message(decode_rejoined=rejoined))
    core.on_worker_message("w1", step(("b", 23, 3), ("a", 13, 3)))
    # An unbatched-style recompute from token 0 repeats what the client has: not sent again.
    core.on_worker_message("w1", first("b", 20))
    core.on_worker_message("w1", token("b", 21, 1))
    assert streamed(clients["a"]) == [
        ("first_token", 10), ("token", 11), ("token", 12), ("token", 13),
    ]  # fmt: skip
    assert streamed(clients["b"]) == [
        ("first_token", 20), ("token", 21), ("token", 22), ("token", 23),
    ]  # fmt: skip
    # w1 goes: both restart on w2 from token 0; only the tokens the clients lack go out.
    core.worker_left("w1")
    core.worker_joined("w2", w2, kv_slots=4)
    assert w2.calls[0][0] == "assign"
    started = w2.calls[0][1]
    core.on_worker_message("w2", first(started, 10 if started == "a" else 20))
    later = w2.calls[-1][1]
    core.on_worker_message("w2", first(later, 10 if later == "a" else 20))
    core.on_worker_message("w2", step(("a", 11, 1), ("b", 21, 1)))
    core.on_worker_message("w2", step(("a", 12, 2), ("b", 22, 2)))
    core.on_worker_message("w2", step(("a", 13, 3), ("b", 23, 3)))
    core.on_worker_message("w2", step(("a", 14, 4), ("b", 24, 4)))
    # Between w1 leaving and w2 joining no worker was attached: the clients were told so.
    assert streamed(clients["a"]) == [("waiting", -1), ("token", 14)]
    assert streamed(clients["b"]) == [("waiting", -1), ("token", 24)]
    done = worker_pb2.WorkerDone(request_id="a", output_ids=[10, 11, 12, 13, 14])
    core.on_worker_message("w2", message(done=done))
    assert streamed(clients["a"]) == [("done", -1)]
    assert core.lookup("a").output_ids == [10, 11, 12, 13, 14]


def test_each_token_reaches_the_client_once_across_drops_recomputes_and_worker_loss():
    asyncio.run(scenario())
