"""The install manifests under ``deploy/``: rendered with ``kubectl kustomize``, every object strictly valid, the
settings, commands, ports and probes those the code has, and RBAC exactly the API calls the code makes.

``kubectl`` (with its built-in kustomize) renders offline; where it is missing the tests skip, and fail under CI.
KEDA's kinds are CRDs that ``kubernetes-validate`` does not know: they are checked against :data:`KEDA_SCHEMAS`,
a small schema of the fields the example uses, taken by hand from KEDA v2's CRDs
(``config/crd/bases/keda.sh_scaledobjects.yaml``, ``keda.sh_triggerauthentications.yaml``).
"""

from __future__ import annotations

import os
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import jsonschema
import kubernetes_validate
import numpy as np
import pytest
import yaml

from forecaster.actuation.actuator import Actuator
from forecaster.actuation.backends.base import ModelTarget
from forecaster.actuation.backends.kubernetes import KubernetesBackend
from forecaster.actuation.ledger import MemoryLedger
from forecaster.contracts.actions import Action, ActionKind, ActionStatus, Plan, Reason
from forecaster.settings import Settings, SettingsError, load_settings
from tests.kube_fixtures import (
    KUBERNETES_VERSION,
    FakeKubeApi,
    complete_jobs,
    deployment,
    fail_pulls,
    hpa,
    inference_service,
    kubelet_event,
    pod_autoscaler,
    ready_pod,
    scaled_object,
)
from tests.runtime_fixtures import require_binary

ROOT = Path(__file__).resolve().parents[1]
KUSTOMIZATIONS = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "deploy").rglob("kustomization.yaml"))
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
KEDA_SCHEMAS = {
    "ScaledObject": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"}, "metadata": _META,
            "spec": {
                "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
                "properties": {
                    "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                       "properties": {"name": {"type": "string"}, "kind": {"type": "string"},
                                                      "apiVersion": {"type": "string"},
                                                      "envSourceContainerName": {"type": "string"}}},
                    **{k: {"type": "integer", "minimum": 0} for k in (
                        "pollingInterval", "cooldownPeriod", "idleReplicaCount", "minReplicaCount",
                        "maxReplicaCount")},
                    "fallback": {"type": "object", "required": ["failureThreshold", "replicas"],
                                 "additionalProperties": False,
                                 "properties": {"failureThreshold": {"type": "integer"},
                                                "replicas": {"type": "integer"}}},
                    "advanced": {"type": "object"},
                    "triggers": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                        "properties": {"type": {"type": "string"}, "name": {"type": "string"}, "metadata": _STR_MAP,
                                       "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                       "useCachedMetrics": {"type": "boolean"},
                                       "authenticationRef": {"type": "object", "required": ["name"],
                                                             "additionalProperties": False,
                                                             "properties": {"name": {"type": "string"},
                                                                            "kind": {"type": "string"}}}}}},
                }},
        }},
    "TriggerAuthentication": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "TriggerAuthentication"},
            "metadata": _META,
            "spec": {"type": "object", "additionalProperties": False, "properties": {
                "secretTargetRef": {"type": "array", "items": {
                    "type": "object", "required": ["parameter", "name", "key"], "additionalProperties": False,
                    "properties": {k: {"type": "string"} for k in ("parameter", "name", "key")}}}}},
        }},
}


