"""deploy/kubernetes-overlays/inference-pool, checked offline as the base is (tests/scale/test_kubernetes.py):
`kubectl kustomize` builds it, every object of Kubernetes' own kinds passes `kubernetes-validate --strict`, the
InferencePool passes the schema of the CRD stored beside the overlay (Gateway API Inference Extension v1.6.0), and
the objects agree with each other: the pool selects exactly the gateway's pods on the gateway's port, the gateway
reads every Triton's metrics port and may reach it, and the endpoint picker's config names the metrics the
gateway exports. No API server, EPP or inference gateway runs here."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from serving.gateway import Settings
from serving.gateway.metrics import ENGINE_RUNNING, ENGINE_WAITING, KV_CACHE_USAGE, Metrics

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy" / "kubernetes-overlays" / "inference-pool"
CRD = OVERLAY / "crd" / "inference.networking.k8s.io_inferencepools.yaml"
BIN = Path(sys.executable).parent
POOL_API = "inference.networking.k8s.io/v1"
ENGINE_LABEL = "inference.networking.k8s.io/engine-type"
# the CRD's CEL rules, which a JSON schema validator does not run: each is checked by hand below
CEL_RULES = {
    "self.kind != 'Service' || has(self.port)",
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))",
}


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    run = subprocess.run([str(BIN / "kubectl"), "kustomize", str(OVERLAY)], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    return list(yaml.safe_load_all(run.stdout))


def named(objects: list[dict], kind: str, name: str) -> dict:
    (found,) = (item for item in objects if item["kind"] == kind and item["metadata"]["name"] == name)
    return found


def pool_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = (v for v in crd["spec"]["versions"] if f"{crd['spec']['group']}/{v['name']}" == POOL_API)
    assert version["served"] and version["storage"]
    return version["schema"]["openAPIV3Schema"]


def closed(schema: dict) -> dict:
    """`schema` rejecting fields it does not name, as the API server's strict field validation does (a structural
    schema prunes them silently otherwise)."""
    schema = copy.deepcopy(schema)
    for node in nodes(schema):
        if "properties" in node:
            node.setdefault("additionalProperties", False)
    return schema


def cel_rules(schema: dict) -> set[str]:
    return {check["rule"] for node in nodes(schema) for check in node.get("x-kubernetes-validations", [])}


def nodes(schema: dict) -> list[dict]:
    """`schema` and every schema nested in it (properties, items, additionalProperties)."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        found.append(node)
        stack += node.get("properties", {}).values()
        stack += [node[key] for key in ("items", "additionalProperties") if isinstance(node.get(key), dict)]
    return found


