#!/usr/bin/env bash
# Print the path of a Prometheus server binary; install Debian's `prometheus` package first when
# there is none (CI machines: apt-get needs root). Exits non-zero when neither works, so the
# integration test that scrapes the stack fails rather than skips.
#
#   scripts/prometheus.sh          -> /usr/bin/prometheus
#   TIERFLOW_PROMETHEUS=/opt/prometheus/prometheus scripts/prometheus.sh   (use that one)
set -euo pipefail

if [[ -n "${TIERFLOW_PROMETHEUS:-}" ]]; then
  exec echo "$TIERFLOW_PROMETHEUS"
fi
if found=$(command -v prometheus); then
  exec echo "$found"
fi
if command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
  # The package's service is not started in a container without systemd; we only want the binary.
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >&2 \
    || { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y \
           --no-install-recommends prometheus >&2; }
  command -v prometheus
  exit
fi
echo "no prometheus binary, and apt-get (as root) is not available to install it" >&2
exit 1
