"""deploy/kubernetes/: both overlays render with kustomize (kubectl's own), every object is valid
against the Kubernetes schemas (kubernetes-validate, offline), and the invariants that a
schema cannot see hold: resources on every container, unprivileged containers, Services that
select pods and name their ports, ConfigMap and Secret keys that exist, ports that match each
service's own flags and Envoy's configuration, only the edge exposed, a worker's grace period
above its drain timeout, and an autoscaler that queries metrics the queue service defines
(checked by Prometheus's own promtool)."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.metric_names import defined_metric_names

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = REPO / "deploy/kubernetes/overlays"
# The oldest Kubernetes release still maintained when this was written; gRPC probes are GA
# since 1.27.
KUBERNETES_VERSION = "1.32.0"
WORKLOADS = ("Deployment", "StatefulSet")
# Envoy's canary upstream is deployed only for a rollout (a second queue service); Envoy keeps
# an upstream it cannot resolve empty and routes nothing to it at weight 0.
OPTIONAL_UPSTREAMS = {"queue-service-canary"}
# Where a pod's volume names what it reads: (kind, volume source, the field naming the object).
VOLUME_SOURCES = (("ConfigMap", "configMap", "name"), ("Secret", "secret", "secretName"))


@functools.cache
def render(overlay: str) -> list[dict]:
    """The overlay's objects, rendered once per test run (read-only to the tests)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl renders the manifests (kustomize): apt-get install kubectl"
    command = [kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone"]
    done = subprocess.run([*command, str(OVERLAYS / overlay)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [obj for obj in yaml.safe_load_all(done.stdout) if obj]


@pytest.fixture(scope="module", params=["dev", "gpu"])
def objects(request) -> list[dict]:
    return render(request.param)


def of_kind(objects: list[dict], *kinds: str) -> list[dict]:
    return [o for o in objects if o["kind"] in kinds]


def named(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def pod_specs(objects: list[dict]) -> list[tuple[str, dict]]:
    return [(w["metadata"]["name"], w["spec"]["template"]) for w in of_kind(objects, *WORKLOADS)]


def containers(pod: dict) -> list[dict]:
    spec = pod["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def flag(container: dict, name: str) -> str | None:
    """The value of ``--name=value`` in the container's arguments."""
    for arg in container.get("args", []):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return None


def container_ports(pod: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}


CUSTOM_KINDS = ("ScaledObject", "PodMonitor")  # KEDA's and the Prometheus Operator's


def test_every_object_is_valid_against_the_kubernetes_schemas(objects):
    custom = of_kind(objects, *CUSTOM_KINDS)
    for obj in objects:
        if obj in custom:
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    assert of_kind(objects, "Deployment") and of_kind(objects, "StatefulSet")


def test_every_container_has_requests_and_limits(objects):
    for name, pod in pod_specs(objects):
        for c in containers(pod):
            resources = c.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), (name, c["name"], kind)


def test_every_container_runs_unprivileged(objects):
    for name, pod in pod_specs(objects):
        pod_context = pod["spec"].get("securityContext", {})
        for c in containers(pod):
            context = {**pod_context, **c.get("securityContext", {})}
            assert context.get("runAsNonRoot") is True, (name, c["name"])
            assert context.get("allowPrivilegeEscalation") is False, (name, c["name"])
            assert context.get("capabilities", {}).get("drop") == ["ALL"], (name, c["name"])


def test_every_service_selects_a_pod_and_its_ports_exist_there(objects):
    pods = pod_specs(objects)
    for service in of_kind(objects, "Service"):
        selector = service["spec"]["selector"]
        matching = [pod for _, pod in pods if selector.items() <= pod["metadata"]["labels"].items()]
        assert matching, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for pod in matching:
                ports = container_ports(pod)
                assert target in ports or target in ports.values(), (service, target)
                if isinstance(target, str):
                    assert ports[target] == port["port"], (service["metadata"]["name"], port)


def test_every_configmap_and_secret_key_a_pod_reads_exists(objects):
    data = {
        (o["kind"], o["metadata"]["name"]): set(o.get("data", {})) | set(o.get("stringData", {}))
        for o in of_kind(objects, "ConfigMap", "Secret")
    }
    for name, pod in pod_specs(objects):
        for volume in pod["spec"].get("volumes", []):
            for kind, source, key in VOLUME_SOURCES:
                if source in volume:
                    ref = (kind, volume[source][key])
                    assert ref in data, (name, ref)
                    items = {i["key"] for i in volume[source].get("items", [])}
                    assert items <= data[ref], (name, ref, items - data[ref])
        for c in containers(pod):
            defined = {e["name"] for e in c.get("env", [])}
            for source in c.get("envFrom", []):
                ref = ("ConfigMap", source["configMapRef"]["name"])
                assert ref in data, (name, ref)
                defined |= data[ref]
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["key"] in data[("ConfigMap", ref["name"])], (name, ref)
            # Kubernetes expands $(VAR) in the command and arguments only from the container's
            # environment ($$ is a literal $).
            words = [*c.get("command", []), *c.get("args", [])]
            used = {v for a in words for v in re.findall(r"(?<!\$)\$\((\w+)\)", a)}
            assert used <= defined, (name, c["name"], used - defined)


def test_ports_match_each_services_own_flags_and_probes(objects):
    for name, pod in pod_specs(objects):
        ports = set(container_ports(pod).values()) | set(container_ports(pod))
        for c in pod["spec"]["containers"]:
            listen = flag(c, "listen")
            declared = [int(listen.rsplit(":", 1)[1])] if listen else []
            declared += [int(flag(c, f)) for f in ("metrics-port", "health-port") if flag(c, f)]
            assert set(declared) <= ports, (name, declared)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                spec = c.get(probe)
                if spec is None:
                    continue
                for handler in ("grpc", "httpGet", "tcpSocket"):
                    if handler in spec:
                        assert spec[handler]["port"] in ports, (name, probe)


def service_port(objects: list[dict], host: str) -> set[int]:
    """The ports a client reaches at ``host`` (a Service, or a StatefulSet pod's own name)."""
    name = host.split(".")[-1] if "." in host else host
    services = [s for s in of_kind(objects, "Service") if s["metadata"]["name"] == name]
    return {p["port"] for s in services for p in s["spec"]["ports"]}


def test_every_address_a_service_dials_is_a_service_of_the_manifests(objects):
    envoy_map = named(objects, "ConfigMap", _generated(objects, "envoy-config"))
    envoy_config = yaml.safe_load(envoy_map["data"]["envoy.yaml"])
    upstreams = [
        e["endpoint"]["address"]["socket_address"]
        for cluster in envoy_config["static_resources"]["clusters"]
        for group in cluster["load_assignment"]["endpoints"]
        for e in group["lb_endpoints"]
    ]
    assert upstreams
    for address in upstreams:
        if address["address"] in OPTIONAL_UPSTREAMS:
            continue
        assert address["port_value"] in service_port(objects, address["address"]), address
    envoy_pod = dict(pod_specs(objects))["envoy"]
    listeners = [
        listener["address"]["socket_address"]["port_value"]
        for listener in envoy_config["static_resources"]["listeners"]
    ]
    admin = envoy_config["admin"]["address"]["socket_address"]["port_value"]
    assert {*listeners, admin} <= set(container_ports(envoy_pod).values())
    settings = named(objects, "ConfigMap", _generated(objects, "tierflow-settings"))["data"]
    host, port = settings["TIERFLOW_KAFKA_BOOTSTRAP"].rsplit(":", 1)
    assert int(port) in service_port(objects, host)
    for name, pod in pod_specs(objects):
        for c in pod["spec"]["containers"]:
            target = flag(c, "queue-service")
            if target:
                host, port = target.rsplit(":", 1)
                assert int(port) in service_port(objects, host), (name, target)


def test_worker_n_attaches_to_queue_service_replica_n_mod_their_count(objects):
    """Every queue-service replica gets workers: worker N dials replica N mod R, R being the
    queue service's replica count, by the name its StatefulSet gives each pod."""
    worker = dict(pod_specs(objects))["worker"]
    (container,) = worker["spec"]["containers"]
    script = " ".join(container["command"])
    (address,) = re.findall(r"--queue-service=\"([^\"]+)\"", script)
    assert re.fullmatch(
        r"queue-service-\$\$\(\( \$\$\{HOSTNAME##\*-\} % TIERFLOW_QUEUE_REPLICAS \)\)"
        r"\.queue-service:(\d+)",
        address,
    ), address
    port = int(address.rsplit(":", 1)[1])
    queue = named(objects, "StatefulSet", "queue-service")
    assert queue["spec"]["serviceName"] == "queue-service"
    assert port in service_port(objects, "queue-service")
    settings = named(objects, "ConfigMap", _generated(objects, "tierflow-settings"))["data"]
    assert int(settings["TIERFLOW_QUEUE_REPLICAS"]) == queue["spec"].get("replicas", 1)
    assert container["command"][:2] == ["sh", "-c"] and script.split()[2] == "exec"  # PID 1


def test_every_object_lives_in_the_namespace(objects):
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "tierflow", obj["metadata"]["name"]


def test_kafkas_listeners_are_its_container_ports(objects):
    kafka = dict(pod_specs(objects))["kafka"]
    (container,) = kafka["spec"]["containers"]
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    names = ("KAFKA_LISTENERS", "KAFKA_ADVERTISED_LISTENERS", "KAFKA_CONTROLLER_QUORUM_VOTERS")
    ports = {int(p) for n in names for p in re.findall(r":(\d+)", env[n])}
    assert ports and ports <= set(container_ports(kafka).values()), ports


def _generated(objects: list[dict], prefix: str) -> str:
    """The name kustomize gave a generated ConfigMap (``prefix-<hash>``)."""
    names = [
        o["metadata"]["name"]
        for o in of_kind(objects, "ConfigMap")
        if re.fullmatch(rf"{prefix}-[a-z0-9]+", o["metadata"]["name"])
    ]
    assert len(names) == 1, (prefix, names)
    return names[0]


def test_only_the_edge_is_exposed(objects):
    exposed = [
        s["metadata"]["name"]
        for s in of_kind(objects, "Service")
        if s["spec"].get("type", "ClusterIP") in ("LoadBalancer", "NodePort")
    ]
    assert exposed == ["envoy"]
    assert not of_kind(objects, "Ingress")
    for name, pod in pod_specs(objects):
        assert not pod["spec"].get("hostNetwork"), name
        assert all("hostPort" not in p for c in containers(pod) for p in c.get("ports", [])), name
    # Inside, nothing is reachable unless a policy admits it, and only Envoy from anywhere.
    policies = of_kind(objects, "NetworkPolicy")
    deny = named(objects, "NetworkPolicy", "default-deny-ingress")["spec"]
    assert deny["podSelector"] == {} and "ingress" not in deny
    open_to_all = [
        p["metadata"]["name"]
        for p in policies
        for rule in p["spec"].get("ingress", [])
        if "from" not in rule
    ]
    assert open_to_all == ["envoy"]


def test_a_worker_drains_within_its_grace_period(objects):
    worker = dict(pod_specs(objects))["worker"]
    (container,) = worker["spec"]["containers"]
    drain = float(flag(container, "drain-timeout"))
    assert 0 < drain < worker["spec"]["terminationGracePeriodSeconds"]
    assert flag(container, "health-host") == "0.0.0.0"  # the kubelet probes the pod's address


def test_the_gpu_overlay_holds_gpus_budgets_partitions_and_the_autoscaler():
    objects = render("gpu")
    workloads = {w["metadata"]["name"]: w for w in of_kind(objects, *WORKLOADS)}
    (worker,) = workloads["worker"]["spec"]["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "TIERFLOW_DEVICE", "value": "cuda"} in worker["env"]
    settings = named(objects, "ConfigMap", _generated(objects, "tierflow-settings"))["data"]
    replicas = workloads["queue-service"]["spec"]["replicas"]
    assert replicas >= 2 and int(settings["TIERFLOW_KAFKA_PARTITIONS"]) >= replicas
    for budget in of_kind(objects, "PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"]
        assert any(
            selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
            for w in workloads.values()
        ), budget["metadata"]["name"]
    (scaled,) = of_kind(objects, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert (target["kind"], target["name"]) == (workloads["worker"]["kind"], "worker")
    assert "replicas" not in workloads["worker"]["spec"]  # KEDA owns it: apply must not reset it
    # At least one worker per queue-service replica.
    assert replicas <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    for monitor in of_kind(objects, "PodMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        pods = [
            pod
            for _, pod in pod_specs(objects)
            if _selects(monitor["spec"]["selector"], pod["metadata"]["labels"])
        ]
        assert pods, monitor["metadata"]["name"]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert all(endpoint["port"] in container_ports(pod) for pod in pods), endpoint
    monitored = {
        pod["metadata"]["labels"]["app.kubernetes.io/name"]
        for monitor in of_kind(objects, "PodMonitor")
        for _, pod in pod_specs(objects)
        if _selects(monitor["spec"]["selector"], pod["metadata"]["labels"])
    }
    assert "queue-service" in monitored  # what the autoscaler's queries read
    queries = [t["metadata"]["query"] for t in spec["triggers"]]
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    assert any('tier="critical"' in q for q in queries)
    used = {m for q in queries for m in re.findall(r"\btierflow_[a-z_]+", q)}
    assert used and used <= defined_metric_names(), used - defined_metric_names()
    assert_promql_valid(queries)


def _selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels and In expressions) against a pod's labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def assert_promql_valid(queries: list[str]) -> None:
    """Each query parses, as Prometheus's own promtool reads a recording rule."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool comes with the prometheus package: scripts/prometheus.sh"
    rules = [{"record": f"tierflow:autoscaling_{i}", "expr": q} for i, q in enumerate(queries)]
    groups = {"groups": [{"name": "autoscaling", "rules": rules}]}
    done = subprocess.run(
        [promtool, "check", "rules", "/dev/stdin"],
        input=yaml.safe_dump(groups),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
