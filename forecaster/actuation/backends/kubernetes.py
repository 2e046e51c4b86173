"""The ``kubernetes`` backend (official ``kubernetes`` client): scale ahead, and pre-pull with per-node Jobs.

Scale and release:

* a **Deployment** without an HPA: its ``/scale`` subresource gets the replicas;
* a **Deployment** with an HPA: the HPA's ``minReplicas`` is raised (the HPA
  would undo a direct change), the HPA's own floor kept in an annotation and
  restored on release. Which HPA scales which Deployment is read from one LIST
  of the namespace's HPAs every ``hpa_index_ttl_s`` (:class:`HpaIndex`), the
  HPA itself by a GET. An HPA that KEDA controls (a ScaledObject owns it) gets
  its floor through the ScaledObject's ``minReplicaCount``, which KEDA copies
  into it (a patch to the HPA would be undone); an HPA another controller owns
  is refused, naming it. Each scale or release reads the object it patches
  again (one GET), so the own floor it keeps is the one there now;
* a **KServe InferenceService**: ``spec.predictor.minReplicas`` (JSON merge
  patch; custom resources take no strategic merge), its own floor kept in the
  same annotation and restored on release. Its reactive ask is the Knative
  PodAutoscalers' (Serverless mode) or the predictor HPA's (RawDeployment).

The reactive ask is what the autoscaler wants on its own, without the floor
prewarm set (:func:`own_ask`). Both autoscalers report their wish clamped to
that floor (the HPA's ``status.desiredReplicas``, the PodAutoscaler's
``status.desiredScale``): read as the ask, a raised floor would hold itself up
and every release would be refused as below the ask. Lowering a floor below the
autoscaler's real wish is safe, since the autoscaler keeps its wish itself.

Pre-pull where no node agent runs, after kube-fledged: one Job per (image,
node), named from the action's key (so the same work twice is one Job), pinned
to the node, tolerating its taints, time-limited by ``activeDeadlineSeconds``,
labelled and owned (by the prewarm Deployment when configured), removed by
``ttlSecondsAfterFinished`` and by :meth:`KubernetesBackend.cleanup`. An init
container copies a static ``busybox`` as ``/prewarm/true`` into an emptyDir so
the pulled image's container exits at once whatever the image holds.
Pre-load needs the node agent and is refused here (``unsupported``).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

from forecaster.actuation.backends.base import ModelTarget, Outcome, ReplicaState, unsupported
from forecaster.contracts.actions import Action, ActionKind, FailureReason

log = logging.getLogger(__name__)

MANAGED_BY = "prewarm"
BASE_MIN_ANNOTATION = "prewarm.io/base-min-replicas"
KSERVE = ("serving.kserve.io", "v1beta1", "inferenceservices")
KNATIVE_PA = ("autoscaling.internal.knative.dev", "v1alpha1", "podautoscalers")
KEDA_SCALED_OBJECT = ("keda.sh", "v1alpha1", "scaledobjects")
#: The predictor Deployment (and its HPA) KServe's RawDeployment mode makes: ``<isvc>-predictor`` (0.9 and later),
#: ``<isvc>-predictor-default`` before.
KSERVE_RAW_PREDICTOR_SUFFIXES = ("-predictor", "-predictor-default")
_LABEL_OK = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def _base_min(annotations: dict | None, floor: int) -> int:
    """The autoscaler's own floor: the annotation prewarm wrote when it first raised it, else the floor now."""
    try:
        return max(0, int((annotations or {})[BASE_MIN_ANNOTATION]))
    except (KeyError, TypeError, ValueError):
        return floor


def _floor_patch(replicas: int, *, own_min: int, annotations: dict | None, ceiling: int | None,
                 field: str) -> tuple[int, int, dict]:
    """The floor to set for ``replicas`` (never below the autoscaler's own, at most ``ceiling``), that own floor,
    and the merge patch that sets ``field`` (a dotted path, ``spec.minReplicas``) to it and keeps the own floor."""
    base = _base_min(annotations, own_min)
    floor = max(replicas, base) if ceiling is None else min(max(replicas, base), ceiling)
    body: dict = {"metadata": {"annotations": {BASE_MIN_ANNOTATION: str(base)}}}
    *parents, leaf = field.split(".")
    node = body
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = floor
    return floor, base, body


