"""`tierflow canary set|status`: Envoy's split between the queue service and its canary, changed
and read at run time through Envoy's admin runtime (no restart, no config push).

The tier routes split with ``weighted_clusters.runtime_key_prefix: tierflow.canary`` (see
envoy/envoy.yaml): the weight of each cluster is read from the runtime key
``tierflow.canary.<cluster>``. ``set_weight(W)`` sets the canary's to W and the primary's to
100 - W, so W is the canary's percentage of new requests. The admin endpoint must stay on a
private address (it can change routing).
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request

PREFIX = "tierflow.canary"
PRIMARY, CANARY = "queue_service", "queue_service_canary"


def _url(admin: str, path: str) -> str:
    return f"http://{admin}{path}"


def set_weight(admin: str, weight: int, timeout_s: float = 5.0) -> None:
    if isinstance(weight, bool) or not 0 <= weight <= 100:
        raise ValueError(f"weight must be a percentage in [0, 100], got {weight!r}")
    query = urllib.parse.urlencode(
        {f"{PREFIX}.{CANARY}": str(weight), f"{PREFIX}.{PRIMARY}": str(100 - weight)}
    )
    request = urllib.request.Request(_url(admin, f"/runtime_modify?{query}"), method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        if reply.status != 200:
            raise RuntimeError(f"envoy admin refused the runtime change: {reply.status}")


def status(admin: str, timeout_s: float = 5.0) -> dict:
    """The weights in force (runtime overrides, else None: the config's defaults apply) and the
    requests each cluster received so far (Envoy's upstream_rq_total)."""
    with urllib.request.urlopen(_url(admin, "/runtime"), timeout=timeout_s) as reply:
        entries = json.load(reply).get("entries", {})
    weights = {}
    for cluster in (PRIMARY, CANARY):
        entry = entries.get(f"{PREFIX}.{cluster}")
        weights[cluster] = int(entry["final_value"]) if entry else None
    stats_path = "/stats?format=json&filter=" + urllib.parse.quote(r"upstream_rq_total$")
    with urllib.request.urlopen(_url(admin, stats_path), timeout=timeout_s) as reply:
        stats = json.load(reply).get("stats", [])
    requests = {
        cluster: next(
            (s.get("value", 0) for s in stats
             if s.get("name") == f"cluster.{cluster}.upstream_rq_total"),
            0,
        )
        for cluster in (PRIMARY, CANARY)
    }  # fmt: skip
    return {"weights": weights, "upstream_requests": requests}
