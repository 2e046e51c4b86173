"""The Kubernetes backend against a fake API server (real client above the transport), every manifest validated."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import kubernetes_validate
import pytest
from sqlalchemy import text

from forecaster.actuation.actuator import Actuator
from forecaster.actuation.backends.base import ModelTarget, ReplicaState
from forecaster.actuation.backends.kubernetes import KubernetesBackend, job_name, prepull_job_manifest
from forecaster.actuation.kube_coldstarts import cold_starts_from_k8s, load_k8s_export, parse_go_duration
from forecaster.store.actions import list_actions
from forecaster.contracts.actions import Action, ActionKind, ActionStatus, FailureReason, Plan, Reason
from tests.kube_fixtures import (
    FakeKubeApi,
    complete_jobs,
    deployment,
    fail_pulls,
    hpa,
    inference_service,
    kubelet_event as _event,
    pod_autoscaler,
    ready_pod as _pod,
    scaled_object,
    validate_manifest,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


@pytest.fixture
def api() -> FakeKubeApi:
    fake = FakeKubeApi()
    fake.put({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "prewarm", "namespace": "default"},
              "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "prewarm"}},
                       "template": {"metadata": {"labels": {"app": "prewarm"}},
                                    "spec": {"containers": [{"name": "prewarm", "image": "prewarm:dev"}]}}}})
    return fake


@pytest.fixture
def backend(api: FakeKubeApi) -> KubernetesBackend:
    return KubernetesBackend(api.client(), owner_deployment="prewarm", clock=lambda: NOW, sleep=lambda s: None,
                             job_wait_s=5.0, image_pull_secret="regcred")


def _prepull(node: str = "gpu-node-1", image: str = "registry.example.com/llm/vllm:0.6.0", minutes: int = 10):
    return Action(kind=ActionKind.PREPULL, model_id="llama-3-8b", reason=Reason.CACHE_WARM, not_before=NOW,
                  deadline=NOW + timedelta(minutes=minutes), node_id=node, target=image)


def _scale(model: str, replicas: int, kind=ActionKind.SCALE, minutes: int = 10):
    return Action(kind=kind, model_id=model, reason=Reason.FORECAST_SPIKE if kind is ActionKind.SCALE
                  else Reason.IDLE_RELEASE, not_before=NOW, deadline=NOW + timedelta(minutes=minutes),
                  replicas=replicas)


def test_prepull_job_manifest_is_strictly_valid_pinned_limited_labelled_and_owned(backend):
    manifest = backend.prepull_job(_prepull(), deadline_s=600)
    kubernetes_validate.validate(manifest, "1.30.0", strict=True)
    spec = manifest["spec"]
    pod = spec["template"]["spec"]
    assert spec["activeDeadlineSeconds"] == 600 and spec["ttlSecondsAfterFinished"] == 600
    assert spec["backoffLimit"] == 0
    assert pod["nodeSelector"] == {"kubernetes.io/hostname": "gpu-node-1"}
    assert pod["containers"][0]["image"] == "registry.example.com/llm/vllm:0.6.0"
    assert pod["containers"][0]["command"] == ["/prewarm/true"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    labels = manifest["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "prewarm" and labels["prewarm.io/model"] == "llama-3-8b"
    owner = manifest["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "Deployment" and owner["name"] == "prewarm" and owner["uid"]
    assert manifest["metadata"]["annotations"]["prewarm.io/deadline"] == (NOW + timedelta(seconds=600)).isoformat()


def test_odd_model_ids_still_give_valid_labels_and_names():
    action = Action(kind=ActionKind.PREPULL, model_id="Org/Model Name:v2 (instruct)" + "x" * 80,
                    reason=Reason.CACHE_WARM, not_before=NOW, deadline=NOW + timedelta(minutes=1),
                    node_id="ip-10-0-0-1.ec2.internal", target="img:1")
    manifest = prepull_job_manifest(action, namespace="ml", deadline_s=0.4, now=NOW, helper_image="busybox:1.36",
                                    ttl_s=60, model_label="prewarm.io/model")
    kubernetes_validate.validate(manifest, "1.30.0", strict=True)
    assert manifest["spec"]["activeDeadlineSeconds"] == 1
    assert len(manifest["metadata"]["labels"]["prewarm.io/model"]) <= 63


def test_prepull_job_runs_once_per_action_key(api, backend):
    api.kubelet = complete_jobs
    first = backend.carry_out(_prepull(), model=ModelTarget("llama-3-8b"), replicas=None, deadline_s=600)
    second = backend.carry_out(_prepull(), model=ModelTarget("llama-3-8b"), replicas=None, deadline_s=600)
    assert first.status is ActionStatus.SUCCEEDED and first.detail["created"] is True
    assert second.status is ActionStatus.SUCCEEDED and second.detail["created"] is False
    jobs = [k for k in api.objects if k[2] == "jobs"]
    assert len(jobs) == 1 and jobs[0][3] == job_name(_prepull())
    assert not api.invalid
    # Another node is another unit of work.
    backend.carry_out(_prepull(node="gpu-node-2"), model=ModelTarget("llama-3-8b"), replicas=None, deadline_s=600)
    assert len([k for k in api.objects if k[2] == "jobs"]) == 2


@pytest.mark.parametrize("message, reason", [
    ('rpc error: code = NotFound desc = failed to pull and unpack image "x": failed to resolve reference "x": '
     'x: not found', FailureReason.NOT_FOUND),
    ('failed to pull and unpack image "x": failed to authorize: failed to fetch anonymous token: unexpected status: '
     '401 Unauthorized', FailureReason.UNAUTHORISED),
])
def test_prepull_pull_errors_map_to_fixed_reasons_and_the_job_is_removed(api, backend, message, reason):
    api.kubelet = fail_pulls(message)
    outcome = backend.carry_out(_prepull(), model=ModelTarget("llama-3-8b"), replicas=None, deadline_s=600)
    assert outcome.status is ActionStatus.FAILED and outcome.reason is reason and outcome.temporary is False
    assert not [k for k in api.objects if k[2] in ("jobs", "pods")]


def test_prepull_not_done_in_time_is_a_temporary_timeout(api, backend):
    backend.job_wait_s = 0.05
    outcome = backend.carry_out(_prepull(), model=ModelTarget("m"), replicas=None, deadline_s=600)
    assert outcome.reason is FailureReason.TIMEOUT and outcome.temporary is True


def test_cleanup_removes_finished_and_expired_jobs_only(api, backend):
    api.kubelet = complete_jobs
    backend.carry_out(_prepull(node="a"), model=ModelTarget("m"), replicas=None, deadline_s=600)
    api.kubelet = None
    backend.job_wait_s = 0
    backend.carry_out(_prepull(node="b"), model=ModelTarget("m"), replicas=None, deadline_s=600)  # still running
    backend.carry_out(_prepull(node="c"), model=ModelTarget("m"), replicas=None, deadline_s=30)  # expires soon
    removed = backend.cleanup(now=NOW + timedelta(seconds=60))
    remaining = {k[3] for k in api.objects if k[2] == "jobs"}
    assert set(removed) == {job_name(_prepull(node="a")), job_name(_prepull(node="c", minutes=10))}
    assert remaining == {job_name(_prepull(node="b"))}


def _register(engine, model_id: str, gpus: int = 1, **labels) -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id, gpus_per_replica, labels) VALUES (:i, :g, CAST(:l AS jsonb))"),
                     {"i": model_id, "g": gpus, "l": json.dumps(labels)})


def test_scale_deployment_without_hpa_through_the_actuator_within_gpu_budget(engine, settings, api, backend):
    api.put(deployment("llama"))
    api.put(deployment("mistral", replicas=0))
    _register(engine, "llama", gpus=2)
    _register(engine, "mistral", gpus=2)
    settings = settings.model_copy(update={"actuator_gpu_budget": 8})
    actuator = Actuator(engine, settings, backend)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(_scale("llama", 3),)), now=NOW)
    assert [r.status for r in reports] == [ActionStatus.SUCCEEDED]
    # No HPA: nothing reactive asks for replicas, so all 3 x 2 GPUs are scale-ahead: 6 of 8.
    assert api.get("Deployment", "llama")["spec"]["replicas"] == 3
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(_scale("mistral", 4),)), now=NOW)
    assert reports[0].status is ActionStatus.SUCCEEDED
    assert api.get("Deployment", "mistral")["spec"]["replicas"] == 1  # clamped: 2 GPUs left = 1 replica
    assert reports[0].detail["guardrails"]["clamped_from"] == 4
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(_scale("mistral", 3),)), now=NOW)
    assert reports[0].status is ActionStatus.DROPPED and reports[0].reason is FailureReason.GPU_BUDGET
    assert api.get("Deployment", "mistral")["spec"]["replicas"] == 1
    for obj in api.written:
        validate_manifest(obj)
    assert not api.invalid


def test_deployment_with_hpa_raises_the_hpa_floor_and_releases_it_down_to_the_hpa_s_own_wish(engine, settings, api,
                                                                                               backend):
    api.put(deployment("llama", replicas=4))
    api.put(hpa("llama-hpa", "llama", min_replicas=1, max_replicas=10, desired=4))
    _register(engine, "llama")
    actuator = Actuator(engine, settings, backend)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(_scale("llama", 6),)), now=NOW)
    assert reports[0].status is ActionStatus.SUCCEEDED
    patched = api.get("HorizontalPodAutoscaler", "llama-hpa")
    assert patched["spec"]["minReplicas"] == 6
    assert patched["metadata"]["annotations"]["prewarm.io/base-min-replicas"] == "1"
    assert api.get("Deployment", "llama")["spec"]["replicas"] == 4  # the HPA, not prewarm, scales the Deployment
    # The HPA's metrics now ask for 8, above the floor: its own wish, and a release may not go below it.
    api.sync_hpa("llama-hpa", wants=8)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(_scale("llama", 5, ActionKind.RELEASE),)),
                                now=NOW + timedelta(seconds=1))
    assert reports[0].status is ActionStatus.DROPPED and reports[0].reason is FailureReason.BELOW_REACTIVE
    assert api.get("HorizontalPodAutoscaler", "llama-hpa")["spec"]["minReplicas"] == 6
    # The metrics fall to 4: the HPA reports 6 (its wish clamped to the floor, ScalingLimited/TooFewReplicas).
    # That 6 is prewarm's own floor, not an ask: the release goes through, down to the HPA's own floor.
    api.sync_hpa("llama-hpa", wants=4)
    assert api.get("HorizontalPodAutoscaler", "llama-hpa")["status"]["desiredReplicas"] == 6
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(_scale("llama", 5, ActionKind.RELEASE),)),
                                now=NOW + timedelta(seconds=2))
    assert reports[0].status is ActionStatus.SUCCEEDED
    assert reports[0].detail["guardrails"]["reactive_ask"] == 1
    assert api.get("HorizontalPodAutoscaler", "llama-hpa")["spec"]["minReplicas"] == 1
    api.sync_hpa("llama-hpa", wants=4)  # the HPA keeps what its metrics ask
    assert api.get("Deployment", "llama")["spec"]["replicas"] == 4
    rows = list_actions(engine, model_id="llama")
    assert sorted((r["kind"], r["status"], r["status_reason"]) for r in rows) == [
        ("release", "dropped", "below_reactive"), ("release", "succeeded", None), ("scale", "succeeded", None)]
    assert not api.invalid


def test_an_hpa_at_its_own_floor_or_exactly_at_prewarm_s_asks_what_it_reports(api, backend):
    llama = ModelTarget("llama")
    api.put(deployment("llama", replicas=2))
    api.put(hpa("llama-hpa", "llama", min_replicas=2, max_replicas=10, desired=2))
    api.sync_hpa("llama-hpa", wants=1)  # TooFewReplicas, but the floor is the HPA's own: it holds 2 itself
    assert backend.replica_state(llama).reactive_ask == 2
    backend.carry_out(_scale("llama", 5), model=llama, replicas=5, deadline_s=600)
    api.sync_hpa("llama-hpa", wants=5)  # exactly the floor prewarm set, within range: a real wish of 5
    assert backend.replica_state(llama) == ReplicaState(current=5, reactive_ask=5, floor_kind="min_replicas")
    api.sync_hpa("llama-hpa", wants=3)
    assert backend.replica_state(llama).reactive_ask == 2  # below the floor by an unknown amount: its own floor


def _hpa_lists(api: FakeKubeApi) -> int:
    return sum(1 for method, path, _ in api.requests if method == "GET" and path.endswith("/horizontalpodautoscalers"))


class _Monotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_many_scales_in_a_namespace_of_hpas_list_them_once_per_ttl(engine, settings, api):
    """40 models, 30 behind HPAs: one plan of 40 scales (in parallel threads) lists the HPAs once, not 80 times."""
    monotonic = _Monotonic()
    backend = KubernetesBackend(api.client(), clock=lambda: NOW, sleep=lambda s: None, hpa_index_ttl_s=60,
                                monotonic=monotonic)
    models = [f"m{i:02d}" for i in range(40)]
    for i, model in enumerate(models):
        api.put(deployment(model, replicas=1))
        if i < 30:
            api.put(hpa(f"{model}-autoscaler", model, min_replicas=1, max_replicas=10, desired=1))
        _register(engine, model)
    actuator = Actuator(engine, settings.model_copy(update={"actuator_parallelism": 8}), backend)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=tuple(_scale(m, 3) for m in models)), now=NOW)
    assert {r.status for r in reports} == {ActionStatus.SUCCEEDED}
    assert _hpa_lists(api) == 1
    for i, model in enumerate(models):
        if i < 30:  # the HPA's floor, not the Deployment (the HPA would undo that)
            assert api.get("HorizontalPodAutoscaler", f"{model}-autoscaler")["spec"]["minReplicas"] == 3
            assert api.get("Deployment", model)["spec"]["replicas"] == 1
        else:
            assert api.get("Deployment", model)["spec"]["replicas"] == 3
    # Within the period the listing is reused; after it, listed again.
    monotonic.now += 59
    actuator.apply(Plan(planned_at=NOW, actions=(_scale("m00", 4),)), now=NOW + timedelta(seconds=59))
    assert _hpa_lists(api) == 1
    monotonic.now += 2
    actuator.apply(Plan(planned_at=NOW, actions=(_scale("m00", 5),)), now=NOW + timedelta(seconds=61))
    assert _hpa_lists(api) == 2
    assert api.get("HorizontalPodAutoscaler", "m00-autoscaler")["spec"]["minReplicas"] == 5
    assert not api.invalid


def test_an_hpa_deleted_retargeted_or_created_since_the_listing(api):
    monotonic = _Monotonic()
    backend = KubernetesBackend(api.client(), clock=lambda: NOW, sleep=lambda s: None, hpa_index_ttl_s=60,
                                monotonic=monotonic)
    for name in ("llama", "mistral", "qwen"):
        api.put(deployment(name, replicas=2))
    api.put(hpa("llama-hpa", "llama", min_replicas=1, max_replicas=10, desired=2))
    api.put(hpa("shared-hpa", "mistral", min_replicas=2, max_replicas=10, desired=3))
    llama, mistral, qwen = (ModelTarget(m) for m in ("llama", "mistral", "qwen"))
    assert backend.replica_state(llama).floor_kind == "min_replicas"
    assert backend.replica_state(mistral).reactive_ask == 3
    assert backend.replica_state(qwen).floor_kind == "replicas"
    assert _hpa_lists(api) == 1
    # Deleted: the GET finds nothing, the namespace is listed again, the Deployment is scaled directly.
    backend.autoscaling.delete_namespaced_horizontal_pod_autoscaler("llama-hpa", "default")
    assert backend.replica_state(llama).floor_kind == "replicas"
    assert _hpa_lists(api) == 2
    # Retargeted from mistral to qwen: mistral's lookup sees the change, lists again, and finds no HPA.
    backend.autoscaling.patch_namespaced_horizontal_pod_autoscaler(
        "shared-hpa", "default", {"spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                                              "name": "qwen"}}})
    assert backend.replica_state(mistral).floor_kind == "replicas"
    assert _hpa_lists(api) == 3
    assert backend.replica_state(qwen).reactive_ask == 3  # from the listing just made
    assert _hpa_lists(api) == 3
    # Created since the listing: seen once the period has passed, not before (the setting's documented bound).
    api.put(hpa("llama-hpa-2", "llama", min_replicas=1, max_replicas=4, desired=2))
    assert backend.replica_state(llama).floor_kind == "replicas"
    monotonic.now += 60
    assert backend.replica_state(llama).floor_kind == "min_replicas"
    outcome = backend.carry_out(_scale("llama", 6), model=llama, replicas=6, deadline_s=600)
    assert outcome.status is ActionStatus.SUCCEEDED and outcome.detail["capped_by_max"]
    assert api.get("HorizontalPodAutoscaler", "llama-hpa-2")["spec"]["minReplicas"] == 4
    # A period of 0 lists on every lookup.
    backend.hpas.ttl_s = 0
    lists = _hpa_lists(api)
    backend.replica_state(llama)
    backend.replica_state(qwen)
    assert _hpa_lists(api) == lists + 2
    assert not api.invalid


def test_inference_service_min_replicas_by_merge_patch_with_knative_ask_as_floor(engine, settings, api, backend):
    api.put(inference_service("qwen", min_replicas=0))
    api.put(pod_autoscaler("qwen", desired=3))
    _register(engine, "qwen", k8s_kind="InferenceService")
    actuator = Actuator(engine, settings, backend)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(_scale("qwen", 2),)), now=NOW)
    assert reports[0].status is ActionStatus.SUCCEEDED
    # The plan asked for 2; Knative wants 3 already: never below the reactive ask.
    assert api.get("InferenceService", "qwen")["spec"]["predictor"]["minReplicas"] == 3
    patch = [b for m, p, b in api.requests if m == "PATCH" and p.endswith("/inferenceservices/qwen")]
    assert patch == [{"metadata": {"annotations": {"prewarm.io/base-min-replicas": "0"}},
                      "spec": {"predictor": {"minReplicas": 3}}}]
    # Knative's wish falls to 1; its PodAutoscaler reports 3, bounded by the floor. The release goes through.
    api.sync_pod_autoscaler("qwen", wants=1)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(_scale("qwen", 3, ActionKind.RELEASE),)),
                                now=NOW + timedelta(seconds=1))
    assert reports[0].status is ActionStatus.SUCCEEDED
    assert api.get("InferenceService", "qwen")["spec"]["predictor"]["minReplicas"] == 0
    assert not api.invalid


def test_inference_service_keeps_its_own_min_replicas_and_max(api, backend):
    qwen = ModelTarget("qwen", labels={"k8s_kind": "InferenceService"})
    api.put(inference_service("qwen", min_replicas=1))  # maxReplicas 8
    api.put(pod_autoscaler("qwen", desired=1))
    outcome = backend.carry_out(_scale("qwen", 12), model=qwen, replicas=12, deadline_s=600)
    assert outcome.detail["replicas"] == 8 and outcome.detail["capped_by_max"] is True
    outcome = backend.carry_out(_scale("qwen", 8, ActionKind.RELEASE), model=qwen, replicas=0, deadline_s=600)
    assert api.get("InferenceService", "qwen")["spec"]["predictor"]["minReplicas"] == 1
    assert outcome.detail["base_min"] == 1
    assert not api.invalid


def test_a_raw_deployment_inference_service_reads_its_ask_from_the_predictor_s_hpa(engine, settings, api, backend):
    isvc = inference_service("qwen", min_replicas=1)
    isvc["metadata"]["annotations"] = {"serving.kserve.io/deploymentMode": "RawDeployment"}
    made = hpa("qwen-predictor", "qwen-predictor", min_replicas=1, max_replicas=8, desired=1)
    made["metadata"]["ownerReferences"] = [{"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
                                            "name": "qwen", "uid": "0f4c6f5e-1d1b-4c59-9d59-2f1f3b8e6c11",
                                            "controller": True}]
    api.put(isvc)
    api.put(deployment("qwen-predictor"))
    api.put(made)
    api.sync_hpa("qwen-predictor", wants=3)  # KServe's HPA wants 3: its own wish, above the floor of 1
    _register(engine, "qwen", k8s_kind="InferenceService")
    actuator = Actuator(engine, settings, backend)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(_scale("qwen", 2),)), now=NOW)
    assert reports[0].status is ActionStatus.SUCCEEDED and reports[0].detail["guardrails"]["reactive_ask"] == 3
    assert api.get("InferenceService", "qwen")["spec"]["predictor"]["minReplicas"] == 3  # never below the ask
    api.sync_kserve_raw("qwen")
    api.sync_hpa("qwen-predictor", wants=1)  # clamped to the floor KServe copied: 3, TooFewReplicas
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(_scale("qwen", 2, ActionKind.RELEASE),)),
                                now=NOW + timedelta(seconds=1))
    assert reports[0].status is ActionStatus.SUCCEEDED and reports[0].detail["guardrails"]["reactive_ask"] == 1
    assert api.get("InferenceService", "qwen")["spec"]["predictor"]["minReplicas"] == 1
    assert not api.invalid


def test_a_keda_hpa_gets_its_floor_through_the_scaled_object_that_keda_copies_it_from(engine, settings, api, backend):
    scaled, keda_hpa = scaled_object("llama", "llama", min_replica_count=0, max_replica_count=8)
    api.put(deployment("llama", replicas=1))
    api.put(scaled)
    api.put(keda_hpa)
    _register(engine, "llama")
    actuator = Actuator(engine, settings, backend)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(_scale("llama", 4),)), now=NOW)
    assert reports[0].status is ActionStatus.SUCCEEDED
    api.sync_keda("llama")  # KEDA rewrites its HPA from the ScaledObject: the floor survives it
    assert api.get("HorizontalPodAutoscaler", "keda-hpa-llama")["spec"]["minReplicas"] == 4
    assert reports[0].detail["workload"] == "ScaledObject/default/llama"
    assert api.get("ScaledObject", "llama")["metadata"]["annotations"]["prewarm.io/base-min-replicas"] == "0"
    assert not [p for m, p, _ in api.requests if m == "PATCH" and "horizontalpodautoscalers" in p]
    # The metrics ask for 1: the HPA reports 4 (clamped, TooFewReplicas); the release goes to KEDA's own 0.
    api.sync_hpa("keda-hpa-llama", wants=1)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(_scale("llama", 4, ActionKind.RELEASE),)),
                                now=NOW + timedelta(seconds=1))
    assert reports[0].status is ActionStatus.SUCCEEDED and reports[0].detail["guardrails"]["reactive_ask"] == 0
    assert api.get("ScaledObject", "llama")["spec"]["minReplicaCount"] == 0
    api.sync_keda("llama")
    assert api.get("HorizontalPodAutoscaler", "keda-hpa-llama")["spec"]["minReplicas"] == 1  # KEDA's own
    outcome = backend.carry_out(_scale("llama", 12), model=ModelTarget("llama"), replicas=12, deadline_s=600)
    assert outcome.detail["replicas"] == 8 and outcome.detail["capped_by_max"] is True
    assert not api.invalid


def test_an_hpa_another_controller_owns_is_refused_naming_it(api, backend):
    made = hpa("qwen-predictor", "qwen-predictor", min_replicas=1, max_replicas=4, desired=1)
    made["metadata"]["ownerReferences"] = [{"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
                                            "name": "qwen", "uid": "0f4c6f5e-1d1b-4c59-9d59-2f1f3b8e6c11",
                                            "controller": True}]
    api.put(deployment("qwen-predictor"))
    api.put(made)
    outcome = backend.carry_out(_scale("qwen-predictor", 3), model=ModelTarget("qwen-predictor"), replicas=3,
                                deadline_s=600)
    assert outcome.status is ActionStatus.FAILED and outcome.reason is FailureReason.UNSUPPORTED
    assert outcome.temporary is False and "InferenceService qwen" in outcome.message
    assert api.get("HorizontalPodAutoscaler", "qwen-predictor")["spec"]["minReplicas"] == 1


def test_missing_workload_is_not_found(engine, settings, api, backend):
    _register(engine, "ghost")
    actuator = Actuator(engine, settings, backend)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(_scale("ghost", 2),)), now=NOW)
    # Reading replicas failed (404): a temporary failure is retried later, within the deadline.
    assert reports[0].status is ActionStatus.PENDING and reports[0].reason is FailureReason.INTERNAL


def test_preload_is_unsupported_without_the_agent(backend):
    action = Action(kind=ActionKind.PRELOAD, model_id="m", reason=Reason.CACHE_WARM, not_before=NOW,
                    deadline=NOW + timedelta(minutes=5), node_id="n", target="s3://b/k", tier="disk")
    outcome = backend.carry_out(action, model=ModelTarget("m"), replicas=None, deadline_s=300)
    assert outcome.reason is FailureReason.UNSUPPORTED


# --- cold starts from pod status and kubelet events -------------------------------------------------------------


def test_go_durations():
    assert parse_go_duration("3.2s") == pytest.approx(3.2)
    assert parse_go_duration("1m2.5s") == pytest.approx(62.5)
    assert parse_go_duration("812ms") == pytest.approx(0.812)
    assert parse_go_duration("soon") is None


def test_cold_starts_from_the_api_are_stored(engine, settings, api, backend):
    api.put(_pod("llama-7d9f8b6c5d-x2x4z", "llama", "gpu-node-1", "2026-11-29T10:00:00Z", "2026-11-29T10:00:31Z",
                 "2026-11-29T10:01:05Z"))
    api.put(_event("llama-7d9f8b6c5d-x2x4z", "Pulled",
                   'Successfully pulled image "vllm/vllm-openai:v0.6.0" in 28.5s (29.1s including waiting)',
                   "2026-11-29T10:00:30Z"))
    api.put(_pod("llama-7d9f8b6c5d-q8w7e", "llama", "gpu-node-2", "2026-11-29T10:05:00Z", "2026-11-29T10:05:02Z",
                 "2026-11-29T10:05:40Z"))
    api.put(_event("llama-7d9f8b6c5d-q8w7e", "Pulled",
                   'Container image "vllm/vllm-openai:v0.6.0" already present on machine', "2026-11-29T10:05:01Z",
                   node="gpu-node-2"))
    _register(engine, "llama")
    summary = Actuator(engine, settings, backend).collect_observations(now=NOW)
    assert summary == {"observed": 2, "inserted": 2, "already_stored": 0, "rejected": 0, "dropped_long_start": 0}
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT node_id, total_seconds, image_pull_s, weight_load_s, cache_state, source "
                                 "FROM cold_starts ORDER BY started_at")).all()
    assert rows[0] == ("gpu-node-1", 65.0, 28.5, 34.0, "none", "actuator-kubernetes")
    assert rows[1] == ("gpu-node-2", 40.0, 0.0, 38.0, "image", "actuator-kubernetes")


def test_one_bad_pod_does_not_keep_the_others_out_of_the_store(engine, settings, api, backend):
    """Rows are validated one by one: a pod of a model the catalogue does not know is rejected and reported; the
    good ones are stored, among them both of two replicas created in the same second on one node (their uids, the
    event_id, tell them apart as the table's key does). A pod created two days ago is outside the collector's
    window (``coldstart_max_start_s``) and not observed at all."""
    api.put(_pod("llama-7d9f8b6c5d-x2x4z", "llama", "gpu-node-1", "2026-11-29T10:00:00Z", "2026-11-29T10:00:31Z",
                 "2026-11-29T10:01:05Z"))
    api.put(_pod("llama-7d9f8b6c5d-y3y5a", "llama", "gpu-node-1", "2026-11-29T10:00:00Z", "2026-11-29T10:00:33Z",
                 "2026-11-29T10:01:10Z"))  # the same second, the same node: another replica
    api.put(_pod("ghost-5f6d7c8b9a-k2k3m", "ghost", "gpu-node-2", "2026-11-29T10:05:00Z", "2026-11-29T10:05:10Z",
                 "2026-11-29T10:06:00Z"))
    api.put(_pod("llama-7d9f8b6c5d-p4p5q", "llama", "gpu-node-3", "2026-11-27T09:00:00Z", "2026-11-29T09:59:00Z",
                 "2026-11-29T10:00:00Z"))  # pending two days for a GPU: outside the window
    api.put(_pod("llama-7d9f8b6c5d-q8w7e", "llama", "gpu-node-2", "2026-11-29T10:05:00Z", "2026-11-29T10:05:02Z",
                 "2026-11-29T10:05:40Z"))
    _register(engine, "llama")
    summary = Actuator(engine, settings, backend).collect_observations(now=NOW)
    assert (summary["observed"], summary["inserted"], summary["already_stored"], summary["rejected"]) == (4, 3, 0, 1)
    assert summary["rejected_reasons"] == {"unknown_model": 1}
    assert {(r["row"], r["reason"]) for r in summary["rejected_rows"]} == {(3, "unknown_model")}
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT node_id, total_seconds FROM cold_starts ORDER BY started_at, total_seconds"
                                 )).all()
    assert [tuple(r) for r in rows] == [("gpu-node-1", 65.0), ("gpu-node-1", 70.0), ("gpu-node-2", 40.0)]


def test_a_readiness_flap_long_after_creation_is_not_a_cold_start(api, backend):
    """Ready's lastTransitionTime moves when a readiness probe fails and recovers (restartCount stays 0): a pod
    created at 06:00, first Ready at 06:01:30 and flapped at 11:30 must not be stored as a 19,800 s start, neither
    on the first run (no watermark) nor after an outage (a watermark long after its creation)."""
    api.put(_pod("llama-7d9f8b6c5d-f1a2p", "llama", "gpu-node-1", "2026-11-29T06:00:00Z", "2026-11-29T06:00:20Z",
                 "2026-11-29T11:30:00Z"))
    api.put(_pod("llama-7d9f8b6c5d-x2x4z", "llama", "gpu-node-2", "2026-11-29T11:20:00Z", "2026-11-29T11:20:31Z",
                 "2026-11-29T11:21:05Z"))
    for since in (None, datetime(2026, 11, 29, 11, 0, tzinfo=timezone.utc)):
        rows = backend.observe_cold_starts(since=since)
        assert [(r["node_id"], r["total_seconds"]) for r in rows] == [("gpu-node-2", 65.0)], since
    # the bound is a setting: a narrower window leaves the 11:20 pod out on a first run at 12:00 too
    narrow = KubernetesBackend(api.client(), clock=lambda: NOW, sleep=lambda s: None, coldstart_max_start_s=1800)
    assert narrow.observe_cold_starts() == []


def test_the_first_observation_of_a_cold_start_wins(engine, settings, api, backend):
    """A pod whose Ready condition moved later (a readiness flap) is seen again: the stored cold start stays."""
    pod = api.put(_pod("llama-7d9f8b6c5d-x2x4z", "llama", "gpu-node-1", "2026-11-29T10:00:00Z",
                       "2026-11-29T10:00:31Z", "2026-11-29T10:01:05Z"))
    _register(engine, "llama")
    actuator = Actuator(engine, settings, backend)
    assert actuator.collect_observations(now=NOW)["inserted"] == 1
    pod["status"]["conditions"][1]["lastTransitionTime"] = "2026-11-29T11:40:00Z"
    api.put(pod)
    summary = actuator.collect_observations(now=NOW + timedelta(minutes=1))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT total_seconds, weight_load_s FROM cold_starts")).all() == [(65.0, 34.0)]
    assert summary == {"observed": 1, "inserted": 0, "already_stored": 1, "rejected": 0, "dropped_long_start": 0}


def test_cold_starts_from_an_exported_events_file(tmp_path):
    pod = "mistral-predictor-00001-deployment-6f7c9d8b5-abcde"
    events = [_event(pod, "Scheduled", f"Successfully assigned default/{pod} to gpu-node-3",
                     "2026-11-29T09:00:00Z", node=""),
              _event(pod, "Pulling", 'Pulling image "kserve/huggingfaceserver:v0.14"', "2026-11-29T09:00:01Z",
                     node="gpu-node-3"),
              _event(pod, "Pulled", 'Successfully pulled image "kserve/huggingfaceserver:v0.14" in 1m2.5s '
                     "(1m2.6s including waiting)", "2026-11-29T09:01:03Z", node="gpu-node-3"),
              _event(pod, "Started", "Started container kserve-container", "2026-11-29T09:01:04Z",
                     node="gpu-node-3")]
    for e in events:
        e["source"].pop("host") if not e["source"]["host"] else None
    path = tmp_path / "events.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": events}))
    pods, loaded = load_k8s_export(path)
    assert pods == [] and len(loaded) == 4
    rows = cold_starts_from_k8s(pods, loaded, pods_from_events=True)
    assert rows == [{"model_id": "mistral", "node_id": "gpu-node-3", "started_at": "2026-11-29T09:00:00+00:00",
                     "total_seconds": 64.0, "event_id": f"pod/{pod}", "image_pull_s": 62.5, "cache_state": "none"}]
    assert cold_starts_from_k8s(pods, loaded) == []  # counting pods from their events alone is the file's option


def test_events_of_pods_not_listed_never_become_cold_starts(api, backend):
    """The live collector counts listed pods only: a deleted replica, prewarm's own pre-pull pod and a listed pod
    that a watermark leaves out are no cold starts of their own (the events-only path is for exported files)."""
    listed = api.put(_pod("llama-7d9f8b6c5d-x2x4z", "llama", "gpu-node-1", "2026-11-29T10:00:00Z",
                          "2026-11-29T10:00:31Z", "2026-11-29T10:01:05Z"))
    old = api.put(_pod("llama-7d9f8b6c5d-q8w7e", "llama", "gpu-node-2", "2026-11-29T09:00:00Z",
                       "2026-11-29T09:00:20Z", "2026-11-29T09:00:40Z"))
    for pod, uid, node, t0 in (("llama-7d9f8b6c5d-gone1", "0b7e3f1c-0000-4000-8000-000000000001", "gpu-node-3",
                                "2026-11-29T10:02"),  # deleted since
                               ("prewarm-pull-0123456789abcdef-k2j4x", "0b7e3f1c-0000-4000-8000-000000000002",
                                "gpu-node-1", "2026-11-29T10:03"),  # a pre-pull Job's pod, gone with its Job
                               (old["metadata"]["name"], old["metadata"]["uid"], "gpu-node-2", "2026-11-29T09:00"),
                               (listed["metadata"]["name"], listed["metadata"]["uid"], "gpu-node-1",
                                "2026-11-29T10:00")):
        api.put({**_event(pod, "Scheduled", f"Successfully assigned default/{pod} to {node}", f"{t0}:00Z",
                          node=node, uid=uid),  # the scheduler's: a MicroTime, no first or last timestamp
                 "eventTime": f"{t0}:00.412331Z", "firstTimestamp": None, "lastTimestamp": None,
                 "source": {"component": "default-scheduler"}, "reportingComponent": "default-scheduler",
                 "reportingInstance": "default-scheduler-control-plane", "action": "Binding"})
        api.put(_event(pod, "Started", "Started container server", f"{t0}:30Z", node=node, uid=uid,
                       field_path="spec.containers{server}"))
    rows = backend.observe_cold_starts(since=datetime(2026, 11, 29, 9, 30, tzinfo=timezone.utc))
    assert [(r["model_id"], r["node_id"], r["started_at"], r["total_seconds"]) for r in rows] == [
        ("llama", "gpu-node-1", "2026-11-29T10:00:00+00:00", 65.0)]


def test_the_watermark_counts_pods_by_when_they_became_ready(api, backend):
    """A pod created before the watermark but ready after it is a cold start the last run could not see yet."""
    api.put(_pod("llama-7d9f8b6c5d-x2x4z", "llama", "gpu-node-1", "2026-11-29T10:00:00Z", "2026-11-29T10:14:00Z",
                 "2026-11-29T10:20:00Z"))  # 20 minutes: pending for a GPU, then loading
    api.put(_pod("llama-7d9f8b6c5d-q8w7e", "llama", "gpu-node-2", "2026-11-29T10:00:00Z", "2026-11-29T10:01:00Z",
                 "2026-11-29T10:02:00Z"))  # ready before the watermark: an earlier run stored it
    rows = backend.observe_cold_starts(since=datetime(2026, 11, 29, 10, 10, tzinfo=timezone.utc))
    assert [(r["node_id"], r["total_seconds"]) for r in rows] == [("gpu-node-1", 1200.0)]


def test_a_pod_whose_containers_restarted_is_left_out(api, backend):
    """After a restart, Ready's lastTransitionTime and the container's startedAt are the restart's: 65 s would
    read as 6,000 s. Such a pod is no cold-start observation (the one stored while it was fresh stays)."""
    fresh = _pod("llama-7d9f8b6c5d-x2x4z", "llama", "gpu-node-1", "2026-11-29T10:00:00Z", "2026-11-29T10:00:31Z",
                 "2026-11-29T10:01:05Z")
    flapped = _pod("llama-7d9f8b6c5d-q8w7e", "llama", "gpu-node-2", "2026-11-29T10:00:00Z", "2026-11-29T11:39:00Z",
                   "2026-11-29T11:40:00Z")
    flapped["status"]["containerStatuses"][0].update(restartCount=1, lastState={"terminated": {
        "exitCode": 137, "reason": "OOMKilled", "startedAt": "2026-11-29T10:00:31Z",
        "finishedAt": "2026-11-29T11:38:50Z"}})
    api.put(fresh)
    api.put(flapped)
    rows = backend.observe_cold_starts()
    assert [(r["node_id"], r["total_seconds"]) for r in rows] == [("gpu-node-1", 65.0)]


def test_the_pull_is_the_serving_containers_of_this_very_pod(api, backend):
    """A KServe predictor pod recreated under the same name: the storage-initializer's pull, a sidecar's and the
    earlier pod's (grouped by uid, and before this pod's creation) are not the serving container's."""
    name = "qwen-predictor-0"  # a StatefulSet-style name the new pod reuses
    pod = _pod(name, "qwen", "gpu-node-1", "2026-11-29T10:00:00Z", "2026-11-29T10:00:20Z", "2026-11-29T10:01:20Z")
    pod["metadata"]["annotations"] = {"kubectl.kubernetes.io/default-container": "kserve-container"}
    pod["spec"]["containers"] = [{"name": "istio-proxy", "image": "istio/proxyv2:1.22.0"},
                                 {"name": "kserve-container", "image": "kserve/huggingfaceserver:v0.14"}]
    pod["spec"]["initContainers"] = [{"name": "storage-initializer", "image": "kserve/storage-initializer:v0.14"}]
    pod["status"]["containerStatuses"] = [
        {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.22.0", "imageID": "", "ready": True,
         "restartCount": 0, "state": {"running": {"startedAt": "2026-11-29T10:00:02Z"}}},
        {"name": "kserve-container", "image": "docker.io/kserve/huggingfaceserver:v0.14", "imageID": "",
         "ready": True, "restartCount": 0, "state": {"running": {"startedAt": "2026-11-29T10:00:20Z"}}}]
    uid = api.put(pod)["metadata"]["uid"]
    earlier = "5d1c2b3a-0000-4000-8000-00000000e411"
    api.put(_event(name, "Pulled", 'Successfully pulled image "kserve/huggingfaceserver:v0.14" in 4m10s '
                   "(4m11s including waiting)", "2026-11-29T09:10:00Z", uid=earlier,
                   field_path="spec.containers{kserve-container}"))
    api.put(_event(name, "Pulled", 'Successfully pulled image "kserve/storage-initializer:v0.14" in 6.2s '
                   "(6.2s including waiting)", "2026-11-29T10:00:07Z", uid=uid,
                   field_path="spec.initContainers{storage-initializer}"))
    api.put(_event(name, "Pulled", 'Container image "istio/proxyv2:1.22.0" already present on machine',
                   "2026-11-29T10:00:01Z", uid=uid, field_path="spec.containers{istio-proxy}"))
    api.put(_event(name, "Pulled", 'Successfully pulled image "kserve/huggingfaceserver:v0.14" in 12.5s '
                   "(12.9s including waiting)", "2026-11-29T10:00:19Z", uid=uid,
                   field_path="spec.containers{kserve-container}"))
    [row] = backend.observe_cold_starts()
    assert (row["total_seconds"], row["image_pull_s"], row["cache_state"], row["weight_load_s"]) == \
        (80.0, 12.5, "none", 60.0)