def _floor_set(kind: str, namespace: str, name: str, field: str, *, floor: int, base: int, replicas: int) -> Outcome:
    return Outcome.ok(f"{kind} {namespace}/{name} {field.rsplit('.', 1)[-1]} -> {floor} (its own floor {base})",
                      workload=f"{kind}/{namespace}/{name}", field=field, replicas=floor, base_min=base,
                      capped_by_max=floor < replicas)


def _controller(hpa):
    """The object that controls ``hpa`` (its ownerReference with ``controller: true``), or None."""
    return next((o for o in (hpa.metadata.owner_references or []) if o.controller), None)


def _is_scaled_object(owner) -> bool:
    return owner is not None and owner.kind == "ScaledObject" and owner.api_version.startswith("keda.sh/")


def _clamped_by_min(hpa) -> bool | None:
    """Whether the HPA says its wish was raised to ``minReplicas`` (``ScalingLimited``); None if it says nothing."""
    limited = next((c for c in (hpa.status.conditions or []) if c.type == "ScalingLimited"), None)
    return None if limited is None else (limited.status == "True" and limited.reason == "TooFewReplicas")


def own_ask(desired: int, *, floor: int, base: int, clamped: bool | None) -> int:
    """The replicas an autoscaler wants on its own, from the wish it reports clamped to the floor prewarm set.

    ``desired`` above ``floor`` is the autoscaler's own wish. At the floor it may be clamped: the HPA says so
    in its ``ScalingLimited`` condition (reason ``TooFewReplicas``; ``clamped`` True or False), a Knative
    PodAutoscaler never does (``clamped`` None: taken as clamped). A clamped wish lies below the floor, by how
    much the API does not say; the autoscaler's own floor ``base`` bounds it from below, and is what is
    returned. A floor prewarm has not raised (``floor <= base``) is the autoscaler's own: its wish stands.
    """
    if desired > floor or floor <= base or clamped is False:
        return max(0, desired)
    return base


def label_value(value: str) -> str:
    """A valid label value for ``value`` (hash-suffixed when it must be shortened or cleaned)."""
    if _LABEL_OK.match(value):
        return value
    cleaned = re.sub(r"[^-A-Za-z0-9_.]", "-", value).strip("-_.")[:50].strip("-_.")
    return f"{cleaned}-{hashlib.sha256(value.encode()).hexdigest()[:10]}".strip("-")


def job_name(action: Action) -> str:
    return f"prewarm-pull-{hashlib.sha256(action.key.encode()).hexdigest()[:16]}"


