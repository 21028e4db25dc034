"""The services end to end, without the edge: real Kafka, a real queue service process and real
worker processes running real models. The tier comes from the trusted header here.

Long prefills use the bench-llama preset (a 3500-token prefill takes seconds on a CPU), so a
request can be preempted or a worker killed in the middle of one without any test-only hook.
Assertions are orderings and generous bounds: CI shares 2 cores with Kafka's JVM.
"""

from __future__ import annotations

import concurrent.futures
import random
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch

from launch.processes import free_port, wait_serving
from ops.topics import read_topic
from tests.integration.load import stream_until, worker_events
from tests.integration.processes import start_queue_service, start_worker, stop_started
from tests.tiers import SERVICE_TIERS_TOML
from tierflow.client import TierflowClient
from tierflow.v1 import serving_pb2
from worker.models import load_model

SERVICE_TIERS = SERVICE_TIERS_TOML


@pytest.fixture
def tiers_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiers.toml"
    path.write_text(SERVICE_TIERS)
    return path


@pytest.fixture
def stack(request, tmp_path, kafka_settings, tiers_file):
    """Starts services on demand; stops whatever was started (its logs printed if the test
    failed)."""
    started = []

    class Stack:
        def queue_service(self, model: str, **kw):
            proc, target = start_queue_service(
                tmp_path, kafka_settings, model=model, tiers=tiers_file, **kw
            )
            started.append(proc)
            return proc, target

        def worker(self, target: str, worker_id: str, model: str, **kw):
            proc = start_worker(tmp_path, target, worker_id, model=model, **kw)
            started.append(proc)
            return proc

    yield Stack()
    stop_started(request, started)


def ids(n: int, seed: int, vocab: int = 4000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, vocab) for _ in range(n)]


def greedy_first_token(model, prompt: list[int]) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([prompt])).logits[0, -1].argmax())


def events_of(client: TierflowClient, prompt, **kw) -> list:
    return list(client.generate(prompt, **kw))


def kinds(events) -> list[str]:
    return [e.WhichOneof("event") for e in events]