def render(directory: str) -> list[dict]:
    kubectl = require_binary("kubectl")
    out = subprocess.run([kubectl, "kustomize", str(ROOT / directory)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {directory: render(directory) for directory in KUSTOMIZATIONS}


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_the_kustomizations_are_the_ones_documented():
    assert KUSTOMIZATIONS == ["deploy/base", "deploy/examples/keda", "deploy/overlays/example"]


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_every_rendered_object_is_strictly_valid(rendered, directory):
    objects = rendered[directory]
    assert objects
    for obj in objects:
        if obj["apiVersion"].startswith("keda.sh/"):
            jsonschema.validate(obj, KEDA_SCHEMAS[obj["kind"]])
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_a_wrong_field_is_caught_by_each_check(rendered):
    """The checks above can fail: a misspelt field in a built-in kind and in a KEDA kind is refused."""
    agent = dict(by_kind(rendered["deploy/base"], "DaemonSet")["prewarm-agent"])
    agent["spec"] = {**agent["spec"], "tolerations": []}  # belongs in the pod spec, not the DaemonSet's
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(agent, KUBERNETES_VERSION, strict=True)
    scaled = by_kind(rendered["deploy/examples/keda"], "ScaledObject")["llama-3-8b"]
    wrong = {**scaled, "spec": {**scaled["spec"], "minReplicas": 1}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, KEDA_SCHEMAS["ScaledObject"])


# --- what the manifests say is what the code reads -------------------------------------------------------------


def _container_env(objects: list[dict], container: dict, namespace: str) -> dict[str, str]:
    """The environment a container gets: envFrom ConfigMaps and Secrets, then env (fieldRefs resolved)."""
    maps, secrets = by_kind(objects, "ConfigMap"), by_kind(objects, "Secret")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(maps[source["configMapRef"]["name"]]["data"])
        else:
            env.update(secrets[source["secretRef"]["name"]]["stringData"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            env[item["name"]] = {"metadata.namespace": namespace, "spec.nodeName": "gpu-node-1"}[path]
    return env


def _workloads(objects: list[dict]) -> dict[str, dict]:
    return {**by_kind(objects, "Deployment"), **by_kind(objects, "DaemonSet")}


@pytest.mark.parametrize("directory", ["deploy/base", "deploy/overlays/example"])
def test_env_vars_are_settings_and_load_as_the_code_would(rendered, directory, monkeypatch):
    objects = rendered[directory]
    known = {f"PREWARM_{name.upper()}" for name in Settings.model_fields} | {"DATABASE_URL", "HOME"}
    for name in [k for k in os.environ if k.startswith("PREWARM_") or k == "DATABASE_URL"]:
        monkeypatch.delenv(name)
    loaded = {}
    for workload, obj in _workloads(objects).items():
        [container] = obj["spec"]["template"]["spec"]["containers"]
        env = _container_env(objects, container, obj["metadata"]["namespace"])
        assert set(env) <= known, f"{workload}: not settings the code reads: {sorted(set(env) - known)}"
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            if workload == "prewarm-scheduler":
                # The placeholder Secrets cannot reach production: the scheduler (it calls the agents) refuses.
                with pytest.raises(SettingsError, match="PREWARM_AGENT_TOKEN is a placeholder"):
                    load_settings()
                patch.setenv("PREWARM_AGENT_TOKEN", "a-real-token-4c1f")
            loaded[workload] = load_settings()
    scheduler = loaded["prewarm-scheduler"]
    assert scheduler.environment == "production" and scheduler.kubernetes_namespace == "prewarm"
    assert scheduler.kubernetes_owner_deployment == "prewarm-scheduler"
    if directory == "deploy/overlays/example":
        assert scheduler.actuator_backend == "composite"
        assert scheduler.actuator_route_map == {"prepull": "agent", "preload": "agent", "scale": "kubernetes",
                                                "release": "kubernetes"}
    else:
        assert scheduler.actuator_backend == "dry-run"  # the default stays dry-run
    agent = loaded["prewarm-agent"]
    assert agent.agent_node_name == "gpu-node-1" and agent.agent_token.get_secret_value() == "changeme"
    assert str(agent.weights_cache_dir) == "/var/lib/prewarm/weights-cache"


def test_commands_ports_probes_and_image_are_the_codes(rendered, tmp_path):
    import typer.main

    from api.routes.health import router as health
    from forecaster.agent.app import create_app
    from forecaster.agent.cache import WeightsCache
    from forecaster.agent.service import NodeAgent
    from forecaster.cli import app

    commands = {c.name for c in typer.main.get_command(app).commands.values()}
    agent = NodeAgent(node_name="n", cache=WeightsCache(tmp_path / "cache"), cri=None, s3=None)
    agent_paths = {getattr(r, "path", None) for r in create_app(agent, token="t").routes}
    agent.close()
    api_paths = {getattr(r, "path", None) for r in health.routes}
    version = next(line.split('"')[1] for line in (ROOT / "pyproject.toml").read_text().splitlines()
                   if line.startswith("version"))
    objects = rendered["deploy/base"]
    defaults = Settings()
    for name, obj in _workloads(objects).items():
        pod = obj["spec"]["template"]["spec"]
        [container] = pod["containers"]
        assert container["image"] == f"prewarm:{version}"  # the Dockerfile's image: ENTRYPOINT prewarm
        args = container["args"]
        assert args[0] in commands
        port = int(args[args.index("--port") + 1])
        grpc_port = _container_env(objects, container, "prewarm").get("PREWARM_KEDA_GRPC_PORT")
        # the HTTP port, and KEDA's gRPC scaler's where the container serves it (on the same --host)
        assert [p["containerPort"] for p in container["ports"]] == [port] + ([int(grpc_port)] if grpc_port else [])
        if grpc_port:
            assert container["ports"][1]["name"] == "grpc"
        paths = agent_paths if args[0] == "agent" else api_paths
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"]["path"] in paths, (name, probe)
        if args[0] == "agent":
            assert port == defaults.agent_port and container["ports"][0]["hostPort"] == port
            assert defaults.agent_url_template.endswith(f":{port}")
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert {str(defaults.agent_containerd_socket), "/var/lib/prewarm/weights-cache"} <= mounts
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
            assert {"requests", "limits"} <= set(container["resources"])
        else:
            assert port == defaults.api_port
    service = by_kind(objects, "Service")["prewarm"]
    api = by_kind(objects, "Deployment")["prewarm-api"]
    assert service["spec"]["selector"] == api["spec"]["selector"]["matchLabels"]
    # every port the API serves is reachable through the Service, the scaler at docs/autoscalers.md's address
    [api_container] = api["spec"]["template"]["spec"]["containers"]
    assert {p["targetPort"]: p["port"] for p in service["spec"]["ports"]} == {
        p["name"]: p["containerPort"] for p in api_container["ports"]}
    assert {p["name"] for p in api_container["ports"]} == {"http", "grpc"}
    docs = (ROOT / "docs" / "autoscalers.md").read_text()
    grpc_service_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert f'scalerAddress: "prewarm.prewarm.svc:{grpc_service_port}"' in docs


def test_the_prometheus_scrape_config_is_valid(rendered, tmp_path):
    """promtool checks the jobs (relabel rules, regexes, paths). Debian's Prometheus is built without Kubernetes
    service discovery, so for promtool each ``kubernetes_sd_configs`` becomes an empty ``static_configs``; the
    discovery blocks themselves are checked here against what Prometheus documents (role pod, namespaces)."""
    promtool = require_binary("promtool")
    scrape = by_kind(rendered["deploy/base"], "ConfigMap")["prewarm-prometheus-scrape"]["data"]["scrape-configs.yml"]
    config = yaml.safe_load(scrape)
    assert [job["job_name"] for job in config["scrape_configs"]] == ["prewarm", "model-servers"]
    jobs = []
    for job in config["scrape_configs"]:
        for sd in job["kubernetes_sd_configs"]:
            assert sd["role"] == "pod" and set(sd) <= {"role", "namespaces"}
            assert set(sd.get("namespaces", {})) <= {"names", "own_namespace"}
        jobs.append({**{k: v for k, v in job.items() if k != "kubernetes_sd_configs"},
                     "static_configs": [{"targets": []}]})
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump({"global": {"scrape_interval": "15s"}, "scrape_configs": jobs}))
    out = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # The prewarm job keeps the pods the base annotates: the API and the scheduler, at their HTTP port.
    annotated = {name for name, d in by_kind(rendered["deploy/base"], "Deployment").items()
                 if d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"}
    assert annotated == {"prewarm-api", "prewarm-scheduler"}


# --- RBAC: exactly the calls the code makes --------------------------------------------------------------------


def _every_kubernetes_call() -> tuple[FakeKubeApi, set[tuple[str, str, str]]]:
    """Drive the Kubernetes backend (through the actuator) and the cold-start observer down every path."""
    api = FakeKubeApi()
    api.put(deployment("prewarm-scheduler", image="prewarm:0.1.0"))
    api.put(deployment("llama", replicas=1))
    api.put(deployment("mistral", replicas=2))
    api.put(hpa("mistral", "mistral", min_replicas=1, max_replicas=6, desired=2))
    api.put(inference_service("qwen", min_replicas=0))
    api.put(pod_autoscaler("qwen", desired=1))
    for obj in scaled_object("gemma", "gemma", min_replica_count=0):  # KEDA: the floor through the ScaledObject
        api.put(obj)
    api.put(deployment("gemma", replicas=1))
    api.put(ready_pod("llama-7d9f8b6c5d-x2x4z", "llama", "gpu-node-1", "2026-11-29T10:00:00Z",
                      "2026-11-29T10:00:31Z", "2026-11-29T10:01:05Z"))
    api.put(kubelet_event("llama-7d9f8b6c5d-x2x4z", "Pulled", 'Container image "x" already present on machine',
                          "2026-11-29T10:00:30Z"))
    settings = Settings(actuator_backend="kubernetes", kubernetes_owner_deployment="prewarm-scheduler",
                        kubernetes_job_wait_s=5.0)
    backend = KubernetesBackend.from_settings(settings, api_client=api.client(), clock=lambda: NOW,
                                              sleep=lambda s: None)
    targets = {m: ModelTarget(m, labels=labels) for m, labels in (
        ("llama", {}), ("mistral", {}), ("qwen", {"k8s_kind": "InferenceService"}), ("gemma", {}))}
    actuator = Actuator(MemoryLedger(targets), settings, backend)

    def action(kind, model, **kw):
        return Action(kind=kind, model_id=model, reason=Reason.FORECAST_SPIKE, not_before=NOW,
                      deadline=NOW + timedelta(minutes=10), **kw)

    api.kubelet = complete_jobs
    plan = Plan(planned_at=NOW, actions=(
        action(ActionKind.SCALE, "llama", replicas=3),  # Deployment /scale
        action(ActionKind.SCALE, "mistral", replicas=4),  # HPA floor
        action(ActionKind.SCALE, "qwen", replicas=2),  # KServe minReplicas, Knative's ask
        action(ActionKind.SCALE, "gemma", replicas=2),  # KEDA's HPA: the ScaledObject's minReplicaCount
        action(ActionKind.RELEASE, "llama", replicas=1),
        action(ActionKind.PREPULL, "llama", node_id="gpu-node-1", target="vllm/vllm-openai:v0.6.0"),  # Job
    ))
    _, reports = actuator.apply(plan, now=NOW)
    assert {r.status for r in reports} == {ActionStatus.SUCCEEDED}, reports
    api.kubelet = fail_pulls("failed to pull and unpack image: not found")  # the pod's pull error, Job removed
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(
        action(ActionKind.PREPULL, "llama", node_id="gpu-node-2", target="vllm/vllm-openai:v9"),)), now=NOW)
    assert reports[0].status is ActionStatus.FAILED
    api.kubelet = None
    backend.job_wait_s = 0
    backend.carry_out(action(ActionKind.PREPULL, "llama", node_id="gpu-node-3", target="img:1"),
                      model=targets["llama"], replicas=None, deadline_s=30)
    assert backend.cleanup(now=NOW + timedelta(minutes=5))  # finished and expired Jobs listed and deleted
    [cold_start] = backend.observe_cold_starts()  # model pods and kubelet events read
    assert (cold_start["model_id"], cold_start["total_seconds"]) == ("llama", 65.0)
    assert not api.invalid
    return api, api.rbac_calls()


def _granted(role: dict) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


@pytest.mark.parametrize("directory", ["deploy/base", "deploy/overlays/example"])
def test_rbac_grants_exactly_the_calls_the_kubernetes_backend_makes(rendered, directory):
    api, calls = _every_kubernetes_call()
    objects = rendered[directory]
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
    roles = by_kind(objects, "Role")
    assert list(roles) == ["prewarm-actuator"]
    role = roles["prewarm-actuator"]
    granted = _granted(role)
    assert calls - granted == set(), f"calls the Role does not grant: {sorted(calls - granted)}"
    assert granted - calls == set(), f"grants no call needs: {sorted(granted - calls)}"
    # '*' never appears, and a rule naming resources names exactly the objects read that way.
    assert "*" not in {x for rule in role["rules"] for k in ("apiGroups", "resources", "verbs") for x in rule[k]}
    owner_reads = {p.rsplit("/", 1)[1] for m, p, _ in api.requests
                   if m == "GET" and "/apis/apps/v1/namespaces/" in p and "/deployments/" in p
                   and not p.endswith("/scale")}
    [named] = [r for r in role["rules"] if "resourceNames" in r]
    assert set(named["resourceNames"]) == owner_reads == {"prewarm-scheduler"}
    # Bound to the scheduler's account, the one workload that talks to the API.
    [binding] = by_kind(objects, "RoleBinding").values()
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "prewarm-actuator"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "prewarm-scheduler", "namespace": "prewarm"}]
    accounts = by_kind(objects, "ServiceAccount")
    for name, obj in _workloads(objects).items():
        pod = obj["spec"]["template"]["spec"]
        token = pod.get("automountServiceAccountToken", accounts[pod["serviceAccountName"]].get(
            "automountServiceAccountToken", True))
        assert token is (name == "prewarm-scheduler"), name
        assert (pod["serviceAccountName"] == "prewarm-scheduler") is (name == "prewarm-scheduler")


