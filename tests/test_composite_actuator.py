"""The composite actuator: one plan carried out by the node agent and the Kubernetes backend together.

The whole-plan test runs the agent as a process against a real containerd (pulling from a real registry) and a
real S3 server (seaweedfs), exactly as ``tests/test_agent.py`` sets them up, and the Kubernetes backend against
the fake API server of ``tests/kube_fixtures.py``; one :class:`Actuator` over the store keeps the audit trail.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone

import pytest
from pydantic import SecretStr
from sqlalchemy import text

from forecaster.actuation.actuator import Actuator, build_backend
from forecaster.actuation.backends.agent import AgentBackend
from forecaster.actuation.backends.composite import CompositeBackend
from forecaster.actuation.backends.dryrun import DryRunBackend
from forecaster.actuation.backends.kubernetes import KubernetesBackend, job_name
from forecaster.contracts.actions import Action, ActionKind, ActionStatus, FailureReason, Plan, Reason, Tier
from forecaster.settings import BACKEND_ACTIONS, SettingsError, load_settings
from forecaster.store.actions import list_actions, set_paused
from tests import runtime_fixtures
from tests.kube_fixtures import (
    FakeKubeApi,
    complete_jobs,
    deployment,
    hpa,
    inference_service,
    kubelet_event,
    pod_autoscaler,
    ready_pod,
)
from tests.runtime_fixtures import S3Server, free_port, start_agent_process, stop_process

registry = runtime_fixtures.registry
auth_registry = runtime_fixtures.auth_registry
test_images = runtime_fixtures.test_images
containerd = runtime_fixtures.containerd
s3_server = runtime_fixtures.s3_server

TOKEN = "composite-test-token-51c2"
ROUTES = "scale=kubernetes,release=kubernetes,prepull=agent,preload=agent"
WEIGHTS_BYTES = 4 << 20


# --- configuration --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("routes, says", [
    ("preload=kubernetes", "entry 'preload=kubernetes': the kubernetes backend cannot preload; route it to one of "
                           "dry-run, agent"),
    ("scale=agent,release=agent", "the agent backend cannot scale"),
    ("scale=kubernetes", "scale (kubernetes) and release (dry-run) must go to the same backend"),
    ("scale:kubernetes", "entry 'scale:kubernetes' is not KIND=BACKEND"),
    ("warm=agent", "unknown action kind 'warm'; kinds are prepull, preload, scale, release"),
    ("prepull=kubelet", "unknown backend 'kubelet'; backends are dry-run, agent, kubernetes"),
    ("prepull=agent,prepull=kubernetes", "action kind 'prepull' is routed twice"),
])
def test_bad_routes_are_refused_naming_the_variable(monkeypatch, routes, says):
    monkeypatch.setenv("PREWARM_ACTUATOR_BACKEND", "composite")
    monkeypatch.setenv("PREWARM_ACTUATOR_ROUTES", routes)
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert str(caught.value).startswith(f"invalid settings: PREWARM_ACTUATOR_ROUTES={routes!r}")
    assert says in str(caught.value)


def test_routes_without_the_composite_backend_are_refused(monkeypatch):
    monkeypatch.setenv("PREWARM_ACTUATOR_BACKEND", "agent")
    monkeypatch.setenv("PREWARM_ACTUATOR_ROUTES", ROUTES)
    with pytest.raises(SettingsError, match="routes apply only to PREWARM_ACTUATOR_BACKEND=composite"):
        load_settings()


def test_the_composite_defaults_to_dry_run_for_every_kind(monkeypatch):
    monkeypatch.setenv("PREWARM_ACTUATOR_BACKEND", "composite")
    monkeypatch.delenv("PREWARM_ACTUATOR_ROUTES", raising=False)
    settings = load_settings()
    assert settings.actuator_route_map == {"prepull": "dry-run", "preload": "dry-run", "scale": "dry-run",
                                           "release": "dry-run"}
    backend = build_backend(settings)
    assert isinstance(backend, CompositeBackend) and list(backend.backends) == ["dry-run"]
    assert isinstance(backend.backend_for(ActionKind.SCALE), DryRunBackend)
    # A partial route: the kinds it leaves out stay dry-run; one agent backend serves both of its kinds.
    monkeypatch.setenv("PREWARM_ACTUATOR_ROUTES", " preload=agent , prepull=agent ")
    settings = load_settings()
    assert settings.actuator_routes == "prepull=agent,preload=agent,scale=dry-run,release=dry-run"
    backend = build_backend(settings)
    assert backend.backend_for("prepull") is backend.backend_for("preload")
    assert isinstance(backend.backend_for("prepull"), AgentBackend) and backend.carrier("release") == "dry-run"
    backend.close()


def test_the_settings_table_of_what_each_backend_can_do_is_what_the_backends_declare():
    declared = {"dry-run": DryRunBackend.actions, "agent": AgentBackend.actions,
                "kubernetes": KubernetesBackend.actions}
    assert {name: {str(k) for k in kinds} for name, kinds in declared.items()} == \
        {name: set(kinds) for name, kinds in BACKEND_ACTIONS.items()}


def test_a_composite_built_by_hand_is_checked_too():
    with pytest.raises(ValueError, match="the agent backend cannot scale"):
        CompositeBackend({"scale": "agent", "release": "agent", "prepull": "agent", "preload": "agent"},
                         {"agent": AgentBackend(url_template="http://{node}:1", token="t")})
    with pytest.raises(ValueError, match="no backend routed for preload"):
        CompositeBackend({"scale": "dry-run", "release": "dry-run", "prepull": "dry-run"},
                         {"dry-run": DryRunBackend()})


# --- one whole plan through the agent (real containerd + S3) and Kubernetes (fake API server) --------------------


def _register(engine, model_id: str, gpus: int = 1, **labels) -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id, gpus_per_replica, labels) VALUES (:i, :g, "
                          "CAST(:l AS jsonb))"), {"i": model_id, "g": gpus, "l": json.dumps(labels)})


@pytest.fixture(scope="module")
def weights_object(s3_server: S3Server) -> str:
    client = s3_server.client()
    client.create_bucket(Bucket="composite")
    client.put_object(Bucket="composite", Key="llama/model.safetensors", Body=os.urandom(WEIGHTS_BYTES))
    return "s3://composite/llama/model.safetensors"


@pytest.fixture
def cluster() -> FakeKubeApi:
    """The serving namespace: prewarm's own Deployment (owner of pre-pull Jobs) and four model workloads."""
    api = FakeKubeApi()
    api.put(deployment("prewarm-scheduler", image="prewarm:0.1.0"))
    api.put(deployment("llama", replicas=1))  # no autoscaler: prewarm sets spec.replicas
    api.put(deployment("mistral", replicas=2))
    api.put(hpa("mistral", "mistral", min_replicas=1, max_replicas=6, desired=2))  # prewarm raises its floor
    api.put(inference_service("qwen", min_replicas=0))  # KServe: prewarm sets minReplicas
    api.put(pod_autoscaler("qwen", desired=1))
    api.put(deployment("gemma", replicas=3))  # released to 1
    return api


