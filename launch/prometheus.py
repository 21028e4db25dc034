"""A real Prometheus server scraping the local stack (the integration test, and anyone who wants
to look at the local stack's metrics): the scrape configuration for the stack's endpoints, the
process, and queries through Prometheus's own HTTP API.

The binary comes from ``scripts/prometheus.sh`` (``$TIERFLOW_PROMETHEUS``, else ``prometheus`` on
PATH, else Debian's package is installed).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from launch.processes import REPO, ServiceProcess, free_port


def prometheus_binary() -> str:
    done = subprocess.run(
        [str(REPO / "scripts" / "prometheus.sh")], capture_output=True, text=True, check=False
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise FileNotFoundError(f"no Prometheus server: {done.stderr.strip()}")
    return done.stdout.strip().splitlines()[-1]


def scrape_config(metrics: dict[str, str], envoy_admin: str = "", interval_s: float = 1.0) -> dict:
    """One job per tierflow service (``metrics``: name -> host:port) and one for Envoy's admin
    ``/stats/prometheus``."""
    jobs = [
        {"job_name": name, "static_configs": [{"targets": [target]}]}
        for name, target in sorted(metrics.items())
    ]
    if envoy_admin:
        jobs.append(
            {
                "job_name": "envoy",
                "metrics_path": "/stats/prometheus",
                "static_configs": [{"targets": [envoy_admin]}],
            }
        )
    interval = f"{int(interval_s * 1000)}ms"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": jobs,
    }


class PrometheusServer:
    def __init__(self, config: dict, work_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        work_dir.mkdir(parents=True, exist_ok=True)
        config_path = work_dir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.proc = ServiceProcess(
            "prometheus",
            [
                prometheus_binary(),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={work_dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            work_dir / "prometheus.log",
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"prometheus exited:\n{self.proc.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"prometheus not ready:\n{self.proc.log_tail()}")

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector (each: {"metric": labels, "value": [t, "v"]})."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.load(reply)
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return body["data"]["result"]

    def values(self, expr: str, by: str) -> dict[str, float]:
        """``expr``'s result as label ``by`` -> value."""
        return {r["metric"].get(by, ""): float(r["value"][1]) for r in self.query(expr)}

    def stop(self) -> None:
        self.proc.stop()
