"""Fixtures for tests against real services: one Kafka broker for the whole session.

The broker is a real single-node Kafka (KRaft) started from its Maven Central jars by
``scripts/kafka.sh`` (the first run fetches them, seconds; later runs start in a few seconds).
Tests share it and keep apart by topic prefix and consumer group: every test gets its own.

A broker must never outlive the test run: the fixture's finalizer stops it, LocalKafkaBroker
registers an ``atexit`` hook as well, and the script's watchdog stops it when this process is
gone even after a SIGKILL (no Python clean-up runs then).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.certs import STANDARD as STANDARD_IDENTITIES
from launch.certs import ensure as ensure_certs
from launch.kafka_broker import LocalKafkaBroker
from tests.integration.processes import print_own_log_lines
from tierflow.identity import Identity
from tierflow.kafka_settings import KafkaSettings


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Keeps each phase's report on the test item (``item.rep_call``), so that a fixture's
    teardown can tell whether the test failed (``processes.failed``) and print the logs."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(autouse=True)
def _shared_stack_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """A class- or module-scoped stack outlives the test, so ``stop_started`` never sees it
    fail: this prints the own log lines of every stack the failed test used (a fixture value
    with a ``processes()`` method), the only record in CI of what its services did."""
    yield
    report = getattr(request.node, "rep_call", None)
    if report is None or not report.failed:
        return
    for value in getattr(request.node, "funcargs", {}).values():
        if callable(getattr(value, "processes", None)):
            print_own_log_lines(value.processes())


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA of the test run's own, the standard identities and workers w0-w3: what
    ``tierflow certs --worker w0 ...`` makes."""
    directory = tmp_path_factory.mktemp("certs")
    workers = [Identity.worker(f"w{i}") for i in range(4)]
    ensure_certs(directory, [*STANDARD_IDENTITIES, *workers])
    return directory


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafkaBroker]:
    """A running broker; ``kafka.bootstrap`` is its address."""
    if shutil.which("java") is None:  # a real broker is the point: fail, never skip
        pytest.fail("the integration tests run a real Kafka broker, which needs Java 17+ on PATH")
    broker = LocalKafkaBroker()
    try:
        broker.start(data_dir=tmp_path_factory.mktemp("kafka"))
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[LocalKafkaBroker]:
    """A broker of the test's own, which it may stop and start again (the session's it may not:
    every other test uses that one); its data is in ``tmp_path / "kafka"``."""
    broker = LocalKafkaBroker()
    broker.start(data_dir=tmp_path / "kafka")
    yield broker
    broker.stop()


@pytest.fixture
def topic_prefix() -> str:
    """A prefix no other test uses, so that each test has topics (and a group) of its own."""
    return f"t{uuid.uuid4().hex[:12]}."


@pytest.fixture
def kafka_settings(kafka: LocalKafkaBroker, topic_prefix: str) -> KafkaSettings:
    return KafkaSettings(
        bootstrap=kafka.bootstrap, topic_prefix=topic_prefix, group_id=f"{topic_prefix}queue"
    )
