"""The compose monitoring profile: Prometheus's config is valid (its own promtool), and every
tierflow metric the Grafana dashboard queries is one a service defines."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from tests.metric_names import defined_metric_names

REPO = Path(__file__).resolve().parents[2]


def test_the_dashboard_queries_only_metrics_that_exist():
    dashboard = json.loads((REPO / "docker/grafana/dashboards/tierflow.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\btierflow_[a-z_]+", e)}
    assert used and used <= defined_metric_names(), used - defined_metric_names()


def test_prometheus_config_is_valid():
    promtool = shutil.which("promtool")
    assert promtool, "promtool comes with the prometheus package: scripts/prometheus.sh"
    config = REPO / "docker/prometheus/prometheus.yml"
    done = subprocess.run([promtool, "check", "config", str(config)], capture_output=True)
    assert done.returncode == 0, done.stdout + done.stderr