def test_every_kubernetes_object_passes_the_strict_schema(objects, tmp_path):
    own = [item for item in objects if item["apiVersion"] != POOL_API]
    assert len(own) == len(objects) - 1
    built = tmp_path / "kubernetes.yaml"
    built.write_text(yaml.safe_dump_all(own))
    run = subprocess.run(
        [str(BIN / "kubernetes-validate"), "--strict", "--kubernetes-version", "1.37", str(built)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("passed") == len(own), run.stdout


def test_the_inference_pool_passes_its_crds_schema(objects):
    schema = pool_schema()
    assert cel_rules(schema) == CEL_RULES, "the stored CRD has rules this test does not check"
    validator = jsonschema.Draft7Validator(closed(schema))
    pool = named(objects, "InferencePool", "gateway")
    assert pool["apiVersion"] == POOL_API
    assert not list(validator.iter_errors(pool)), [error.message for error in validator.iter_errors(pool)]
    picker = pool["spec"]["endpointPickerRef"]
    assert picker.get("kind", "Service") != "Service" or "port" in picker
    numbers = [port["number"] for port in pool["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers))
    # the validator does refuse: a misspelt field and a port out of range
    misspelt = copy.deepcopy(pool)
    misspelt["spec"]["targetPort"] = misspelt["spec"].pop("targetPorts")
    assert not validator.is_valid(misspelt)
    out_of_range = copy.deepcopy(pool)
    out_of_range["spec"]["targetPorts"] = [{"number": 70000}]
    assert not validator.is_valid(out_of_range)


def test_the_pool_is_exactly_the_gateways_pods_on_the_gateways_port(objects):
    pool = named(objects, "InferencePool", "gateway")
    selector = pool["spec"]["selector"]["matchLabels"]
    assert pool["metadata"]["namespace"] == named(objects, "Deployment", "gateway")["metadata"]["namespace"]
    templates = {
        item["metadata"]["name"]: item["spec"]["template"]
        for item in objects
        if item["kind"] in ("Deployment", "StatefulSet")
    }
    selected = {
        name for name, template in templates.items() if selector.items() <= template["metadata"]["labels"].items()
    }
    assert selected == {"gateway"}
    (gateway,) = templates["gateway"]["spec"]["containers"]
    env = {item["name"]: item.get("value") for item in gateway["env"]}
    (http,) = (port for port in gateway["ports"] if port["name"] == "http")
    assert (
        [port["number"] for port in pool["spec"]["targetPorts"]]
        == [http["containerPort"]]
        == [int(env["SERVING_PORT"])]
    )
    # the base's settings are kept beside the overlay's
    assert env["SERVING_TRITON_URL"] == "envoy:8001"


def test_the_gateway_reads_every_tritons_metrics_port_and_may_reach_it(objects):
    (gateway,) = named(objects, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item.get("value") for item in gateway["env"]}
    (url,) = Settings(triton_metrics_urls=env["SERVING_TRITON_METRICS_URLS"]).triton_metrics_urls
    service = named(objects, "Service", "triton")
    (metrics,) = (port for port in service["spec"]["ports"] if port["name"] == "metrics")
    # a headless Service's name resolves to every replica: the gateway reads each one
    assert service["spec"]["clusterIP"] == "None"
    assert url == f"http://{service['metadata']['name']}:{metrics['port']}/metrics"
    (triton,) = named(objects, "StatefulSet", "triton")["spec"]["template"]["spec"]["containers"]
    assert {"name": "metrics", "containerPort": metrics["port"]} in triton["ports"]
    rules = named(objects, "NetworkPolicy", "triton")["spec"]["ingress"]
    gateway_rule = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gateway"}}}
    assert any(
        gateway_rule in rule["from"] and {"port": metrics["port"], "protocol": "TCP"} in rule["ports"] for rule in rules
    )
    assert len(rules) == 2, "the base's rule (Envoy on 8000 and 8001) is kept"


def test_the_endpoint_pickers_config_names_the_metrics_the_gateway_exports(objects):
    config = yaml.safe_load(named(objects, "ConfigMap", "gateway-epp-config")["data"]["epp-config.yaml"])
    assert config["kind"] == "EndpointPickerConfig"
    (extractor,) = (plugin for plugin in config["plugins"] if plugin["type"] == "core-metrics-extractor")
    parameters = extractor["parameters"]
    (engine,) = parameters["engineConfigs"]
    labels = named(objects, "Deployment", "gateway")["spec"]["template"]["metadata"]["labels"]
    assert labels[parameters["engineLabelKey"]] == engine["name"] == parameters["defaultEngine"]
    assert parameters["engineLabelKey"] == ENGINE_LABEL
    # exported where Triton's metrics are read (the gateway's deployment gives it their URL): what it says it exports
    read = Metrics(triton_metrics=("http://triton:8002/metrics",)).kv_cache.describe()
    exported = {family.name: family.type for family in read}
    assert exported[engine["queuedRequestsSpec"]] == exported[engine["runningRequestsSpec"]] == "gauge"
    assert (engine["queuedRequestsSpec"], engine["runningRequestsSpec"]) == (ENGINE_WAITING, ENGINE_RUNNING)
    assert exported[engine["kvUsageSpec"]] == "gauge" and engine["kvUsageSpec"] == KV_CACHE_USAGE
    assert engine["loraSpec"] == engine["cacheInfoSpec"] == ""  # the gateway has neither: not scraped
    profile_plugins = {ref["pluginRef"] for profile in config["schedulingProfiles"] for ref in profile["plugins"]}
    assert profile_plugins <= {plugin.get("name", plugin["type"]) for plugin in config["plugins"]}