# --- the HPA's prometheus-adapter rule (docs/autoscalers.md) ---------------------------------------------------


def _documented_adapter_rule() -> tuple[dict, dict]:
    """(the external rule, the HPA) of docs/autoscalers.md's prometheus-adapter example."""
    text = (ROOT / "docs" / "autoscalers.md").read_text()
    [block] = [b for b in text.split("```yaml\n")[1:] if b.startswith("# prometheus-adapter rules")]
    rules, hpa_doc = yaml.safe_load_all(block.split("```")[0])
    [rule] = rules["external"]
    return rule, hpa_doc


def test_the_documented_adapter_rule_reads_the_lead_time_floor_from_the_scraped_gauge(rendered, tmp_path):
    """The rule's metricsQuery, with prometheus-adapter's template filled in as it fills it for the documented HPA,
    evaluated by Prometheus (promtool) over the gauge as the base's ``prewarm`` scrape job stores it: the API's two
    pods and the scheduler's, labelled job, instance, component and pod (no namespace label), each sample of the
    real exposition. It must give the lead-time floor of the HPA's model alone: not the larger "now" sample (the
    seriesQuery's matchers do not reach the metricsQuery), and not nothing (a namespace matcher the series lack)."""
    from api.recommendation_gauges import RecommendationGauges
    from api.snapshot import ModelView
    from forecaster.planning.recommendation import MinuteQuantiles
    from tests.test_recommendation_gauges import SETTINGS, FakeSnapshot

    promtool = require_binary("promtool")
    rule, hpa_doc = _documented_adapter_rule()
    [metric] = hpa_doc["spec"]["metrics"]
    assert metric["type"] == "External" and metric["external"]["metric"]["name"] == rule["name"]["as"]
    selector = metric["external"]["metric"]["selector"]["matchLabels"]
    model = selector["model_id"]
    # the gauge: falling demand, so "now" (5 replicas) is above the lead time's (4); and a second model
    minutes = int(NOW.timestamp()) // 60 * 60 + 60 * np.arange(60, dtype=np.int64)
    demand = np.where(np.arange(60) < 1, 600.0, 480.0)[:, None]  # 120 per replica-minute at replica_rps 2
    run = MinuteQuantiles(issued_at=NOW, model_version_id=None, minutes_s=minutes, levels=(0.9,), values=demand,
                          point=demand[:, 0].copy())
    snapshot = FakeSnapshot({model: ModelView(replica_rps=2.0, lead_time_s=90.0, forecast=run),
                             "other-model": ModelView(replica_rps=0.5, lead_time_s=90.0, forecast=run)})
    exposition = RecommendationGauges(snapshot, SETTINGS, lambda: NOW + timedelta(seconds=10)).exposition().decode()
    samples = [line.rsplit(" ", 1) for line in exposition.splitlines() if not line.startswith("#")]
    assert {s for s, _ in samples} >= {f'prewarm_recommended_replicas{{at="{at}",model_id="{model}"}}'
                                       for at in ("now", "lead_time")}
    assert dict(samples)[f'prewarm_recommended_replicas{{at="now",model_id="{model}"}}'] == "5.0"
    assert dict(samples)[f'prewarm_recommended_replicas{{at="lead_time",model_id="{model}"}}'] == "4.0"
    # the labels the prewarm scrape job gives a target: job, instance, and from the pod's metadata component and
    # pod (its relabel_configs); no namespace
    scrape = yaml.safe_load(by_kind(rendered["deploy/base"], "ConfigMap")["prewarm-prometheus-scrape"]["data"][
        "scrape-configs.yml"])
    [job] = [j for j in scrape["scrape_configs"] if j["job_name"] == "prewarm"]
    target_labels = {r.get("target_label", "__") for r in job["relabel_configs"]}
    assert {label for label in target_labels if not label.startswith("__")} == {"component", "pod"}
    pods = [("api", "prewarm-api-7d9f8-a", "10.0.0.5:8080"), ("api", "prewarm-api-7d9f8-b", "10.0.0.6:8080"),
            ("scheduler", "prewarm-scheduler-5c4b-x", "10.0.0.7:8080")]
    series = [{"series": f'{s[:-1]},job="prewarm",instance="{instance}",component="{component}",pod="{pod}"}}',
               "values": f"{value}x10"} for component, pod, instance in pods for s, value in samples]
    # prometheus-adapter for an External metric of a namespaced rule (the default) adds the HPA's namespace to the
    # selector's matchers; `namespaced: false` leaves it out (its docs/externalmetrics.md)
    matchers = [f'{k}="{v}"' for k, v in selector.items()]
    if rule.get("resources", {}).get("namespaced", True):
        matchers.append('namespace="serving"')
    series_name = rule["seriesQuery"].split("{")[0]
    query = rule["metricsQuery"].replace("<<.Series>>", series_name).replace("<<.LabelMatchers>>", ",".join(matchers))
    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [
            {"expr": rule["seriesQuery"], "eval_time": "5m",  # the adapter's discovery finds the series
             "exp_samples": [{"labels": s[:-1] + f',job="prewarm",instance="{i}",component="{c}",pod="{p}"}}',
                              "value": float(v)}
                             for c, p, i in pods for s, v in samples if 'at="lead_time"' in s]},
            {"expr": query, "eval_time": "5m", "exp_samples": [{"labels": f'{{model_id="{model}"}}', "value": 4}]},
        ]}]}
    path = tmp_path / "adapter.test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    out = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, f"{query}\n{out.stdout}{out.stderr}"
