"""The operator's loop against the real parts: the local stack (Kafka, an old and a canary queue
service with a worker each, the gateway, Envoy) serving a known workload, a real Prometheus
server scraping every service and Envoy (and answering the Kubernetes autoscaler's queries),
the request log read back from Kafka, and the canary weight changed through `tierflow canary
set`.
"""

from __future__ import annotations

import ipaddress
import json
import math
import subprocess
import time
from collections import Counter
from pathlib import Path

import grpc
import psutil
import pytest
import yaml

from gateway.demo_keys import DEMO_KEYS
from launch.local_stack import LocalStack, StackConfig
from launch.processes import python_module
from launch.prometheus import PrometheusServer, scrape_config
from ops.records import LogRecord, iter_kafka
from tierflow.client import TierflowClient
from tierflow.kafka_settings import KafkaSettings

REPO = Path(__file__).resolve().parents[2]
SCALED_OBJECT = REPO / "deploy/kubernetes/overlays/gpu/scaledobject.yaml"
MODEL = "tiny-llama"
FIRST = {"critical": 4, "standard": 3, "batch": 2}  # weight 0: all to the old deployment
THEN = {"critical": 3, "standard": 1, "batch": 1}  # weight 100: all to the canary
DENIED = 2  # unknown key: the gateway refuses


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cfg = StackConfig(
        model=MODEL, policy="chunked", canary_policy="flowprefill",
        log_dir=tmp_path_factory.mktemp("stack"),
    )  # fmt: skip
    with LocalStack(cfg) as running:
        yield running


def send(envoy: str, counts: dict[str, int]) -> None:
    for tier, n in counts.items():
        with TierflowClient(envoy, api_key=DEMO_KEYS[tier]) as client:
            for i in range(n):
                done = client.complete(f"hello {tier} {i}", max_new_tokens=3, timeout=120)
                assert done.text is not None


