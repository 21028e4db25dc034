"""The layering of the packages, checked on the source: a lower layer never imports a higher one.

tierflow (shared: tiers, settings, client, catalogue, logging, stubs)
  <- worker, queue_service, gateway, openai_api (services: never each other)
  <- bench (in-process harnesses of the worker and the queue service)
  <- ops (the operator's audit, canary and compare; reads bench's traces)
  <- launch (the entry layer: command line, local stack; may import everything)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = (
    "tierflow", "worker", "queue_service", "gateway", "openai_api", "bench", "ops", "launch",
)  # fmt: skip
ALLOWED = {
    "tierflow": {"tierflow"},
    "worker": {"tierflow", "worker"},
    "queue_service": {"tierflow", "queue_service"},
    "gateway": {"tierflow", "gateway"},
    "openai_api": {"tierflow", "openai_api"},
    "bench": {"tierflow", "worker", "queue_service", "bench"},
    "ops": {"tierflow", "queue_service", "bench", "ops"},
    "launch": set(PACKAGES),
}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
    return found & set(PACKAGES)


@pytest.mark.parametrize("package", [p for p in PACKAGES if (REPO / p).is_dir()])
def test_a_package_imports_only_the_layers_below_it(package):
    wrong = {
        str(path.relative_to(REPO)): sorted(imported_packages(path) - ALLOWED[package])
        for path in (REPO / package).rglob("*.py")
    }
    assert {path: bad for path, bad in wrong.items() if bad} == {}
