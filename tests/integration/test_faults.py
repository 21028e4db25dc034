"""The fault suite: real processes (Kafka, queue service, workers) on loopback, one fault each.

Each case leaves no request lost and none run twice (``tests.integration.load``), and normal
requests succeed afterwards. The services run as deployed: over mTLS, each with its identity.
Bounded: a case runs tens of seconds. Assertions are orderings and generous ratios, never
tight times: CI is two busy cores shared with Kafka's JVM.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from tests.integration.load import (
    Load,
    check_exactly_once,
    holder_of,
    prompt_ids,
    run_request,
    stream_until,
    worker_events,
)
from tests.integration.processes import operator, start_queue_service, start_worker, stop_started
from tests.tiers import SERVICE_TIERS_TOML
from tierflow.kafka_settings import KafkaSettings
from tierflow.tiers import loads_tiers


@pytest.fixture
def tiers_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiers.toml"
    path.write_text(SERVICE_TIERS_TOML)
    return path


@pytest.fixture
def started(request: pytest.FixtureRequest, tmp_path: Path):
    """Processes a test starts; stopped in reverse order whatever happens, and their own log
    lines printed when the test failed (the only record of what the services did in CI)."""
    procs: list = []
    yield procs
    stop_started(request, procs)


def first_success_after(target: str, since: float, limit_s: float, credentials):
    """Sends a short critical request, again while refused (UNAVAILABLE), until one completes;
    its outcome, and the seconds from ``since`` to its Done."""
    for attempt in range(1000):
        prompt = prompt_ids(20, seed=attempt)
        request_id = f"after-{attempt}"
        outcome = run_request(target, "critical", request_id, prompt, credentials=credentials)
        if outcome.done is not None or time.monotonic() - since > limit_s:
            return outcome, outcome.ended_at - since
        assert outcome.code is grpc.StatusCode.UNAVAILABLE, (outcome.code, outcome.details)
        time.sleep(0.2)
    raise AssertionError("unreachable")


def test_broker_stopped_for_20_s_under_load_fails_fast_then_recovers(
    tmp_path, tiers_file, started, own_broker, topic_prefix, certs
):
    settings = KafkaSettings(
        bootstrap=own_broker.bootstrap, topic_prefix=topic_prefix, group_id=f"{topic_prefix}q"
    )
    qs, target = start_queue_service(
        tmp_path, settings, model="tiny-llama", tiers=tiers_file, tls_dir=certs
    )
    started.append(qs)
    worker = start_worker(tmp_path, target, "w1", model="tiny-llama", chunk_size=32, tls_dir=certs)
    started.append(worker)
    load = Load(target, rate_per_s=1.0, prefix="broker", credentials=operator(certs)).start()
    time.sleep(5)
    port = own_broker.port
    own_broker.stop()
    down_at = time.monotonic()
    time.sleep(20)
    own_broker.start(data_dir=tmp_path / "kafka", port=port)
    up_at = time.monotonic()
    first, recovery_s = first_success_after(target, up_at, 60, operator(certs))
    time.sleep(5)
    outcomes = load.stop()
    during = [o for o in outcomes if down_at + 3 < o.sent_at < up_at - 1]
    print(
        "during",
        [(o.code.name if o.code else "done", round(o.seconds, 2)) for o in during],
        "first after",
        first.code,
        round(recovery_s, 2),
        "downtime",
        round(up_at - down_at, 1),
    )
    check_exactly_once(outcomes, [worker])
    # While the broker is down, requests are refused at once, not after the producer's 10 s.
    assert during and all(o.code is grpc.StatusCode.UNAVAILABLE for o in during)
    timeout_s = settings.delivery_timeout_ms / 1000
    assert max(o.seconds for o in during) < timeout_s / 3, during
    # Back within seconds of the broker (before: the clients' 30 s reconnect backoff).
    assert first.done is not None and recovery_s < timeout_s, recovery_s
    after = [o for o in outcomes if o.sent_at > up_at + recovery_s]
    assert after and all(o.done is not None for o in after), after


@pytest.fixture
def stack(tmp_path, kafka_settings, tiers_file, started, certs):
    """Services on the session's broker, started on demand, over mTLS (the operator calls)."""

    class Stack:
        credentials = operator(certs)

        def queue_service(self, **kw):
            proc, target = start_queue_service(
                tmp_path, kafka_settings, model="bench-llama", tiers=tiers_file, tls_dir=certs,
                **kw,
            )  # fmt: skip
            started.append(proc)
            return proc, target

        def worker(self, target: str, worker_id: str, **kw):
            kw.setdefault("chunk_size", 256)
            proc = start_worker(
                tmp_path, target, worker_id, model="bench-llama", tls_dir=certs, **kw
            )
            started.append(proc)
            return proc

    return Stack()


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "when", ["prefill", "decode"], ids=["killed-mid-prefill", "killed-mid-decode"]
)
def test_a_worker_killed_mid_request_under_load(stack, when):
    _, target = stack.queue_service()
    workers = [stack.worker(target, "w1"), stack.worker(target, "w2")]
    load = Load(
        target, rate_per_s=0.3, prompt_tokens=(16, 48), prefix=f"kill-{when}",
        credentials=stack.credentials,
    ).start()  # fmt: skip
    if when == "prefill":  # a long prompt: seconds of prefill on a CPU, progress per chunk
        prompt, params = prompt_ids(1500, seed=3), {"max_new_tokens": 2}
        until = lambda kinds: "progress" in kinds  # noqa: E731
    else:  # many tokens: killed once some reached the client, long before the last is made
        prompt, params = prompt_ids(40, seed=4), {"max_new_tokens": 240}
        until = lambda kinds: kinds.count("token") >= 5  # noqa: E731
    future, reached = stream_until(
        target, "standard", "victim", prompt, until=until, credentials=stack.credentials, **params
    )
    assert reached.wait(180)
    holder_of(workers, "victim").kill()  # SIGKILL
    outcomes = load.stop()
    victim = future.result(timeout=300)
    check_exactly_once([*outcomes, victim], workers)
    assert victim.done is not None and victim.kinds.count("first_token") == 1
    if when == "decode":
        assert len(victim.tokens) == 240  # every token once, across the two workers
    survivor = next(w for w in workers if w.alive())
    # Its log line may land a moment after the client's Done (CI read the log too early once).
    survivor.wait_for_log("finished", timeout=30, request_id="victim")
    normal = run_request(
        target, "critical", "normal-after", prompt_ids(20, seed=5), credentials=stack.credentials
    )
    assert normal.done is not None


