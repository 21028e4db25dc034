"""Usage metering: ``tierflow usage``'s rows, its CSV and JSON, the token counters, and the
record of a request refused at admission."""

from __future__ import annotations

import csv
import json

from ops.records import LogRecord
from ops.usage import usage_rows, write_csv, write_json
from queue_service.core.finished import refused_record
from queue_service.metrics import QueueServiceMetrics
from tierflow.v1 import queue_pb2

SLOS = {"critical": 0.3, "standard": 3.0, "batch": 120.0}


def record(key: str, tier: str, *, status: str = "done", ttft_s: float | None = 0.1,
           requested: str = "", prompt: int = 100, output: int = 10) -> LogRecord:  # fmt: skip
    return LogRecord(
        tier=tier,
        prompt_tokens=prompt,
        output_tokens=output if status == "done" else 0,
        arrival_s=0.0,
        status=status,
        ttft_s=ttft_s if status == "done" else None,
        slo_s=SLOS[tier],
        key_id=key,
        requested_tier=requested,
    )


RECORDS = [
    record("acme", "critical"),
    record("acme", "critical", ttft_s=0.5),  # done, over the SLO
    record("acme", "standard", requested="critical", ttft_s=1.0),  # downgraded, within
    record("acme", "standard", status="shed", requested="critical"),  # refused further down
    record("zeta", "critical", prompt=40, output=4),
    record("zeta", "critical", status="cancelled"),
]


def by_key(rows) -> dict:
    return {(r.key, r.served_tier): r for r in rows}


def test_rows_per_key_and_served_tier_count_tokens_of_done_requests_only():
    rows = by_key(usage_rows(RECORDS))
    acme = rows["acme", "critical"]
    assert (acme.requests, acme.done, acme.slo_met) == (2, 2, 1)
    assert (acme.prompt_tokens, acme.output_tokens, acme.downgraded, acme.refused) == (
        200, 20, 0, 0,
    )  # fmt: skip
    down = rows["acme", "standard"]
    assert (down.requests, down.done, down.downgraded, down.refused) == (2, 1, 2, 1)
    assert (down.prompt_tokens, down.slo_met) == (100, 1)
    zeta = rows["zeta", "critical"]
    assert (zeta.requests, zeta.done, zeta.prompt_tokens, zeta.output_tokens) == (2, 1, 40, 4)


def test_the_totals_close_the_list_and_equal_the_sum_of_the_keys():
    rows = usage_rows(RECORDS)
    assert [(r.key, r.served_tier) for r in rows] == [
        ("acme", "critical"), ("acme", "standard"), ("zeta", "critical"),
        ("*", "critical"), ("*", "standard"), ("*", "*"),
    ]  # fmt: skip
    total = rows[-1]
    assert total.requests == len(RECORDS)
    assert total.prompt_tokens == sum(r.prompt_tokens for r in rows[:3])
    assert total.downgraded == 2 and total.refused == 1


def test_csv_and_json_hold_the_same_rows(tmp_path):
    rows = usage_rows(RECORDS)
    with write_csv(rows, tmp_path / "u.csv").open() as f:
        from_csv = list(csv.DictReader(f))
    document = json.loads(write_json(rows, tmp_path / "u.json", window={"source": "x"}).read_text())
    assert len(from_csv) == len(document["rows"]) == len(rows)
    for line, obj in zip(from_csv, document["rows"], strict=True):
        assert {k: str(v) for k, v in obj.items()} == line
    assert document["window"] == {"source": "x"}


def test_a_request_refused_at_admission_is_logged_as_shed_with_both_tiers():
    queued = queue_pb2.QueuedRequest(
        request_id="acme/r1", tier="standard", requested_tier="critical", key_id="acme",
        prompt_ids=[1, 2, 3], arrival_unix_ms=5,
    )  # fmt: skip
    finished = refused_record(queued, deployment="primary", policy="flowprefill", slo_s=3.0)
    assert (finished.status, finished.tier, finished.requested_tier) == (
        "shed", "standard", "critical",
    )  # fmt: skip
    assert (finished.prompt_tokens, finished.output_tokens, finished.key_id) == (3, 0, "acme")
    assert LogRecord.from_proto(finished).requested_tier == "critical"


def finished(key: str, tier: str, requested: str = "", status: str = "done"):
    return queue_pb2.FinishedRequest(
        request_id=f"{key}/x", tier=tier, requested_tier=requested, key_id=key, status=status,
        prompt_tokens=100, output_tokens=10, ttft_ms=50, slo_ms=SLOS[tier] * 1000,
    )  # fmt: skip


def test_token_counters_by_tier_asked_and_served_and_per_key_with_a_cap():
    metrics = QueueServiceMetrics("primary", SLOS, max_key_series=2)
    for rec in (
        finished("acme", "critical"),
        finished("acme", "standard", requested="critical"),
        finished("zeta", "standard"),
        finished("mallory", "standard"),  # a third label: past the cap, counted as other
        finished("acme", "critical", status="shed"),  # nothing served, no tokens
    ):
        metrics.request_ended(rec)

    def value(name, **labels):
        got = metrics.registry.get_sample_value(name, {"deployment": "primary", **labels})
        return got or 0.0

    tokens = "tierflow_tokens_total"
    assert value(tokens, tier="critical", served_tier="critical", kind="prompt") == 100
    assert value(tokens, tier="critical", served_tier="standard", kind="output") == 10
    assert value(tokens, tier="standard", served_tier="standard", kind="prompt") == 200
    per_key = "tierflow_key_tokens_total"
    assert value(per_key, key="acme", served_tier="standard", kind="prompt") == 100
    assert value(per_key, key="zeta", served_tier="standard", kind="prompt") == 100
    assert value(per_key, key="other", served_tier="standard", kind="prompt") == 100
    assert value(per_key, key="mallory", served_tier="standard", kind="prompt") == 0
