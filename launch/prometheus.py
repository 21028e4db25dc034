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
from datetime import datetime
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


def _unix(stamp: str) -> float:
    """An RFC 3339 time as Prometheus writes it (nanoseconds: Python keeps microseconds); 0 for
    Go's zero time (never scraped)."""
    if not stamp or stamp.startswith("0001-"):
        return 0.0
    return datetime.fromisoformat(stamp).timestamp()


class PrometheusApi:
    """Queries through a Prometheus server's HTTP API (``url``: http://host:port)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def query(self, expr: str, at_s: float | None = None) -> list[dict]:
        """An instant query's result vector (each: {"metric": labels, "value": [t, "v"]}), now
        or at Unix time ``at_s``."""
        params = {"query": expr} | ({} if at_s is None else {"time": f"{at_s:.3f}"})
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.load(reply)
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return body["data"]["result"]

    def values(self, expr: str, by: str, at_s: float | None = None) -> dict[str, float]:
        """``expr``'s result as label ``by`` -> value."""
        return {r["metric"].get(by, ""): float(r["value"][1]) for r in self.query(expr, at_s)}

    def scraped_after(self, at_s: float, timeout_s: float = 30.0) -> None:
        """Wait until every target has been scraped after Unix time ``at_s``, so that a query
        then sees what the services counted up to ``at_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            url = f"{self.url}/api/v1/targets?state=active"
            with urllib.request.urlopen(url, timeout=10) as reply:
                targets = json.load(reply)["data"]["activeTargets"]
            scraped = [t.get("lastScrape", "") for t in targets]
            if targets and all(_unix(s) > at_s for s in scraped):
                return
            time.sleep(0.5)
        raise TimeoutError(f"prometheus: not every target scraped within {timeout_s} s")

    def busy_fractions(
        self, since_s: float, until_s: float, workers: dict[str, int]
    ) -> dict[str, float]:
        """Each deployment's mean engine busy fraction per worker over [since_s, until_s] (Unix
        times), from the workers' ``tierflow_engine_busy_seconds_total``. A worker restarted in
        the window resets its counter: its busy time before the restart is not counted."""
        expr = "sum by (deployment) (tierflow_engine_busy_seconds_total)"
        before = self.values(expr, "deployment", at_s=since_s)
        after = self.values(expr, "deployment", at_s=until_s)
        span = until_s - since_s
        return {
            dep: max(0.0, after.get(dep, 0.0) - before.get(dep, 0.0)) / span / n
            for dep, n in workers.items()
        }


class PrometheusServer(PrometheusApi):
    """A Prometheus process of its own (``work_dir`` holds its config and data)."""

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
        super().__init__(f"http://127.0.0.1:{self.port}")
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

    def stop(self) -> None:
        self.proc.stop()
