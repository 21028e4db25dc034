#!/usr/bin/env bash
# Checks what `make demo` or `make test` needs outside Python's own packages, before anything
# is installed or started; says what is missing and how to install it, and exits 1 if anything
# is. Run first by both make targets.
#
#   scripts/doctor.sh demo   Python 3.11+, Java 17+, Maven (until Kafka's jars are cached)
#   scripts/doctor.sh test   the same, plus curl, Prometheus (prometheus and promtool) and kubectl
#
# Prometheus and kubectl it installs itself, as scripts/prometheus.sh always has: as root with
# apt-get (Debian's `prometheus` package has both binaries). TIERFLOW_NO_INSTALL=1: only check.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mode=${1:-test}
missing=0

need() {  # need WHAT HOW-TO-INSTALL: report one missing thing
  echo "missing: $1" >&2
  echo "  install: $2" >&2
  missing=1
}

major() {  # the first number in a version string
  sed -E 's/[^0-9]*([0-9]+).*/\1/' <<<"$1"
}

check_python() {
  local py=${PYTHON:-python3}
  if ! command -v "$py" >/dev/null; then
    need "$py (Python 3.11+)" "apt-get install python3 python3-venv (or set PYTHON=/path/to/python3.11+)"
  elif ! "$py" -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    need "Python 3.11+ with venv ($py is $("$py" -V 2>&1))" \
      "a Python 3.11+ with its venv module, then PYTHON=/path/to/it make ..."
  fi
}

check_java() {
  if ! command -v java >/dev/null; then
    need "java (17+, runs the Kafka broker)" "apt-get install openjdk-17-jre-headless"
    return
  fi
  local version
  version=$(java -version 2>&1 | sed -nE 's/.*version "([^"]+)".*/\1/p' | head -1)
  if [[ -z "$version" || $(major "$version") -lt 17 ]]; then
    need "Java 17+ (java is ${version:-unknown})" "apt-get install openjdk-17-jre-headless"
  fi
}

check_maven() {  # fetches Kafka's jars from Maven Central once; not needed after that
  if ! bash "$here/kafka.sh" fetched && ! command -v mvn >/dev/null; then
    need "mvn (fetches Kafka's jars once, into ~/.cache/tierflow/kafka/)" "apt-get install maven"
  fi
}

check_prometheus() {  # the integration test scrapes the stack; a unit test runs promtool
  if [[ -z "${TIERFLOW_PROMETHEUS:-}" ]] && ! command -v prometheus >/dev/null \
    || ! command -v promtool >/dev/null; then
    if [[ "${TIERFLOW_NO_INSTALL:-}" != 1 && $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
      echo "doctor: installing Debian's prometheus package (prometheus, promtool)" >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >&2 \
        || { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y \
          --no-install-recommends prometheus >&2; }
    fi
  fi
  if [[ -z "${TIERFLOW_PROMETHEUS:-}" ]] && ! command -v prometheus >/dev/null; then
    need "prometheus (the server, for the metrics integration test)" \
      "apt-get install prometheus (or TIERFLOW_PROMETHEUS=/path/to/prometheus)"
  fi
  if ! command -v promtool >/dev/null; then
    need "promtool (checks the monitoring profile's config)" \
      "apt-get install prometheus (it ships promtool), or put promtool on PATH"
  fi
}

check_kubectl() {  # renders deploy/kubernetes/ (its kustomize) in the manifest tests
  if ! command -v kubectl >/dev/null \
    && [[ "${TIERFLOW_NO_INSTALL:-}" != 1 && $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "doctor: installing Debian's kubectl package (kustomize built in)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends kubectl >&2 \
      || { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y \
        --no-install-recommends kubectl >&2; }
  fi
  if ! command -v kubectl >/dev/null; then
    need "kubectl (renders the Kubernetes manifests with its kustomize; no cluster needed)" \
      "apt-get install kubectl (or put a kubectl 1.27+ on PATH)"
  fi
}

check_python
check_java
check_maven
if [[ "$mode" == test ]]; then
  command -v curl >/dev/null || need "curl (the README's curl examples run in the tests)" \
    "apt-get install curl"
  check_prometheus
  check_kubectl
elif [[ "$mode" != demo ]]; then
  echo "usage: scripts/doctor.sh demo|test" >&2
  exit 2
fi
if ((missing)); then
  echo "doctor: install the above and run 'make $mode' again" >&2
  exit 1
fi
echo "doctor: everything 'make $mode' needs is here" >&2
