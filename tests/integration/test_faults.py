"""The fault suite: real processes (Kafka, queue service, workers) on loopback, one fault each.

Each case leaves no request lost and none run twice (``tests.integration.load``), and normal
requests succeed afterwards. Bounded: a case runs tens of seconds. Assertions are orderings and
generous ratios, never tight times: CI is two busy cores shared with Kafka's JVM.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from launch.kafka_broker import LocalKafkaBroker
from tests.integration.load import Load, check_exactly_once, prompt_ids, run_request
from tests.integration.processes import start_queue_service, start_worker
from tests.tiers import SERVICE_TIERS_TOML
from tierflow.kafka_settings import KafkaSettings


@pytest.fixture
def tiers_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiers.toml"
    path.write_text(SERVICE_TIERS_TOML)
    return path


@pytest.fixture
def started(tmp_path: Path):
    """Processes a test starts; stopped in reverse order whatever happens."""
    procs: list = []
    yield procs
    for proc in reversed(procs):
        proc.stop()


@pytest.fixture
def own_broker(tmp_path: Path):
    """A broker of this test's own (it is stopped and started again; the session's is not)."""
    broker = LocalKafkaBroker()
    broker.start(data_dir=tmp_path / "kafka")
    yield broker
    broker.stop()


def first_success_after(target: str, since: float, limit_s: float):
    """Sends a short critical request, again while refused (UNAVAILABLE), until one completes;
    its outcome, and the seconds from ``since`` to its Done."""
    for attempt in range(1000):
        outcome = run_request(target, "critical", f"after-{attempt}", prompt_ids(20, seed=attempt))
        if outcome.done is not None or time.monotonic() - since > limit_s:
            return outcome, outcome.ended_at - since
        assert outcome.code is grpc.StatusCode.UNAVAILABLE, (outcome.code, outcome.details)
        time.sleep(0.2)
    raise AssertionError("unreachable")


def test_broker_stopped_for_20_s_under_load_fails_fast_then_recovers(
    tmp_path, tiers_file, started, own_broker, topic_prefix
):
    settings = KafkaSettings(
        bootstrap=own_broker.bootstrap, topic_prefix=topic_prefix, group_id=f"{topic_prefix}q"
    )
    qs, target = start_queue_service(tmp_path, settings, model="tiny-llama", tiers=tiers_file)
    started.append(qs)
    worker = start_worker(tmp_path, target, "w1", model="tiny-llama", chunk_size=32)
    started.append(worker)
    load = Load(target, rate_per_s=1.0, prefix="broker").start()
    time.sleep(5)
    port = own_broker.port
    own_broker.stop()
    down_at = time.monotonic()
    time.sleep(20)
    own_broker.start(data_dir=tmp_path / "kafka", port=port)
    up_at = time.monotonic()
    first, recovery_s = first_success_after(target, up_at, limit_s=60)
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