def test_thirty_mixed_requests_on_two_workers_all_complete_exactly(stack, tiny_llama):
    _, target = stack.queue_service("tiny-llama")
    stack.worker(target, "w1", "tiny-llama", chunk_size=32)
    stack.worker(target, "w2", "tiny-llama", chunk_size=32)
    tiers = ["critical", "standard", "batch"]
    prompts = [ids(20 + 23 * i, seed=i) for i in range(30)]

    def run(i: int):
        with TierflowClient(target, tier=tiers[i % 3]) as client:
            return events_of(client, prompts[i], max_new_tokens=3, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        results = list(pool.map(run, range(30)))
    for i, events in enumerate(results):
        assert kinds(events)[0] == "queued" and kinds(events)[-1] == "done", kinds(events)
        assert events[0].queued.tier == tiers[i % 3]
        first = next(e.first_token for e in events if e.WhichOneof("event") == "first_token")
        assert first.token_id == greedy_first_token(tiny_llama.model, prompts[i]), i
        done = events[-1].done
        assert done.usage.prompt_tokens == len(prompts[i]) and done.usage.completion_tokens == 3


def test_critical_request_preempts_a_long_batch_prefill(stack):
    _, target = stack.queue_service("bench-llama")
    stack.worker(target, "w1", "bench-llama", chunk_size=512)
    batch_prompt = ids(3500, seed=1)
    critical_prompt = ids(24, seed=2)
    batch_events: list = []
    with TierflowClient(target, tier="batch") as batch_client:
        stream = batch_client.generate(batch_prompt, timeout=300)
        for event in stream:  # until the batch prefill is under way
            batch_events.append(event)
            if event.WhichOneof("event") == "progress":
                break
        with TierflowClient(target, tier="critical") as critical_client:
            critical = events_of(critical_client, critical_prompt, timeout=120)
        batch_events.extend(stream)
    assert kinds(critical)[-1] == "done" and kinds(batch_events)[-1] == "done"
    batch_done = batch_events[-1].done
    assert batch_done.timings.preemptions >= 1  # it gave way...
    assert (
        max(e.progress.preemptions for e in batch_events if e.WhichOneof("event") == "progress")
        >= 1
    )  # ...and said so while running
    critical_first = next(e.first_token for e in critical if e.WhichOneof("event") == "first_token")
    # It waited about one layer, not the batch's 3500 tokens: its wait (TTFT less its own
    # prefill) against the batch prefill's engine time in this same run, whatever the box.
    assert critical_wait_ms(critical) < batch_done.timings.prefill_ms / 3
    assert critical_first.ttft_ms < batch_done.timings.ttft_ms
    # The preempted-and-resumed prefill is exact: same first token as one uninterrupted pass.
    bench = load_model("bench-llama", device="cpu", dtype=torch.float32)
    batch_first = next(
        e.first_token for e in batch_events if e.WhichOneof("event") == "first_token"
    )
    assert batch_first.token_id == greedy_first_token(bench.model, batch_prompt)


def test_worker_killed_mid_prefill_request_completes_on_the_other(stack, tiny_llama):
    _, target = stack.queue_service("bench-llama")
    w1 = stack.worker(target, "w1", "bench-llama", chunk_size=256)
    w2 = stack.worker(target, "w2", "bench-llama", chunk_size=256)
    prompt = ids(3000, seed=3)
    with TierflowClient(target, tier="standard") as client:
        stream = client.generate(prompt, timeout=300)
        events = []
        for event in stream:
            events.append(event)
            if event.WhichOneof("event") == "progress":
                break
        victim = next(
            w for w in (w1, w2) if any(e.get("event") == "assigned" for e in w.log_events())
        )
        victim.kill()  # SIGKILL mid-prefill
        events.extend(stream)
    assert kinds(events)[-1] == "done"
    survivor = w2 if victim is w1 else w1
    # The worker sends an event before it logs it, so the client's "done" can come first.
    survivor.wait_for_log("finished", timeout=30)
    bench = load_model("bench-llama", device="cpu", dtype=torch.float32)
    first = next(e.first_token for e in events if e.WhichOneof("event") == "first_token")
    assert first.token_id == greedy_first_token(bench.model, prompt)


def test_sigterm_drains_a_worker_it_finishes_its_request_and_new_work_waits_for_another(stack):
    """A rollout's SIGTERM: the request the worker holds finishes there (not rerun from
    scratch), a request sent meanwhile is not given to it, and it exits 0 with health
    following."""
    qs, target = stack.queue_service("bench-llama")
    health = free_port()
    w1 = stack.worker(
        target, "w1", "bench-llama", chunk_size=256,
        extra=["--health-port", str(health), "--drain-timeout", "300"],
    )  # fmt: skip
    wait_serving(f"127.0.0.1:{health}", service="")  # ready: attached
    prompt = ids(3000, seed=5)  # seconds of prefill: the SIGTERM lands while w1 holds it
    with TierflowClient(target, tier="standard") as client:
        stream = client.generate(prompt, max_new_tokens=8, timeout=300)
        events = []
        for event in stream:
            events.append(event)
            if event.WhichOneof("event") == "progress":
                break
        w1.proc.send_signal(signal.SIGTERM)
        qs.wait_for_log("worker draining", worker_id="w1")
        w1.wait_for_log("drain acknowledged")
        late, late_queued = stream_until(
            target, "critical", "late", ids(40, seed=6), until=lambda kinds: "queued" in kinds
        )
        assert late_queued.wait(60)
        events.extend(stream)
    assert kinds(events)[-1] == "done"
    assert w1.proc.wait(120) == 0
    w1_events = [e.get("event") for e in w1.log_events()]
    assert w1_events.index("draining") < w1_events.index("finished")  # it held the request
    assert "cancelling requests of the ended session" not in w1_events
    assert worker_events([w1], "assigned") == {events[0].request_id: 1}  # never "late"
    w2 = stack.worker(target, "w2", "bench-llama", chunk_size=256)
    assert late.result(timeout=120).done is not None
    assert worker_events([w2], "finished") == {"late": 1}


def test_restart_while_queued_completes_everything_once(stack, tiny_llama):
    qs, target = stack.queue_service("tiny-llama")
    worker = stack.worker(target, "w1", "tiny-llama", chunk_size=64)
    with TierflowClient(target, tier="standard") as client:
        early = [client.complete(ids(30, seed=100 + i), request_id=f"early-{i}") for i in range(3)]
    assert all(c.text for c in early)
    with TierflowClient(target, tier="standard") as client:
        # Idempotency key of a finished request: the same tokens and answer again, not a second
        # run (no Queued).
        again = client.complete(ids(30, seed=100), request_id="early-0")
    assert again.text == early[0].text and kinds(again.events) == kinds(early[0].events)[1:]
    worker.stop()  # nothing runs the next requests: they stay queued
    queued_ids = [f"queued-{i}" for i in range(6)]
    # Each client keeps its stream open (a closed stream would cancel its request) until the
    # crash breaks it; nobody sends anything again afterwards.
    streams = [
        stream_until(target, "batch", rid, ids(40, seed=i), until=lambda kinds: "queued" in kinds)
        for i, rid in enumerate(queued_ids)
    ]
    for _, queued in streams:
        assert queued.wait(60)
    qs.kill()
    for future, _ in streams:
        assert future.result(timeout=60).done is None  # the crash ended every stream
    _, target = stack.queue_service("tiny-llama")
    w2 = stack.worker(target, "w2", "tiny-llama", chunk_size=64)
    # Redelivered from Kafka and completed without any client retry, each exactly once.
    deadline = time.monotonic() + 120
    with TierflowClient(target, tier="batch") as client:
        for request_id in queued_ids:
            while state_of(client, request_id) != serving_pb2.RequestStatus.DONE:
                assert time.monotonic() < deadline, request_id
                time.sleep(0.2)
        finished = worker_events([w2], "finished")
        assert all(finished[rid] == 1 for rid in queued_ids), finished
        for c in early:  # finished before the crash: committed, never delivered again
            with pytest.raises(grpc.RpcError) as err:
                client.status(c.request_id)
            assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert not set(finished) - set(queued_ids)


def state_of(client: TierflowClient, request_id: str):
    """The request's state; None while this instance has not consumed it from Kafka yet (a
    restarted instance answers NOT_FOUND until its consumer group delivers the backlog)."""
    try:
        return client.status(request_id).state
    except grpc.RpcError as exc:
        if exc.code() is grpc.StatusCode.NOT_FOUND:
            return None
        raise


def test_bad_input_gets_precise_statuses_and_the_service_keeps_serving(stack):
    _, target = stack.queue_service("tiny-llama")
    stack.worker(target, "w1", "tiny-llama")

    def status_of(tier: str | None, prompt, **kw) -> grpc.StatusCode:
        with TierflowClient(target, tier=tier) as client:
            with pytest.raises(grpc.RpcError) as err:
                events_of(client, prompt, **kw)
            return err.value.code(), err.value.details()

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert status_of("critical", "   ") == (invalid, "prompt is empty")
    code, details = status_of("critical", [7] * 5000)
    assert code is invalid and "exceeds the model's context" in details
    for bad in (0, -3, 10**6):
        code, details = status_of("critical", "hello", max_new_tokens=bad)
        assert code is invalid and "max_new_tokens" in details
    code, details = status_of("gold", "hello")
    assert code is invalid and "unknown tier 'gold'" in details
    code, _ = status_of(None, "hello")
    assert code is grpc.StatusCode.UNAUTHENTICATED
    code, details = status_of("critical", [10**7])
    assert code is invalid and "vocabulary" in details
    code, details = status_of("critical", "hello", temperature=float("nan"))
    assert code is invalid and "temperature" in details
    code, _ = status_of("critical", "hello", timeout=0.000001)
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED
    with TierflowClient(target, tier="critical") as client:
        assert client.complete("still serving?", max_new_tokens=2).text


def test_client_cancel_stops_the_request(stack):
    _, target = stack.queue_service("bench-llama")
    worker = stack.worker(target, "w1", "bench-llama", chunk_size=256)
    with TierflowClient(target, tier="batch") as client:
        stream = client.generate(ids(3000, seed=9), request_id="cancel-me", timeout=300)
        for event in stream:
            if event.WhichOneof("event") == "progress":
                break
        stream.close()  # cancels the RPC
        worker.wait_for_log("cancelled", request_id="cancel-me", timeout=60)
        deadline = time.monotonic() + 30
        while client.status("cancel-me").state != client.status("cancel-me").CANCELLED:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # The worker is free again at once: a short request completes quickly after.
        assert client.complete(ids(16, seed=10), max_new_tokens=1).text is not None


def test_two_instances_in_one_group_relay_events_to_the_client_stream(
    stack, tiny_llama, kafka_settings
):
    """Both instances consume the tier topics as one group; whichever runs a request sends its
    events to the reply topic of the instance that holds the client's stream."""
    _, a = stack.queue_service("tiny-llama", instance_id="qs-a")
    _, b = stack.queue_service("tiny-llama", instance_id="qs-b")
    stack.worker(a, "wa", "tiny-llama", chunk_size=32)
    stack.worker(b, "wb", "tiny-llama", chunk_size=32)
    prompts = [ids(30 + 7 * i, seed=50 + i) for i in range(8)]
    instance_of = {f"two-{i}": ("qs-a", "qs-b")[i % 2] for i in range(8)}

    def run(i: int):
        target = (a, b)[i % 2]
        with TierflowClient(target, tier=("critical", "batch")[i % 2]) as client:
            return events_of(
                client, prompts[i], request_id=f"two-{i}", max_new_tokens=2, timeout=120
            )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    for i, events in enumerate(results):
        assert kinds(events)[0] == "queued" and kinds(events)[-1] == "done", (i, kinds(events))
        first = next(e.first_token for e in events if e.WhichOneof("event") == "first_token")
        assert first.token_id == greedy_first_token(tiny_llama.model, prompts[i])
    # Events did cross: each tier topic has one partition, so one instance ran every request
    # of a tier, and the other instance's clients got theirs through its reply topic.
    crossed = {}
    for instance in ("qs-a", "qs-b"):
        topic = kafka_settings.reply_topic(instance)
        for record in read_topic(kafka_settings, topic, idle_s=1.0):
            crossed.setdefault(record["value"]["request_id"], set()).add(instance)
    assert crossed, "no event went through a reply topic"
    for request_id, instances in crossed.items():
        assert instances == {instance_of[request_id]}, (request_id, instances)


def critical_wait_ms(events) -> float:
    """Admission to first token, less the request's own prefill: the time it waited."""
    timings = events[-1].done.timings
    return timings.ttft_ms - timings.prefill_ms
