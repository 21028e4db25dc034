"""`tierflow bench --flood`: its arrivals, its scenarios and its verdicts (``bench.flood``),
and the command end to end on the tiny model."""

from __future__ import annotations

import json

import pytest

from bench.event_log import read
from bench.flood import (
    SCENARIOS,
    FloodConfig,
    checks,
    flood_workload,
    scenario_setup,
    summarise_flood,
)
from bench.harness import RequestRecord
from bench.workload import Arrival
from launch.cli import main
from tierflow.tiers import load_tiers

CFG = FloodConfig(calm_requests=200, seed=3)


def test_the_calm_key_sends_its_requests_at_its_share_and_the_flood_three_capacities():
    capacity = 10.0
    flooded = flood_workload(CFG, capacity, with_flood=True)
    alone = flood_workload(CFG, capacity, with_flood=False)
    calm = [a for a in flooded.arrivals if a.key_id == "calm"]
    flood = [a for a in flooded.arrivals if a.key_id == "flood"]
    assert len(calm) == 200 and all(a.tier == "critical" for a in calm + flood)
    duration = 200 / (CFG.calm_share * capacity)  # 80 s
    assert 0.85 < len(flood) / (3 * capacity * duration) < 1.15
    # The same calm arrivals with the flood left out; standard and batch traffic in both.
    assert [a.at_s for a in alone.arrivals if a.key_id == "calm"] == [a.at_s for a in calm]
    assert not [a for a in alone.arrivals if a.key_id == "flood"]
    assert {a.tier for a in alone.arrivals} == {"critical", "standard", "batch"}
    assert max(a.prompt_tokens for a in calm + flood) <= 96  # short: within the SLO alone
    # Standard's own short requests, enough for its check to have an n, the same in both.
    chat = [a for a in flooded.arrivals if a.key_id == "chat"]
    assert {a.tier for a in chat} == {"standard"}
    assert 0.8 < len(chat) / (CFG.chat_share * capacity * duration) < 1.2
    assert [a.at_s for a in alone.arrivals if a.key_id == "chat"] == [a.at_s for a in chat]


def test_each_scenario_sets_its_rule_keys_and_admission():
    tiers = load_tiers(None)
    workloads = {
        "calm": flood_workload(CFG, 10.0, with_flood=False),
        "flood": flood_workload(CFG, 10.0, with_flood=True),
    }
    setups = {name: scenario_setup(name, tiers, workloads) for name in SCENARIOS}
    assert setups["calm alone"][1] is workloads["calm"] and setups["calm alone"][2]
    assert setups["flood, downgrade"][0]["critical"].overflow == "downgrade"
    assert setups["flood, reject"][0]["critical"].overflow == "reject"
    off_tiers, off_load, admission = setups["flood, off"]
    assert off_tiers["critical"].overflow is None and not admission
    assert {a.key_id for a in off_load.arrivals} == {""}  # one key: no fair order


def record(rid: str, tier: str, served: str | None, ttft_s: float | None) -> RequestRecord:
    key = rid.split("-")[0] if rid.split("-")[0] in ("calm", "flood") else ""
    r = RequestRecord(Arrival(0.0, rid, tier, 50, key_id=key), arrived_at=0.0)
    r.served_tier = served
    if served is None:
        r.rejected = "at capacity"
    elif ttft_s is not None:
        r.first_token_at, r.done_at = ttft_s, ttft_s + 0.1
    return r


def test_the_summary_counts_each_group_of_the_issue():
    records = [
        record("calm-1", "critical", "critical", 0.1),
        record("calm-2", "critical", "critical", 0.5),  # late
        record("flood-1", "critical", "critical", 0.2),
        record("flood-2", "critical", "standard", 1.0),  # downgraded, within standard's SLO
        record("flood-3", "critical", None, None),  # rejected
        record("stan-1", "standard", "standard", 2.0),
        record("stan-2", "standard", "standard", None),  # never finished: lost
    ]
    summary = summarise_flood({r.arrival.request_id: r for r in records}, load_tiers(None))
    assert (summary["calm at critical"]["met"], summary["calm at critical"]["n"]) == (1, 2)
    assert (summary["admitted critical"]["met"], summary["admitted critical"]["n"]) == (2, 3)
    assert (summary["flood admitted"]["met"], summary["flood admitted"]["n"]) == (1, 3)
    assert (summary["downgraded"]["met"], summary["downgraded"]["n"]) == (1, 1)
    assert summary["rejected"] == 1 and summary["lost"] == 1
    assert (summary["standard own"]["met"], summary["standard own"]["n"]) == (1, 2)
    verdict = checks({name: summary for name in SCENARIOS})
    assert verdict["calm key >= 0.99 over >= 200"] is False and verdict["none lost"] is False
    standard = "standard no more than 5 points below reject run"
    assert verdict[standard] is True
    every = {name: summary for name in SCENARIOS}
    starved = {**summary, "standard own": {"met": 0, "n": 2, "rate": 0.0}}
    assert not checks({**every, "flood, downgrade": starved})[standard]  # downgrading cost it
    assert checks({**every, "flood, reject": starved})[standard]  # rejecting was the worse


def test_the_flood_command_runs_every_scenario_and_writes_json_and_png(tmp_path):
    out, png = tmp_path / "flood.json", tmp_path / "flood.png"
    logs = tmp_path / "events"
    args = ["bench", "--flood", "--flood-calm", "10", "--model", "tiny-llama", "--quick",
            "--json", str(out), "--plot", str(png), "--event-log", str(logs)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert list(result["scenarios"]) == list(SCENARIOS)
    probe = result["capacity_measurement"]
    assert probe["probes"] == 24 and probe["probe_ttft_ms"] > 0 and probe["bare_prefill_ms"] > 0
    assert result["critical_capacity_per_s"] == pytest.approx(1000 / probe["probe_ttft_ms"])
    for scenario in result["scenarios"].values():
        assert scenario["calm at critical"]["n"] == 10
        assert scenario["lost"] == 0
    assert result["scenarios"]["calm alone"]["flood admitted"]["n"] == 0
    assert set(result["checks"]) >= {"none lost", "admitted critical >= 0.99"}
    assert png.stat().st_size > 0
    # One timeline per scenario; where admission ran, every arrival's placement and the
    # predictions it was judged by.
    assert sorted(p.name for p in logs.iterdir()) == sorted(
        f"{name.replace(', ', '_').replace(' ', '_')}.jsonl" for name in SCENARIOS
    )
    admitted = [r for r in read(logs / "flood_downgrade.jsonl") if r["kind"] == "admit"]
    assert len(admitted) == result["requests"]["flood"]  # every arrival of the scenario
    flooded = result["scenarios"]["flood, downgrade"]
    critical = [r for r in admitted if r["requested"] == "critical"]
    assert len(critical) == flooded["calm at critical"]["n"] + flooded["flood admitted"]["n"]
    for record in admitted:
        served = record["served"]
        last = record["verdicts"][-1] if record["verdicts"] else None
        if last is not None:  # the rule applied: the last verdict is the one that decided
            assert last["admit"] == (served == last["tier"])
            work_s = last["wait_s"] + last["own_s"] + last["margin"] * last["inflated_s"]
            parts = last["switch_s"] + work_s + last["error_s"]
            assert last["predicted_ttft_s"] == pytest.approx(parts)
    assert not [r for r in read(logs / "flood_off.jsonl") if r["kind"] == "admit"]