def send_denied(envoy: str) -> None:
    with TierflowClient(envoy, api_key="tf-not-a-key-0123456789abcdef") as client:
        for _ in range(DENIED):
            with pytest.raises(grpc.RpcError) as err:
                client.complete("hello", max_new_tokens=1, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def request_log(kafka: KafkaSettings, expected: int, timeout_s: float = 30.0) -> list[LogRecord]:
    deadline = time.monotonic() + timeout_s
    while True:
        records = [LogRecord.from_proto(m) for m in iter_kafka(kafka)]
        if len(records) >= expected or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def canary(admin: str, *args: str) -> dict:
    """`tierflow canary ...` as a command of its own (what an operator runs)."""
    done = subprocess.run(
        python_module("launch.cli", "canary", *args, "--admin", admin),
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)


def test_canary_weight_moves_requests_and_the_request_log_and_metrics_count_them(stack, tmp_path):
    e = stack.endpoints
    assert canary(e.envoy_admin, "set", "--weight", "0")["weights"] == {
        "queue_service": 100, "queue_service_canary": 0,
    }  # fmt: skip
    send(e.envoy, FIRST)
    send_denied(e.envoy)
    status = canary(e.envoy_admin, "set", "--weight", "100")
    assert status["weights"]["queue_service_canary"] == 100
    send(e.envoy, THEN)

    # The request log: one record per request, on the side the weight chose.
    total = sum(FIRST.values()) + sum(THEN.values())
    records = request_log(e.operator_kafka(), total)  # as the operator, over mTLS
    by_side = Counter((r.deployment, r.tier) for r in records)
    assert by_side == Counter(
        {("primary", t): n for t, n in FIRST.items()} | {("canary", t): n for t, n in THEN.items()}
    )
    assert {r.status for r in records} == {"done"}
    assert {r.key_id for r in records} == {f"demo-{t}" for t in FIRST}  # labels, never keys
    assert {r.policy for r in records if r.deployment == "canary"} == {"flowprefill"}
    assert all(r.ttft_s and r.output_tokens >= 1 and r.prompt_tokens > 0 for r in records)

    # A real Prometheus scrapes every service and Envoy; its API reports the workload's counts.
    prom = PrometheusServer(scrape_config(e.metrics, e.envoy_admin), tmp_path / "prometheus")
    try:
        check_prometheus(prom, jobs=len(e.metrics) + 1)
    finally:
        prom.stop()


def wait_for(prom: PrometheusServer, expr: str, by: str, expected, timeout_s=60.0) -> dict:
    """The query's values once they equal ``expected`` (or satisfy it, a callable), or what
    they are after ``timeout_s``: each service is scraped on its own schedule."""
    done = expected if callable(expected) else expected.__eq__
    deadline = time.monotonic() + timeout_s
    while True:
        got = prom.values(expr, by)
        if done(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def check_prometheus(prom: PrometheusServer, jobs: int) -> None:
    up = wait_for(prom, "up", "job", lambda up: len(up) == jobs and min(up.values()) == 1)
    assert len(up) == jobs and set(up.values()) == {1.0}, up
    for side, sent in (("primary", FIRST), ("canary", THEN)):
        expected = {t: float(n) for t, n in sent.items()}
        done = f'sum by (tier) (tierflow_requests_total{{deployment="{side}",status="done"}})'
        assert wait_for(prom, done, "tier", expected) == expected
        ttft = f'sum by (tier) (tierflow_ttft_seconds_count{{deployment="{side}"}})'
        assert prom.values(ttft, "tier") == expected
        busy = f'tierflow_engine_busy_seconds_total{{deployment="{side}"}}'
        assert sum(wait_for(prom, busy, "worker", lambda w: sum(w.values()) > 0).values()) > 0
    allowed = "sum by (tier) (tierflow_gateway_decisions_total{decision='allowed'})"
    everything = Counter(FIRST) + Counter(THEN)
    assert prom.values(allowed, "tier") == {t: float(n) for t, n in everything.items()}
    denied = "sum by (reason) (tierflow_gateway_decisions_total{decision='denied'})"
    assert prom.values(denied, "reason") == {"unknown key": float(DENIED)}
    # Envoy's own stats: each side's cluster received its requests.
    rq = "envoy_cluster_upstream_rq_total"
    clusters = prom.values(rq, "envoy_cluster_name")
    assert clusters["queue_service"] >= sum(FIRST.values())
    assert clusters["queue_service_canary"] >= sum(THEN.values())
    # Every tierflow series names its deployment, none a request.
    series = prom.query('{__name__=~"tierflow_.+"}')
    assert series and all(s["metric"].get("deployment") for s in series)
    assert not any("request_id" in s["metric"] for s in series)
    # The workers' autoscaler (KEDA's Prometheus scaler on Kubernetes) asks these: each answers
    # one number on the real series (all requests are done: no backlog).
    triggers = yaml.safe_load(SCALED_OBJECT.read_text())["spec"]["triggers"]
    for query in (t["metadata"]["query"] for t in triggers):
        got = wait_for(prom, query, "", lambda v: len(v) == 1)
        assert len(got) == 1 and 0 <= got[""] < math.inf, (query, got)
    backlog = prom.values(triggers[0]["metadata"]["query"], "")
    assert triggers[0]["name"] == "critical-backlog" and backlog == {"": 0.0}


def test_every_listener_of_the_stack_binds_loopback(stack):
    """Nothing that `tierflow up` starts listens beyond this machine, metrics and Kafka
    included: inside the edge a port is trusted, so only loopback may reach one."""
    ours = [psutil.Process(p.proc.pid) for p in stack.processes]
    ours = [*ours, *(child for proc in ours for child in proc.children(recursive=True))]
    kafka = [
        proc
        for proc in psutil.process_iter(["cmdline"])
        if any(str(stack.broker.data_dir) in part for part in proc.info["cmdline"] or ())
    ]
    assert kafka, "the stack's Kafka broker was not found"
    listening = [
        (proc.name(), conn.laddr.ip, conn.laddr.port)
        for proc in (*ours, *kafka)
        for conn in proc.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    ]
    ports = {port for _, _, port in listening}
    for endpoint in (*stack.endpoints.metrics.values(), stack.endpoints.kafka):
        assert int(endpoint.rsplit(":", 1)[1]) in ports, endpoint
    assert all(loopback(ip) for _, ip, _ in listening), listening


def loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4 loopback address mapped into IPv6 (a dual-stack socket
    bound to ``::ffff:127.0.0.1``)."""
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)