def test_a_worker_stopped_past_the_heartbeat_timeout(stack):
    import os
    import signal

    _, target = stack.queue_service()  # heartbeat timeout 3 s
    workers = [stack.worker(target, "w1"), stack.worker(target, "w2")]
    future, reached = stream_until(
        target,
        "standard",
        "stalled",
        prompt_ids(1500, seed=6),
        until=lambda kinds: "progress" in kinds,
        max_new_tokens=2,
        credentials=stack.credentials,
    )
    assert reached.wait(120)
    frozen = holder_of(workers, "stalled")
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        load = Load(
            target, rate_per_s=0.3, prompt_tokens=(16, 48), prefix="sigstop",
            credentials=stack.credentials,
        ).start()  # fmt: skip
        time.sleep(8)  # well past the heartbeat timeout: detached, its request runs elsewhere
        outcomes = load.stop()
        stalled = future.result(timeout=300)
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    survivor = next(w for w in workers if w is not frozen)
    # The frozen worker may still finish its stale copy once it runs again; the queue service
    # ignores it (it was detached), so only the survivor's runs count.
    check_exactly_once([*outcomes, stalled], [survivor])
    assert stalled.done is not None and stalled.kinds.count("first_token") == 1
    survivor.wait_for_log("finished", timeout=30, request_id="stalled")  # may land after Done
    deadline = time.monotonic() + 60  # it runs again, finds its session gone, attaches anew
    while sum(e.get("event") == "attached" for e in frozen.log_events()) < 2:
        assert time.monotonic() < deadline, frozen.log_tail()
        time.sleep(0.2)
    normal = run_request(
        target, "critical", "normal-after", prompt_ids(20, seed=7), credentials=stack.credentials
    )
    assert normal.done is not None


def test_the_queue_service_killed_with_a_backlog_runs_critical_first_after_restart(
    tmp_path, kafka_settings, tiers_file, started, certs
):
    credentials = operator(certs)

    def queue_service():
        proc, target = start_queue_service(
            tmp_path, kafka_settings, model="tiny-llama", tiers=tiers_file,
            extra=["--no-worker-timeout", "600"], tls_dir=certs,
        )  # fmt: skip
        started.append(proc)
        return proc, target

    qs, target = queue_service()  # no worker yet: everything sent waits, a backlog
    backlog = [*(("batch", f"batch-{i}") for i in range(4)), ("standard", "standard-0")]
    backlog.append(("critical", "critical-0"))  # the most urgent, sent last
    streams = [
        stream_until(
            target,
            tier,
            rid,
            prompt_ids(30, seed=i),
            until=lambda k: "queued" in k,
            credentials=credentials,
        )
        for i, (tier, rid) in enumerate(backlog)
    ]
    for _, queued in streams:
        assert queued.wait(60)
    queued_at = time.monotonic()
    qs.kill()  # SIGKILL, with the backlog in Kafka; no client sends anything again
    assert all(future.result(timeout=60).done is None for future, _ in streams)
    _, target = queue_service()
    # Every request late when the worker comes: the order is then the late rule's (a late
    # request is re-deadlined one SLO of its tier from now), not a race with the standard
    # request's own deadline (on time, EDF may rightly put it before a late critical one).
    standard_slo_s = loads_tiers(SERVICE_TIERS_TOML).get("standard").ttft_slo_s
    time.sleep(max(0.0, queued_at + standard_slo_s + 0.5 - time.monotonic()))
    worker = start_worker(tmp_path, target, "w1", model="tiny-llama", chunk_size=32, tls_dir=certs)
    started.append(worker)
    deadline = time.monotonic() + 120
    ids = [rid for _, rid in backlog]
    while set(worker_events([worker], "finished")) < set(ids):
        assert time.monotonic() < deadline, worker.log_tail()
        time.sleep(0.2)
    finished = worker_events([worker], "finished")
    assert all(finished[rid] == 1 for rid in ids), finished  # each once, no client retry
    order = [e["request_id"] for e in worker.log_events() if e.get("event") == "assigned"]
    assert order[0] == "critical-0", order  # critical first after the restart
    assert order.index("standard-0") < min(order.index(f"batch-{i}") for i in range(4)), order
    normal = run_request(
        target, "critical", "normal-after", prompt_ids(20, seed=9), credentials=credentials
    )
    assert normal.done is not None