def _audit_rows(engine, plan_id: int) -> list[dict]:
    return sorted(list_actions(engine, plan_id=plan_id), key=lambda r: (r["kind"], r["model_id"], r["target"] or ""))


def _print_audit_trail(rows: list[dict]) -> None:
    print("\naudit trail (actions):")
    for r in rows:
        detail = r["detail"]
        print(f"  #{r['id']} {r['kind']:<8} {r['model_id']:<8} {(r['target'] or '-')[:44]:<44} "
              f"{r['backend']:<20} {r['status']:<9} {r['status_reason'] or '-':<12} "
              f"carried_by={detail.get('carried_by', '-')} observations={detail.get('observations', '-')} "
              f"| {detail.get('message', '')[:70]}")


def test_one_plan_through_the_agent_and_kubernetes_leaves_one_audit_trail(
        tmp_path, engine, settings, s3_server, weights_object, containerd, test_images, cluster):
    for model, labels in (("llama", {}), ("mistral", {}), ("qwen", {"k8s_kind": "InferenceService"}),
                          ("gemma", {})):
        _register(engine, model, gpus=2 if model == "mistral" else 1, **labels)
    port = free_port()
    agent = start_agent_process(tmp_path, s3_server, containerd.socket, port, token=TOKEN)
    image = test_images["small"]
    containerd.ctr("images", "rm", image)  # a real pull, not "already present"
    settings = settings.model_copy(update={
        "actuator_backend": "composite", "actuator_routes": ROUTES, "agent_url_template": f"http://127.0.0.1:{port}",
        "agent_token": SecretStr(TOKEN), "kubernetes_owner_deployment": "prewarm-scheduler"})
    kube = KubernetesBackend.from_settings(settings, api_client=cluster.client(), sleep=lambda s: None)
    backend = build_backend(settings, members={"kubernetes": kube})
    assert isinstance(backend.backend_for("prepull"), AgentBackend) and backend.backend_for("scale") is kube
    now = datetime.now(timezone.utc)
    deadline = now + timedelta(minutes=5)

    def act(kind, model, **kw):
        reason = Reason.IDLE_RELEASE if kind is ActionKind.RELEASE else Reason.FORECAST_SPIKE
        return Action(kind=kind, model_id=model, reason=kw.pop("reason", reason), not_before=now, deadline=deadline,
                      **kw)

    plan = Plan(planned_at=now, actions=(
        act(ActionKind.PREPULL, "llama", node_id="node-a", target=image, reason=Reason.CACHE_WARM),
        act(ActionKind.PRELOAD, "llama", node_id="node-a", target=weights_object, tier=Tier.DISK,
            reason=Reason.SLO_COVER),
        act(ActionKind.PRELOAD, "llama", node_id="node-a", target="s3://composite/absent.bin", tier=Tier.DISK,
            reason=Reason.SLO_COVER),
        act(ActionKind.SCALE, "llama", replicas=3),
        act(ActionKind.SCALE, "mistral", replicas=4),
        act(ActionKind.SCALE, "qwen", replicas=2),
        act(ActionKind.RELEASE, "gemma", replicas=2),  # give 2 of its 3 back
    ), summary={"test": "composite"})
    try:
        submitted, reports = Actuator(engine, settings, backend).apply(plan, now=now)
        rows = _audit_rows(engine, submitted.plan_id)
        _print_audit_trail(rows)
        by = {(r["kind"], r["model_id"], r["target"]): r for r in rows}
        pulled = by[("prepull", "llama", image)]
        loaded = by[("preload", "llama", weights_object)]
        absent = by[("preload", "llama", "s3://composite/absent.bin")]
        # Who carried each action out: the ledger's backend column and the outcome's detail agree.
        for row in rows:
            carrier = "agent" if row["kind"] in ("prepull", "preload") else "kubernetes"
            assert row["backend"] == f"composite:{carrier}" and row["detail"]["carried_by"] == carrier, row
        assert (pulled["status"], loaded["status"]) == ("succeeded", "succeeded")
        assert (absent["status"], absent["status_reason"], absent["detail"]["temporary"]) == \
            ("failed", "not_found", False)
        assert pulled["detail"]["timings"]["image_pull_s"] > 0 and loaded["detail"]["size_bytes"] == WEIGHTS_BYTES
        # The agent's measurements are stored as transfers under the agent's own source, never as cold starts.
        assert pulled["detail"]["observations"]["transfers"]["inserted"] == 1
        assert loaded["detail"]["observations"]["transfers"]["inserted"] == 1
        with engine.connect() as conn:
            transfers = conn.execute(text("SELECT kind, tier, ref, bytes, source FROM transfers ORDER BY kind")).all()
            assert conn.execute(text("SELECT count(*) FROM cold_starts")).scalar() == 0
        assert [(t.kind, t.tier, t.ref, t.source) for t in transfers] == [
            ("preload", "disk", weights_object, "actuator-agent"), ("prepull", "image", image, "actuator-agent")]
        assert transfers[0].bytes == WEIGHTS_BYTES
        assert image in containerd.ctr("images", "ls", "-q").stdout.split()
        # Scale and release went to the API, each through its own path, bounded by the guardrails.
        assert cluster.get("Deployment", "llama")["spec"]["replicas"] == 3
        assert by[("scale", "llama", None)]["detail"]["field"] == "spec.replicas"
        mistral_hpa = cluster.get("HorizontalPodAutoscaler", "mistral")
        assert mistral_hpa["spec"]["minReplicas"] == 4
        assert mistral_hpa["metadata"]["annotations"]["prewarm.io/base-min-replicas"] == "1"
        assert cluster.get("Deployment", "mistral")["spec"]["replicas"] == 2  # the HPA scales it, not prewarm
        assert cluster.get("InferenceService", "qwen")["spec"]["predictor"]["minReplicas"] == 2
        assert cluster.get("Deployment", "gemma")["spec"]["replicas"] == 1
        assert by[("scale", "mistral", None)]["detail"]["ahead_gpus"] == 4  # (4 - its HPA's ask of 2) x 2 GPUs
        assert by[("release", "gemma", None)]["detail"]["guardrails"]["current"] == 3
        assert {r["status"] for r in rows if r["kind"] in ("scale", "release")} == {"succeeded"}
        assert not cluster.invalid
        with engine.connect() as conn:
            assert conn.execute(text("SELECT summary FROM plans WHERE id = :p"),
                                {"p": submitted.plan_id}).scalar() == {"test": "composite", "actions": 7}

        # Cold starts of the replicas it scaled are observed through the scale backend, stored as its own.
        # created a few minutes before now: the collector's first run counts pods created within
        # PREWARM_KUBERNETES_COLDSTART_MAX_START_S of now (a Ready time can be a later readiness flap's)
        def ago(seconds: float) -> str:
            return (now - timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")

        replica = ready_pod("llama-7d9f8b6c5d-x2x4z", "llama", "node-a", ago(300), ago(269), ago(235))
        replica["spec"]["containers"][0]["image"] = replica["status"]["containerStatuses"][0]["image"] = image
        uid = cluster.put(replica)["metadata"]["uid"]
        cluster.put(kubelet_event("llama-7d9f8b6c5d-x2x4z", "Pulled", f'Container image "{image}" already present '
                                  "on machine", ago(270), node="node-a", uid=uid,
                                  field_path="spec.containers{server}"))
        summary = Actuator(engine, settings, backend).collect_observations(now=now)
        assert summary == {"observed": 1, "inserted": 1, "already_stored": 0, "rejected": 0, "dropped_long_start": 0}
        with engine.connect() as conn:
            cold = conn.execute(text("SELECT model_id, node_id, total_seconds, cache_state, source "
                                     "FROM cold_starts")).all()
        assert [tuple(c) for c in cold] == [("llama", "node-a", 65.0, "image", "actuator-kubernetes")]

        # The same guardrails: with the kill switch on, neither backend is called.
        set_paused(engine, True, now=now, reason="composite test", by="test")
        later = now + timedelta(seconds=2)
        requests_before = len(cluster.requests)
        paused_plan = Plan(planned_at=later, actions=(
            act(ActionKind.PREPULL, "llama", node_id="node-a", target=test_images["other"],
                reason=Reason.CACHE_WARM),
            act(ActionKind.SCALE, "llama", replicas=5)))
        _, reports = Actuator(engine, settings, backend).apply(paused_plan, now=later)
        assert sorted((r.kind, r.status, r.reason) for r in reports) == [
            ("prepull", ActionStatus.DROPPED, FailureReason.KILL_SWITCH),
            ("scale", ActionStatus.DROPPED, FailureReason.KILL_SWITCH)]
        assert len(cluster.requests) == requests_before
        assert cluster.get("Deployment", "llama")["spec"]["replicas"] == 3
    finally:
        backend.close()
        stop_process(agent)


def test_prepull_jobs_where_no_agent_runs_and_preload_stays_dry_run(engine, settings, cluster):
    """``prepull=kubernetes``: a pinned, labelled, owned pre-pull Job; pre-load (not routed) is recorded only."""
    _register(engine, "llama")
    cluster.kubelet = complete_jobs
    now = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
    settings = settings.model_copy(update={
        "actuator_backend": "composite", "actuator_routes": "prepull=kubernetes,scale=kubernetes,release=kubernetes",
        "kubernetes_owner_deployment": "prewarm-scheduler"})
    kube = KubernetesBackend.from_settings(settings, api_client=cluster.client(), sleep=lambda s: None,
                                           clock=lambda: now)
    backend = build_backend(settings, members={"kubernetes": kube})
    prepull = Action(kind=ActionKind.PREPULL, model_id="llama", reason=Reason.CACHE_WARM, not_before=now,
                     deadline=now + timedelta(minutes=10), node_id="gpu-node-1", target="vllm/vllm-openai:v0.6.0")
    preload = Action(kind=ActionKind.PRELOAD, model_id="llama", reason=Reason.SLO_COVER, not_before=now,
                     deadline=now + timedelta(minutes=10), node_id="gpu-node-1", target="s3://w/llama.bin",
                     tier=Tier.HOST)
    submitted, reports = Actuator(engine, settings, backend).apply(Plan(planned_at=now, actions=(prepull, preload)),
                                                                   now=now)
    rows = {r["kind"]: r for r in list_actions(engine, plan_id=submitted.plan_id)}
    assert rows["prepull"]["status"] == "succeeded" and rows["prepull"]["backend"] == "composite:kubernetes"
    assert rows["prepull"]["detail"]["job"] == f"default/{job_name(prepull)}"
    assert rows["preload"]["status"] == "succeeded" and rows["preload"]["backend"] == "composite:dry-run"
    assert rows["preload"]["detail"]["message"].startswith("dry-run: would pre-load s3://w/llama.bin into host")
    job = cluster.get("Job", job_name(prepull))
    assert job["spec"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "gpu-node-1"}
    assert job["metadata"]["ownerReferences"][0]["name"] == "prewarm-scheduler"
    assert not cluster.invalid
    # The composite passes Job cleanup to the backend that made the Jobs.
    assert backend.cleanup(now=now + timedelta(seconds=1)) == [job_name(prepull)]
    assert cluster.get("Job", job_name(prepull)) is None
