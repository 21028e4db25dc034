"""The queue service's core (``queue_service.core.service_core``) on its own: Kafka deliveries and
worker reports in, client events out. The scheduler is the real one; the worker is a handle that
records the commands it gets, the transport records what would go to Kafka, and the clock is a
number the test moves. The integration tests run the same code behind real processes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from queue_service.core.service_core import ServiceCore, Transport
from queue_service.scheduler import PrefillTimePredictor, Scheduler, SchedulerConfig, make_policy
from tests.tiers import UNIT_TIERS
from tierflow.catalogue import load_model_info
from tierflow.v1 import queue_pb2, worker_pb2

TEXT = "Zürich 東京 🙂 café — naïve"  # characters that byte-level tokens split


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class RecordingWorker:
    """A WorkerHandle that records the commands it gets."""

    commands: list[tuple[str, str]] = field(default_factory=list)

    def assign(self, request_id: str) -> None:
        self.commands.append(("assign", request_id))

    def resume(self, request_id: str) -> None:
        self.commands.append(("resume", request_id))

    def preempt(self, request_id: str, drop_state: bool) -> None:
        self.commands.append(("preempt", request_id))

    def cancel(self, request_id: str) -> None:
        self.commands.append(("cancel", request_id))

    def assign_packed(self, request_ids: tuple[str, ...]) -> None:
        self.commands.append(("assign_packed", ",".join(request_ids)))

    def pause_decode(self, request_id: str, drop_state: bool) -> None:
        self.commands.append(("pause_decode", request_id))


@dataclass
class RecordingTransport:
    finished: list = field(default_factory=list)
    replies: list[tuple[str, queue_pb2.ReplyRecord]] = field(default_factory=list)

    def transport(self) -> Transport:
        return Transport(
            finished=self.finished.append,
            publish_reply=lambda to, reply: self.replies.append((to, reply)),
        )


def make_core(clock: FakeClock, transport: RecordingTransport, model: str = "tiny-llama"):
    tokenizer = load_model_info(model).tokenizer
    scheduler = Scheduler(
        make_policy("flowprefill"), UNIT_TIERS, PrefillTimePredictor(), SchedulerConfig()
    )
    core = ServiceCore(
        scheduler,
        transport.transport(),
        instance_id="qs-test",
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        decode_stream=lambda: tokenizer.decode_stream(skip_special_tokens=True).step,
        clock=clock,
    )
    return core, tokenizer


def record(request_id: str, prompt_ids, max_new_tokens: int, **kw) -> queue_pb2.QueuedRequest:
    return queue_pb2.QueuedRequest(
        request_id=request_id,
        tier="critical",
        prompt_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        arrival_unix_ms=int(time.time() * 1000),
        reply_to="qs-test",
        **kw,
    )


def from_worker(**event) -> worker_pb2.WorkerMessage:
    return worker_pb2.WorkerMessage(**event)


def run_tokens(core, worker_id: str, request_id: str, output_ids: list[int]) -> None:
    """What a worker reports for a request's first ``len(output_ids)`` tokens."""
    core.on_worker_message(
        worker_id,
        from_worker(
            first_token=worker_pb2.WorkerFirstToken(
                request_id=request_id, token_id=output_ids[0], prompt_tokens=3
            )
        ),
    )
    for index, token_id in enumerate(output_ids[1:], start=1):
        token = worker_pb2.WorkerToken(request_id=request_id, token_id=token_id, index=index)
        core.on_worker_message(worker_id, from_worker(token=token))


def run_to_done(core, worker_id: str, request_id: str, output_ids: list[int]) -> None:
    """What a worker reports for a request that runs to the end."""
    run_tokens(core, worker_id, request_id, output_ids)
    core.on_worker_message(
        worker_id,
        from_worker(done=worker_pb2.WorkerDone(request_id=request_id, output_ids=output_ids)),
    )


def drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_byte_level_tokens_stream_as_whole_characters_never_as_replacement_chars():
    async def scenario():
        clock, transport = FakeClock(), RecordingTransport()
        core, tokenizer = make_core(clock, transport)
        output = tokenizer.encode(TEXT, add_special_tokens=False)
        # The tokenizer splits some characters over several tokens: alone, they decode to U+FFFD.
        assert any("\ufffd" in tokenizer.decode([i]) for i in output)
        worker = RecordingWorker()
        core.worker_joined("w1", worker, kv_slots=4)
        queue = core.open_client("r1")
        core.on_delivered(record("r1", [5, 6, 7], len(output)), delivery="d1")
        assert worker.commands == [("assign", "r1")]
        run_to_done(core, "w1", "r1", output)
        events = drain(queue)
        pieces = [
            getattr(e, e.WhichOneof("event")).text
            for e in events
            if e.WhichOneof("event") in ("first_token", "token")
        ]
        assert len(pieces) == len(output)  # one event per token, some of them empty
        assert not any("\ufffd" in p for p in pieces), pieces
        assert "".join(pieces) == TEXT == events[-1].done.text

    asyncio.run(scenario())


def test_a_finished_requests_total_time_stays_what_it_was_when_it_finished():
    async def scenario():
        clock, transport = FakeClock(), RecordingTransport()
        core, _ = make_core(clock, transport)
        core.worker_joined("w1", RecordingWorker(), kv_slots=4)
        queue = core.open_client("r1")
        core.on_delivered(record("r1", [5, 6, 7], 2), delivery="d1")
        clock.now += 1.5
        run_to_done(core, "w1", "r1", [40, 41])
        done = drain(queue)[-1].done
        assert 1400 < done.timings.total_ms < 1700  # admission is a few ms before delivery
        clock.now += 60.0  # read a minute later (GetRequest, a retry answered with Done again)
        later = core.lookup("r1").timings(clock())
        assert later.total_ms == done.timings.total_ms
        assert transport.finished == ["d1"]

    asyncio.run(scenario())


def test_a_client_joining_late_gets_every_token_produced_before_it_as_first_streamed():
    def pieces(events) -> list[tuple[str, int, str]]:
        """Each token event as (kind, token id, text)."""
        out = []
        for event in events:
            kind = event.WhichOneof("event")
            token = getattr(event, kind)
            out.append((kind, token.token_id, token.text))
        return out

    async def scenario():
        clock, transport = FakeClock(), RecordingTransport()
        core, tokenizer = make_core(clock, transport)
        output = tokenizer.encode(TEXT, add_special_tokens=False)
        core.worker_joined("w1", RecordingWorker(), kv_slots=4)
        # r1 streams to a client from its start, to the end.
        listening = core.open_client("r1")
        core.on_delivered(record("r1", [5, 6, 7], len(output)), delivery="d1")
        clock.now += 0.5
        run_to_done(core, "w1", "r1", output)
        streamed = [e for e in drain(listening) if e.WhichOneof("event") != "done"]
        # A retry after its Done gets the same token events first: kinds, ids, texts, TTFT.
        again = core.tokens_so_far(core.lookup("r1"))
        assert pieces(again) == pieces(streamed)
        assert again[0].first_token.ttft_ms == streamed[0].first_token.ttft_ms
        # r2 produces half its tokens with no client listening (it left, the service restarted):
        # a client joining now gets those, in order, before anything new.
        core.on_delivered(record("r2", [5, 6, 7], len(output)), delivery="d2")
        half = len(output) // 2
        run_tokens(core, "w1", "r2", output[:half])
        joined = core.tokens_so_far(core.lookup("r2"))
        assert pieces(joined) == pieces(streamed)[:half]

    asyncio.run(scenario())