def test_a_recreated_pods_pull_is_not_taken_from_the_earlier_pods_event_without_a_uid(api, backend):
    """Events without a uid fall back to the pod's name, and then only those at or after its creation count."""
    pod = api.put(_pod("llama-0", "llama", "gpu-node-1", "2026-11-29T10:00:00Z", "2026-11-29T10:00:31Z",
                       "2026-11-29T10:01:05Z"))
    api.put(_event("llama-0", "Pulled", 'Successfully pulled image "vllm/vllm-openai:v0.6.0" in 50s (50s '
                   "including waiting)", "2026-11-29T09:00:50Z"))  # the earlier llama-0
    api.put(_event("llama-0", "Pulled", 'Container image "vllm/vllm-openai:v0.6.0" already present on machine',
                   "2026-11-29T10:00:30Z"))
    api.put(_event("llama-0", "Pulled", 'Successfully pulled image "fluent/fluent-bit:3.0" in 2s (2s including '
                   "waiting)", "2026-11-29T10:00:01Z"))  # another image: a sidecar's, were there a field path
    [row] = backend.observe_cold_starts()
    assert pod["metadata"]["uid"] and (row["image_pull_s"], row["cache_state"]) == (0.0, "image")


def test_a_pull_longer_than_the_whole_cold_start_is_dropped(api, backend):
    """Such a pull is not this start's (kubelet waited on another pod's pull of the image): the row keeps its total
    and load, never a phase the validator would reject the row for."""
    pod = api.put(_pod("llama-7d9f8b6c5d-x2x4z", "llama", "gpu-node-1", "2026-11-29T10:00:00Z",
                       "2026-11-29T10:00:31Z", "2026-11-29T10:01:05Z"))
    api.put(_event(pod["metadata"]["name"], "Pulled", 'Successfully pulled image "vllm/vllm-openai:v0.6.0" in '
                   "1m30s (1m31s including waiting)", "2026-11-29T10:00:30Z", uid=pod["metadata"]["uid"],
                   field_path="spec.containers{server}"))
    [row] = backend.observe_cold_starts()
    assert (row["total_seconds"], row["weight_load_s"]) == (65.0, 34.0)
    assert "image_pull_s" not in row and "cache_state" not in row