def prepull_job_manifest(action: Action, *, namespace: str, deadline_s: float, now: datetime,
                         helper_image: str, ttl_s: int, model_label: str,
                         owner: dict | None = None, image_pull_secret: str | None = None) -> dict:
    """The Job that pulls ``action.target`` onto ``action.node_id`` (a plain dict, as the API receives it)."""
    labels = {"app.kubernetes.io/managed-by": MANAGED_BY, "app.kubernetes.io/component": "prepull",
              model_label: label_value(action.model_id), "prewarm.io/node": label_value(action.node_id or "")}
    volume_mount = [{"name": "prewarm-bin", "mountPath": "/prewarm"}]
    resources = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"cpu": "100m", "memory": "64Mi"}}
    security = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    pod_spec: dict = {
        "restartPolicy": "Never",
        "nodeSelector": {"kubernetes.io/hostname": action.node_id},
        "tolerations": [{"operator": "Exists"}],  # GPU nodes are usually tainted
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 0,
        "initContainers": [{"name": "copy-true", "image": helper_image, "imagePullPolicy": "IfNotPresent",
                            "command": ["cp", "/bin/busybox", "/prewarm/true"], "volumeMounts": volume_mount,
                            "resources": resources, "securityContext": security}],
        "containers": [{"name": "prepull", "image": action.target, "imagePullPolicy": "IfNotPresent",
                        "command": ["/prewarm/true"], "volumeMounts": volume_mount, "resources": resources,
                        "securityContext": security}],
        "volumes": [{"name": "prewarm-bin", "emptyDir": {"sizeLimit": "16Mi"}}],
    }
    if image_pull_secret:
        pod_spec["imagePullSecrets"] = [{"name": image_pull_secret}]
    metadata: dict = {
        "name": job_name(action), "namespace": namespace, "labels": labels,
        "annotations": {"prewarm.io/image": action.target or "", "prewarm.io/action-key": action.key,
                        "prewarm.io/reason": str(action.reason),
                        "prewarm.io/deadline": (now + timedelta(seconds=deadline_s)).isoformat()},
    }
    if owner:
        metadata["ownerReferences"] = [owner]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata,
        "spec": {
            "activeDeadlineSeconds": max(1, int(deadline_s)),
            "ttlSecondsAfterFinished": ttl_s,
            "backoffLimit": 0,  # the actuator retries temporary failures itself, with back-off
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


class HpaIndex:
    """Which HorizontalPodAutoscaler scales which Deployment, per namespace, from one LIST every ``ttl_s``.

    The scale path needs the HPA of one Deployment, twice per action (its floor and ask, then the patch), and an
    HPA cannot be selected by its ``scaleTargetRef`` on the server. Listing the namespace's HPAs for each lookup
    cost two LISTs per action: in a namespace of 1,000 models, about 2 MB and 90 ms of client deserialisation each
    (``bench/kube_actuation.py``), for every action of every plan. The map keeps only names (the HPA's spec and
    status are read fresh by the caller); a name that no longer resolves (deleted, or retargeted) makes the caller
    ask again with ``refresh=True``. An HPA created since the last listing is seen at the next one, at most
    ``ttl_s`` later; ``ttl_s = 0`` lists every time. Thread-safe: the actuator carries out actions in parallel,
    and one LIST per namespace serves them all.
    """

    def __init__(self, list_hpas: Callable[[str], list], *, ttl_s: float,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.list_hpas = list_hpas
        self.ttl_s = ttl_s
        self.monotonic = monotonic
        self.lists = 0  # LISTs made, for tests and the benchmark
        self._names: dict[str, tuple[float, dict[str, str]]] = {}
        self._lock = threading.Lock()

    def hpa_name(self, deployment: str, namespace: str, *, refresh: bool = False) -> str | None:
        """Name of the HPA whose target is Deployment ``deployment`` in ``namespace``, or None."""
        with self._lock:  # one LIST per namespace when many threads miss at once
            entry = self._names.get(namespace)
            if refresh or entry is None or self.monotonic() - entry[0] >= self.ttl_s:
                listed_at = self.monotonic()
                names: dict[str, str] = {}
                for hpa in self.list_hpas(namespace):
                    ref = hpa.spec.scale_target_ref
                    if ref.kind == "Deployment":
                        names.setdefault(ref.name, hpa.metadata.name)  # two HPAs on one target: the first listed
                self.lists += 1
                entry = self._names[namespace] = (listed_at, names)
            return entry[1].get(deployment)


class KubernetesBackend:
    """Carries out scale, release and pre-pull on a cluster.

    Args:
        api_client: a ``kubernetes.client.ApiClient`` (tests pass one whose transport is a fake API server).
        namespace: default namespace of workloads and Jobs.
        model_label: pod label naming the serving model.
        helper_image, job_ttl_s, job_wait_s, owner_deployment, image_pull_secret, hpa_index_ttl_s: see settings
            ``kubernetes_*``.
        clock: wall clock for Job deadline annotations and cleanup.
        sleep: how to wait between Job status polls.
    """

    name = "kubernetes"
    #: the action kinds it carries out (the others come back ``unsupported``)
    actions = frozenset((ActionKind.PREPULL, ActionKind.SCALE, ActionKind.RELEASE))

    def __init__(self, api_client, *, namespace: str = "default", model_label: str = "prewarm.io/model",
                 helper_image: str = "busybox:1.36", job_ttl_s: int = 600, job_wait_s: float = 300.0,
                 owner_deployment: str | None = None, image_pull_secret: str | None = None,
                 hpa_index_ttl_s: float = 60.0, coldstart_max_start_s: float = 10_800.0,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 sleep: Callable[[float], None] = time.sleep, poll_s: float = 2.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        from kubernetes import client

        self.api_client = api_client
        self.apps = client.AppsV1Api(api_client)
        self.autoscaling = client.AutoscalingV2Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.namespace = namespace
        self.model_label = model_label
        self.helper_image = helper_image
        self.job_ttl_s = job_ttl_s
        self.job_wait_s = job_wait_s
        self.owner_deployment = owner_deployment
        self.image_pull_secret = image_pull_secret
        self.coldstart_max_start_s = coldstart_max_start_s
        #: what the last :meth:`observe_cold_starts` left out, by reason (``dropped_long_start``)
        self.coldstart_drops: dict[str, int] = {}
        self.clock = clock
        self.sleep = sleep
        self.poll_s = poll_s
        self._owner: dict | None = None
        self.hpas = HpaIndex(lambda ns: self.autoscaling.list_namespaced_horizontal_pod_autoscaler(ns).items,
                             ttl_s=hpa_index_ttl_s, monotonic=monotonic)

    @classmethod
    def from_settings(cls, settings, api_client=None, **overrides) -> "KubernetesBackend":
        if api_client is None:
            from kubernetes import client, config

            if settings.kubernetes_kubeconfig is not None:
                config.load_kube_config(config_file=str(settings.kubernetes_kubeconfig))
            else:
                try:
                    config.load_incluster_config()
                except config.ConfigException:
                    config.load_kube_config()
            api_client = client.ApiClient()
        options = dict(namespace=settings.kubernetes_namespace, model_label=settings.kubernetes_model_label,
                       helper_image=settings.kubernetes_prepull_helper_image, job_ttl_s=settings.kubernetes_job_ttl_s,
                       job_wait_s=settings.kubernetes_job_wait_s,
                       owner_deployment=settings.kubernetes_owner_deployment,
                       image_pull_secret=settings.kubernetes_image_pull_secret,
                       hpa_index_ttl_s=settings.kubernetes_hpa_index_ttl_s,
                       coldstart_max_start_s=settings.kubernetes_coldstart_max_start_s)
        options.update(overrides)
        return cls(api_client, **options)

    # --- workloads ---------------------------------------------------------------------------------------------

    def _workload(self, model: ModelTarget) -> tuple[str, str, str]:
        kind = model.labels.get("k8s_kind", "Deployment")
        if kind not in ("Deployment", "InferenceService"):
            raise ValueError(f"model {model.model_id}: k8s_kind must be Deployment or InferenceService, got {kind!r}")
        return kind, model.labels.get("k8s_name", model.model_id), model.labels.get("k8s_namespace", self.namespace)

    def _hpa_for(self, name: str, namespace: str):
        """The HPA scaling Deployment ``name`` as it is now (a GET), or None; named by :class:`HpaIndex`."""
        from kubernetes.client.exceptions import ApiException

        for refresh in (False, True):
            hpa_name = self.hpas.hpa_name(name, namespace, refresh=refresh)
            if hpa_name is None:
                return None
            try:
                hpa = self.autoscaling.read_namespaced_horizontal_pod_autoscaler(hpa_name, namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                continue  # deleted since the listing
            ref = hpa.spec.scale_target_ref
            if ref.kind == "Deployment" and ref.name == name:
                return hpa
            # retargeted since the listing: list again
        return None

    def _scaled_object(self, name: str, namespace: str) -> dict:
        return self.custom.get_namespaced_custom_object(*KEDA_SCALED_OBJECT[:2], namespace, KEDA_SCALED_OBJECT[2],
                                                        name)

    def replica_state(self, model: ModelTarget) -> ReplicaState | None:
        kind, name, namespace = self._workload(model)
        if kind == "InferenceService":
            isvc = self.custom.get_namespaced_custom_object(*KSERVE[:2], namespace, KSERVE[2], name)
            floor = int(((isvc.get("spec") or {}).get("predictor") or {}).get("minReplicas") or 0)
            base = _base_min((isvc.get("metadata") or {}).get("annotations"), floor)
            pas = self.custom.list_namespaced_custom_object(
                *KNATIVE_PA[:2], namespace, KNATIVE_PA[2], label_selector=f"serving.kserve.io/inferenceservice={name}")
            if pas.get("items"):  # Serverless: Knative's PodAutoscalers, which never say their wish was clamped
                desired = max(int((pa.get("status") or {}).get("desiredScale") or 0) for pa in pas["items"])
                clamped = None
            else:  # RawDeployment: the HPA KServe made for the predictor's Deployment (or no autoscaler at all)
                hpa = next(filter(None, (self._hpa_for(f"{name}{suffix}", namespace)
                                         for suffix in KSERVE_RAW_PREDICTOR_SUFFIXES)), None)
                desired = 0 if hpa is None else int(hpa.status.desired_replicas or 0)
                clamped = None if hpa is None else _clamped_by_min(hpa)
            return ReplicaState(current=floor, reactive_ask=own_ask(desired, floor=floor, base=base, clamped=clamped),
                                floor_kind="min_replicas")
        hpa = self._hpa_for(name, namespace)
        if hpa is not None:
            floor, annotations = int(hpa.spec.min_replicas or 1), hpa.metadata.annotations
            owner = _controller(hpa)
            if _is_scaled_object(owner):  # KEDA keeps its HPA's floor at the ScaledObject's minReplicaCount
                scaled_object = self._scaled_object(owner.name, namespace)
                floor = int((scaled_object.get("spec") or {}).get("minReplicaCount") or 0)
                annotations = (scaled_object.get("metadata") or {}).get("annotations")
            ask = own_ask(int(hpa.status.desired_replicas or 0), floor=floor, base=_base_min(annotations, floor),
                          clamped=_clamped_by_min(hpa))
            return ReplicaState(current=floor, reactive_ask=ask, floor_kind="min_replicas")
        scale = self.apps.read_namespaced_deployment_scale(name, namespace)
        # No reactive autoscaler on this Deployment: nothing asks for a floor but the plan.
        return ReplicaState(current=int(scale.spec.replicas or 0), reactive_ask=0, floor_kind="replicas")

    def _set_replicas(self, model: ModelTarget, replicas: int) -> Outcome:
        from kubernetes.client.exceptions import ApiException

        kind, name, namespace = self._workload(model)
        try:
            if kind == "InferenceService":
                isvc = self.custom.get_namespaced_custom_object(*KSERVE[:2], namespace, KSERVE[2], name)
                predictor = (isvc.get("spec") or {}).get("predictor") or {}
                floor, base, body = _floor_patch(
                    replicas, own_min=int(predictor.get("minReplicas") or 0),
                    annotations=(isvc.get("metadata") or {}).get("annotations"),
                    ceiling=int(predictor.get("maxReplicas") or 0) or None,  # 0: no upper bound (KServe's default)
                    field="spec.predictor.minReplicas")
                self.custom.patch_namespaced_custom_object(*KSERVE[:2], namespace, KSERVE[2], name, body,
                                                           _content_type="application/merge-patch+json")
                return _floor_set("InferenceService", namespace, name, "spec.predictor.minReplicas", floor=floor,
                                  base=base, replicas=replicas)
            hpa = self._hpa_for(name, namespace)
            if hpa is not None:
                return self._set_hpa_floor(hpa, namespace, replicas)
            self.apps.patch_namespaced_deployment_scale(name, namespace, {"spec": {"replicas": replicas}})
            return Outcome.ok(f"Deployment {namespace}/{name} replicas -> {replicas}",
                              workload=f"Deployment/{namespace}/{name}", field="spec.replicas", replicas=replicas)
        except ApiException as exc:
            return _api_failure(exc, f"{kind} {namespace}/{name}")

    def _set_hpa_floor(self, hpa, namespace: str, replicas: int) -> Outcome:
        """Raise or restore an HPA's floor; where a controller writes the HPA's spec, set the floor it copies.

        KEDA rewrites its HPA from the ScaledObject on every reconcile (and an HPA change triggers one), so a
        patched ``minReplicas`` would be gone within seconds: the ScaledObject's ``minReplicaCount`` is set
        instead. Any other controller (KServe's raw deployments, an operator's own HPA) is refused, naming it.
        """
        owner = _controller(hpa)
        if _is_scaled_object(owner):
            scaled_object = self._scaled_object(owner.name, namespace)
            spec = scaled_object.get("spec") or {}
            floor, base, body = _floor_patch(
                replicas, own_min=int(spec.get("minReplicaCount") or 0),
                annotations=(scaled_object.get("metadata") or {}).get("annotations"),
                ceiling=int(spec.get("maxReplicaCount") or 100),  # KEDA's default maxReplicaCount
                field="spec.minReplicaCount")
            self.custom.patch_namespaced_custom_object(*KEDA_SCALED_OBJECT[:2], namespace, KEDA_SCALED_OBJECT[2],
                                                       owner.name, body, _content_type="application/merge-patch+json")
            return _floor_set("ScaledObject", namespace, owner.name, "spec.minReplicaCount", floor=floor, base=base,
                              replicas=replicas)
        if owner is not None:
            return Outcome.failed(
                FailureReason.UNSUPPORTED,
                f"HPA {namespace}/{hpa.metadata.name} is controlled by {owner.kind} {owner.name}, which would undo a "
                f"change to its minReplicas; set the floor on the {owner.kind} (an InferenceService: label the model "
                "k8s_kind=InferenceService) or leave the model to prewarm's autoscaler metrics",
                workload=f"HorizontalPodAutoscaler/{namespace}/{hpa.metadata.name}",
                controlled_by=f"{owner.kind}/{owner.name}")
        floor, base, body = _floor_patch(replicas, own_min=int(hpa.spec.min_replicas or 1),
                                         annotations=hpa.metadata.annotations, ceiling=int(hpa.spec.max_replicas),
                                         field="spec.minReplicas")
        self.autoscaling.patch_namespaced_horizontal_pod_autoscaler(hpa.metadata.name, namespace, body)
        return _floor_set("HorizontalPodAutoscaler", namespace, hpa.metadata.name, "spec.minReplicas", floor=floor,
                          base=base, replicas=replicas)

    # --- pre-pull Jobs -----------------------------------------------------------------------------------------

    def _owner_reference(self) -> dict | None:
        if self.owner_deployment is None:
            return None
        if self._owner is None:
            deployment = self.apps.read_namespaced_deployment(self.owner_deployment, self.namespace)
            self._owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment.metadata.name,
                           "uid": deployment.metadata.uid, "controller": False, "blockOwnerDeletion": False}
        return self._owner

    def prepull_job(self, action: Action, *, deadline_s: float) -> dict:
        return prepull_job_manifest(action, namespace=self.namespace, deadline_s=deadline_s, now=self.clock(),
                                    helper_image=self.helper_image, ttl_s=self.job_ttl_s,
                                    model_label=self.model_label, owner=self._owner_reference(),
                                    image_pull_secret=self.image_pull_secret)

    def _prepull(self, action: Action, deadline_s: float) -> Outcome:
        from kubernetes.client.exceptions import ApiException

        manifest = self.prepull_job(action, deadline_s=deadline_s)
        name = manifest["metadata"]["name"]
        created = True
        try:
            self.batch.create_namespaced_job(self.namespace, manifest)
        except ApiException as exc:
            if exc.status != 409:
                return _api_failure(exc, f"create Job {name}")
            created = False  # the same work is already a Job: follow it
        detail = {"job": f"{self.namespace}/{name}", "created": created}
        wait_until = time.monotonic() + min(self.job_wait_s, max(0.0, deadline_s))
        t0 = time.monotonic()
        while True:
            try:
                job = self.batch.read_namespaced_job_status(name, self.namespace)
            except ApiException as exc:
                return _api_failure(exc, f"read Job {name}", **detail)
            status = job.status
            if status is not None and (status.succeeded or 0) > 0:
                return Outcome.ok(f"Job {name} pulled {action.target} on {action.node_id}", **detail,
                                  waited_s=round(time.monotonic() - t0, 3))
            failed = next((c for c in (status.conditions or []) if c.type == "Failed" and c.status == "True"),
                          None) if status is not None else None
            pull_error = self._pull_error(name)
            if pull_error is not None:
                self._delete_job(name)
                reason, temporary, message = pull_error
                return Outcome.failed(reason, f"Job {name}: {message}", temporary=temporary, **detail)
            if failed is not None:
                if failed.reason == "DeadlineExceeded":
                    return Outcome.failed(FailureReason.TIMEOUT, f"Job {name} passed its deadline", temporary=True,
                                          **detail)
                return Outcome.failed(FailureReason.INTERNAL, f"Job {name} failed: {failed.reason} {failed.message}",
                                      **detail)
            if time.monotonic() >= wait_until:
                if self.job_wait_s == 0:
                    return Outcome.ok(f"Job {name} created; not awaited (kubernetes_job_wait_s = 0)", **detail)
                return Outcome.failed(FailureReason.TIMEOUT, f"Job {name} not done in time; it stops at its own "
                                      "deadline", temporary=True, **detail)
            self.sleep(self.poll_s)

    def _pull_error(self, job: str):
        """(reason, temporary, message) when the Job's pod cannot pull its image, else None."""
        from forecaster.contracts.actions import classify_pull_message

        pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"job-name={job}").items
        for pod in pods:
            for status in (pod.status.container_statuses or []) + (pod.status.init_container_statuses or []):
                waiting = status.state.waiting if status.state is not None else None
                if waiting is not None and waiting.reason in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName"):
                    message = waiting.message or waiting.reason
                    if waiting.reason == "InvalidImageName":
                        return FailureReason.NOT_FOUND, False, message
                    reason, temporary = classify_pull_message(message)
                    return reason, temporary, message
        return None

    def _delete_job(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.batch.delete_namespaced_job(name, self.namespace, propagation_policy="Background")
        except ApiException as exc:
            if exc.status != 404:
                raise

    def cleanup(self, *, now: datetime) -> list[str]:
        """Delete prewarm's pre-pull Jobs that finished or passed their deadline; returns their names."""
        removed = []
        jobs = self.batch.list_namespaced_job(self.namespace,
                                              label_selector=f"app.kubernetes.io/managed-by={MANAGED_BY}").items
        for job in jobs:
            annotations = job.metadata.annotations or {}
            deadline = annotations.get("prewarm.io/deadline")
            finished = job.status is not None and ((job.status.succeeded or 0) > 0 or (job.status.failed or 0) > 0)
            expired = deadline is not None and datetime.fromisoformat(deadline) < now
            if finished or expired:
                self._delete_job(job.metadata.name)
                removed.append(job.metadata.name)
        return removed

    # --- the backend protocol ------------------------------------------------------------------------------------

    def carry_out(self, action: Action, *, model: ModelTarget, replicas: int | None, deadline_s: float) -> Outcome:
        if action.kind in (ActionKind.SCALE, ActionKind.RELEASE):
            if replicas is None:
                return Outcome.failed(FailureReason.INTERNAL, "no bounded replica target")
            return self._set_replicas(model, replicas)
        if action.kind is ActionKind.PREPULL:
            return self._prepull(action, deadline_s)
        return unsupported(self.name, action)

    # --- cold starts observed in the cluster ---------------------------------------------------------------------

    def observe_cold_starts(self, *, since: datetime | None = None) -> list[dict]:
        """Cold starts of the listed model replicas from pod status and kubelet events (see :mod:`..kube_coldstarts`).

        ``since``: pods that became Ready before it are left out (the collector's watermark). Only listed pods
        count: the events of a pod not in the list (deleted, or not a model's) are never a cold start of their own.
        Only pods created at or after ``since`` (on the first run, the clock's now) less ``coldstart_max_start_s``
        count, so a later Ready transition (a readiness probe that failed and recovered) is never taken as the start.
        The pods left out for a creation -> Ready longer than that are counted in :attr:`coldstart_drops`
        (``dropped_long_start``), which the ``coldstarts`` job reports.
        """
        from forecaster.actuation.kube_coldstarts import cold_starts_from_k8s

        pods = self.core.list_namespaced_pod(self.namespace, label_selector=self.model_label).items
        events = self.core.list_namespaced_event(self.namespace, field_selector="involvedObject.kind=Pod").items
        serialise = self.api_client.sanitize_for_serialization
        dropped: dict = {}
        found = cold_starts_from_k8s([serialise(p) for p in pods], [serialise(e) for e in events],
                                     model_label=self.model_label, since=since, now=self.clock(),
                                     max_start_s=self.coldstart_max_start_s, dropped=dropped)
        self.coldstart_drops = dropped
        return found


def _api_failure(exc, what: str, **detail) -> Outcome:
    status = getattr(exc, "status", None)
    text = f"{what}: HTTP {status} {getattr(exc, 'reason', '')}".strip()
    if status == 404:
        return Outcome.failed(FailureReason.NOT_FOUND, text, **detail)
    if status in (401, 403):
        return Outcome.failed(FailureReason.UNAUTHORISED, text, **detail)
    if status in (409, 429) or (status or 0) >= 500 or status is None or status == 0:
        return Outcome.failed(FailureReason.INTERNAL, text, temporary=True, **detail)
    return Outcome.failed(FailureReason.INTERNAL, text, **detail)
