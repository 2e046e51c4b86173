"""A fake Kubernetes API server behind the real ``kubernetes`` client, for the Kubernetes backend's tests.

:class:`FakeKubeApi` replaces the client's REST transport (``ApiClient.rest_client``): everything above it
(the generated API classes, serialisation, deserialisation into models, ``ApiException``) is the real
client. It keeps objects in memory, answers GET/LIST (label and field selectors), POST (409 when the
name exists), PATCH (JSON merge patch; strategic merge refused for custom resources with 415, as a real
server does) and DELETE, and serves the ``/scale`` subresource of Deployments.

Every object written (created, or the result of a patch) is validated against the real Kubernetes schemas
with ``kubernetes-validate`` in strict mode; a custom resource is checked against the small structural
schema below. An invalid object fails the request with 422 and is kept in ``invalid`` for the test to see.

A ``kubelet`` hook may change a Job when it is created (complete it, or give its pod an image pull error).
:meth:`FakeKubeApi.sync_hpa` and :meth:`FakeKubeApi.sync_pod_autoscaler` play the autoscalers' controllers: the
metrics' wish clamped to the floor and ceiling, in the status fields and conditions the real controllers write;
:meth:`FakeKubeApi.sync_keda` and :meth:`FakeKubeApi.sync_kserve_raw` play KEDA's operator and KServe's
RawDeployment controller rewriting the HPA they own from their own object.

:meth:`FakeKubeApi.rbac_calls` names every request in RBAC's terms, (API group, resource[/subresource], verb),
so a test can hold the shipped Role to exactly the calls the code makes (``tests/test_deploy.py``).
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from urllib.parse import parse_qs, urlparse

KUBERNETES_VERSION = "1.30.0"
_PATH = re.compile(r"^/(?P<prefix>api/v1|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
                   r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$")
KINDS = {"deployments": "Deployment", "jobs": "Job", "pods": "Pod", "events": "Event",
         "horizontalpodautoscalers": "HorizontalPodAutoscaler", "inferenceservices": "InferenceService",
         "podautoscalers": "PodAutoscaler", "scaledobjects": "ScaledObject"}
CUSTOM_GROUPS = {"serving.kserve.io", "autoscaling.internal.knative.dev", "keda.sh"}


def validate_manifest(obj: dict) -> None:
    """Strict validation against the real schemas (built-in kinds) or the structural check (custom kinds)."""
    import kubernetes_validate

    if obj.get("kind") == "InferenceService":
        _check_isvc(obj)
        return
    if obj.get("kind") == "PodAutoscaler":
        return
    if obj.get("kind") == "ScaledObject":
        _check_scaled_object(obj)
        return
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def _check_isvc(obj: dict) -> None:
    """KServe's CRD schema is not in kubernetes-validate: check the parts prewarm writes."""
    if obj.get("apiVersion") != "serving.kserve.io/v1beta1":
        raise ValueError(f"InferenceService apiVersion {obj.get('apiVersion')!r}")
    spec = obj.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("predictor"), dict):
        raise ValueError("InferenceService needs spec.predictor")
    allowed_top = {"predictor", "transformer", "explainer"}
    if set(spec) - allowed_top:
        raise ValueError(f"unknown InferenceService spec fields {sorted(set(spec) - allowed_top)}")
    for key in ("minReplicas", "maxReplicas"):
        value = spec["predictor"].get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"spec.predictor.{key} must be a non-negative integer, got {value!r}")


def _check_scaled_object(obj: dict) -> None:
    """KEDA's CRD schema is not in kubernetes-validate: check the parts prewarm writes and reads."""
    if obj.get("apiVersion") != "keda.sh/v1alpha1":
        raise ValueError(f"ScaledObject apiVersion {obj.get('apiVersion')!r}")
    spec = obj.get("spec")
    if not isinstance(spec, dict) or not (spec.get("scaleTargetRef") or {}).get("name"):
        raise ValueError("ScaledObject needs spec.scaleTargetRef.name")
    for key in ("minReplicaCount", "maxReplicaCount"):
        value = spec.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"spec.{key} must be a non-negative integer, got {value!r}")


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _matches(obj: dict, label_selector: str | None, field_selector: str | None) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (label_selector or "").split(",")):
        if "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key.rstrip("=")) != value:
                return False
        elif term not in labels:
            return False
    for term in filter(None, (field_selector or "").split(",")):
        key, value = term.split("=", 1)
        node = obj
        for part in key.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        if node != value:
            return False
    return True


class _Response:
    def __init__(self, status: int, body: object) -> None:
        self.status = status
        self.reason = {200: "OK", 201: "Created", 404: "Not Found", 409: "Conflict", 415: "Unsupported Media Type",
                       422: "Unprocessable Entity"}.get(status, "")
        self.data = json.dumps(body).encode()
        self.headers = {"content-type": "application/json"}
        self.response = self

    def read(self):
        return self.data

    def getheaders(self):
        return self.headers

    def getheader(self, name, default=None):
        return self.headers.get(name.lower(), default)


class FakeKubeApi:
    """In-memory API server; install with :meth:`client`."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str, str], dict] = {}  # (prefix, namespace, resource, name)
        self.requests: list[tuple[str, str, object]] = []
        self.written: list[dict] = []  # every object stored, after validation
        self.invalid: list[tuple[dict, str]] = []
        self.kubelet: Callable[[dict, "FakeKubeApi"], None] | None = None

    def client(self):
        from kubernetes import client

        configuration = client.Configuration(host="https://fake-kube.invalid")
        api_client = client.ApiClient(configuration)
        api_client.rest_client = self
        return api_client

    # --- seeding -------------------------------------------------------------------------------------------------

    def put(self, obj: dict, *, prefix: str | None = None, resource: str | None = None) -> dict:
        """Store ``obj`` as a server would have it (validated, with uid and timestamps)."""
        kind = obj["kind"]
        resource = resource or next(r for r, k in KINDS.items() if k == kind)
        api_version = obj["apiVersion"]
        prefix = prefix or ("api/v1" if api_version == "v1" else f"apis/{api_version}")
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta["resourceVersion"] = str(len(self.written) + 1)
        validate_manifest(obj)
        self.objects[(prefix, meta["namespace"], resource, meta["name"])] = obj
        self.written.append(copy.deepcopy(obj))
        return obj

    def get(self, kind: str, name: str, namespace: str = "default") -> dict | None:
        resource = next(r for r, k in KINDS.items() if k == kind)
        for (_, ns, res, n), obj in self.objects.items():
            if (ns, res, n) == (namespace, resource, name):
                return obj
        return None

    # --- the transport -------------------------------------------------------------------------------------------

    def request(self, method, url, headers=None, body=None, post_params=None, _request_timeout=None):
        parsed = urlparse(url)
        query = {k: v[0] for k, v in parse_qs(parsed.query).items()}
        self.requests.append((method, parsed.path, body))
        match = _PATH.match(parsed.path)
        if match is None:
            return _Response(404, {"kind": "Status", "code": 404, "message": f"no route {parsed.path}"})
        prefix, ns, resource, name, sub = (match["prefix"], match["ns"] or "default", match["resource"],
                                           match["name"], match["sub"])
        key = (prefix, ns, resource, name)
        if method == "GET" and name is None:
            items = [o for (p, n, r, _), o in self.objects.items() if (p, n, r) == (prefix, ns, resource)
                     and _matches(o, query.get("labelSelector"), query.get("fieldSelector"))]
            list_kind = KINDS.get(resource, "Object") + "List"
            return _Response(200, {"apiVersion": prefix.split("/", 1)[-1] if prefix != "api/v1" else "v1",
                                   "kind": list_kind, "metadata": {}, "items": copy.deepcopy(items)})
        if method == "POST":
            obj = copy.deepcopy(body)
            obj.setdefault("metadata", {}).setdefault("namespace", ns)
            if (prefix, ns, resource, obj["metadata"]["name"]) in self.objects:
                return _Response(409, {"kind": "Status", "code": 409, "reason": "AlreadyExists",
                                       "message": f"{resource} {obj['metadata']['name']} already exists"})
            try:
                self.put(obj, prefix=prefix, resource=resource)
            except Exception as exc:  # noqa: BLE001 - an invalid manifest is the test's failure
                self.invalid.append((obj, str(exc).splitlines()[0]))
                return _Response(422, {"kind": "Status", "code": 422, "message": str(exc).splitlines()[0]})
            if resource == "jobs" and self.kubelet is not None:
                self.kubelet(obj, self)
            return _Response(201, obj)
        current = self.objects.get(key)
        if current is None:
            return _Response(404, {"kind": "Status", "code": 404, "reason": "NotFound",
                                   "message": f"{resource} {name} not found"})
        if method == "GET":
            if sub == "scale":
                return _Response(200, self._scale(current))
            return _Response(200, copy.deepcopy(current))
        if method == "PATCH":
            content_type = (headers or {}).get("Content-Type", "")
            if match["group"] in CUSTOM_GROUPS and "strategic" in content_type:
                return _Response(415, {"kind": "Status", "code": 415,
                                       "message": "strategic merge patch is not supported for custom resources"})
            if sub == "scale":
                replicas = (body or {}).get("spec", {}).get("replicas")
                patched = merge_patch(current, {"spec": {"replicas": replicas}})
            else:
                patched = merge_patch(current, body)
            try:
                self.put(patched, prefix=prefix, resource=resource)
            except Exception as exc:  # noqa: BLE001
                self.invalid.append((patched, str(exc).splitlines()[0]))
                return _Response(422, {"kind": "Status", "code": 422, "message": str(exc).splitlines()[0]})
            return _Response(200, self._scale(patched) if sub == "scale" else copy.deepcopy(patched))
        if method == "DELETE":
            del self.objects[key]
            if resource == "jobs":  # background propagation: the Job's pods go too
                for other in [k for k, o in self.objects.items() if k[2] == "pods"
                              and ((o.get("metadata") or {}).get("labels") or {}).get("job-name") == name]:
                    del self.objects[other]
            return _Response(200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}})
        return _Response(405, {"kind": "Status", "code": 405, "message": method})

    # --- the autoscalers' controllers ----------------------------------------------------------------------------

    def sync_hpa(self, name: str, wants: int, namespace: str = "default") -> dict:
        """One sync of kube-controller-manager's HPA controller whose metrics ask for ``wants`` replicas.

        As the real controller: ``status.desiredReplicas`` is the wish clamped to [minReplicas, maxReplicas]
        (``normalizeDesiredReplicas``), the ``ScalingLimited`` condition says which bound held it
        (``TooFewReplicas``, ``TooManyReplicas``, else False / ``DesiredWithinRange``), and the Deployment's
        replicas are set to it.
        """
        hpa = copy.deepcopy(self.get("HorizontalPodAutoscaler", name, namespace))
        low, high = int(hpa["spec"].get("minReplicas", 1)), int(hpa["spec"]["maxReplicas"])
        desired = min(max(wants, low), high)
        reason = "TooFewReplicas" if wants < low else "TooManyReplicas" if wants > high else "DesiredWithinRange"
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        hpa["status"] = {"currentReplicas": desired, "desiredReplicas": desired, "conditions": [
            {"type": "AbleToScale", "status": "True", "reason": "ReadyForNewScale", "lastTransitionTime": now,
             "message": "recommended size matches current size"},
            {"type": "ScalingLimited", "status": "False" if reason == "DesiredWithinRange" else "True",
             "reason": reason, "lastTransitionTime": now, "message": f"the metrics ask for {wants}"}]}
        self.put(hpa)
        target = self.get("Deployment", hpa["spec"]["scaleTargetRef"]["name"], namespace)
        if target is not None:
            self.put(merge_patch(target, {"spec": {"replicas": desired}}))
        return hpa

    def sync_keda(self, scaled_object: str, namespace: str = "default") -> dict:
        """One reconcile of KEDA's operator: its HPA's spec rewritten from the ScaledObject (``updateHPAIfNeeded``:
        ``minReplicas`` = ``minReplicaCount``, at least 1; ``maxReplicas`` = ``maxReplicaCount``, 100 by default),
        undoing any other change to it."""
        spec = self.get("ScaledObject", scaled_object, namespace)["spec"]
        return self._copy_bounds(f"keda-hpa-{scaled_object}", namespace, int(spec.get("minReplicaCount") or 0),
                                 int(spec.get("maxReplicaCount") or 100))

    def sync_kserve_raw(self, isvc: str, namespace: str = "default") -> dict:
        """One reconcile of KServe's controller in RawDeployment mode: the predictor's HPA (``<isvc>-predictor``)
        gets the InferenceService's minReplicas (at least 1) and maxReplicas."""
        predictor = self.get("InferenceService", isvc, namespace)["spec"]["predictor"]
        return self._copy_bounds(f"{isvc}-predictor", namespace, int(predictor.get("minReplicas") or 0),
                                 int(predictor.get("maxReplicas") or 8))

    def _copy_bounds(self, hpa_name: str, namespace: str, low: int, high: int) -> dict:
        """A controller that owns an HPA writing its bounds from its own object (an HPA's floor is at least 1)."""
        hpa = self.get("HorizontalPodAutoscaler", hpa_name, namespace)
        return self.put(merge_patch(hpa, {"spec": {"minReplicas": max(1, low), "maxReplicas": high}}))

    def sync_pod_autoscaler(self, isvc: str, wants: int, namespace: str = "default") -> dict:
        """One decision of Knative's KPA for ``isvc`` whose metrics ask for ``wants`` replicas.

        As the real scaler (``applyBounds`` before ``status.desiredScale`` is written): the wish bounded by the
        revision's min and max scale, which KServe sets from the predictor's minReplicas and maxReplicas.
        """
        predictor = self.get("InferenceService", isvc, namespace)["spec"]["predictor"]
        desired = max(wants, int(predictor.get("minReplicas") or 0))
        if int(predictor.get("maxReplicas") or 0) > 0:
            desired = min(desired, int(predictor["maxReplicas"]))
        pa = next(o for (_, ns, r, _), o in self.objects.items() if (ns, r) == (namespace, "podautoscalers")
                  and o["metadata"]["labels"].get("serving.kserve.io/inferenceservice") == isvc)
        pa = merge_patch(pa, {"status": {"desiredScale": desired, "actualScale": desired}})
        self.put(pa)
        return pa

    def rbac_calls(self) -> set[tuple[str, str, str]]:
        """(apiGroup, resource, verb) of every request seen, as an RBAC rule names it ("" = the core group)."""
        verbs = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}
        seen = set()
        for method, path, _ in self.requests:
            match = _PATH.match(path)
            if match is None:
                raise AssertionError(f"request to an unknown path {path}")
            resource = match["resource"] + (f"/{match['sub']}" if match["sub"] else "")
            verb = ("get" if match["name"] else "list") if method == "GET" else verbs[method]
            seen.add((match["group"] or "", resource, verb))
        return seen

    @staticmethod
    def _scale(deployment: dict) -> dict:
        meta = deployment["metadata"]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                "spec": {"replicas": deployment["spec"].get("replicas", 1)},
                "status": {"replicas": deployment.get("status", {}).get("replicas", 0)}}


def deployment(name: str, replicas: int = 1, *, image: str = "vllm/vllm-openai:v0.6.0") -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "default"},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "server", "image": image}]}}}}


def hpa(name: str, target: str, *, min_replicas: int, max_replicas: int, desired: int) -> dict:
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
                     "minReplicas": min_replicas, "maxReplicas": max_replicas,
                     "metrics": [{"type": "Resource", "resource": {
                         "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}]},
            "status": {"currentReplicas": desired, "desiredReplicas": desired}}


def scaled_object(name: str, target: str, *, min_replica_count: int = 0,
                  max_replica_count: int = 8) -> tuple[dict, dict]:
    """A KEDA ScaledObject and the HPA KEDA made for it (``keda-hpa-<name>``, owned and controlled by it)."""
    obj = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
           "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4())},
           "spec": {"scaleTargetRef": {"name": target}, "minReplicaCount": min_replica_count,
                    "maxReplicaCount": max_replica_count,
                    "triggers": [{"type": "prometheus", "metadata": {"query": "sum(rate(requests[1m]))"}}]}}
    made = hpa(f"keda-hpa-{name}", target, min_replicas=max(1, min_replica_count), max_replicas=max_replica_count,
               desired=max(1, min_replica_count))
    made["metadata"]["labels"] = {"app.kubernetes.io/managed-by": "keda-operator"}
    made["metadata"]["ownerReferences"] = [{"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "name": name,
                                            "uid": obj["metadata"]["uid"], "controller": True,
                                            "blockOwnerDeletion": True}]
    return obj, made


def inference_service(name: str, *, min_replicas: int = 0) -> dict:
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"predictor": {"minReplicas": min_replicas, "maxReplicas": 8,
                                   "model": {"modelFormat": {"name": "huggingface"}}}}}


def pod_autoscaler(isvc: str, desired: int) -> dict:
    return {"apiVersion": "autoscaling.internal.knative.dev/v1alpha1", "kind": "PodAutoscaler",
            "metadata": {"name": f"{isvc}-predictor-00001", "namespace": "default",
                         "labels": {"serving.kserve.io/inferenceservice": isvc}},
            "spec": {}, "status": {"desiredScale": desired, "actualScale": desired}}


def complete_jobs(job: dict, api: FakeKubeApi) -> None:
    """A kubelet that pulls every image: the Job succeeds at once."""
    job["status"] = {"succeeded": 1, "completionTime": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def fail_pulls(message: str) -> Callable[[dict, FakeKubeApi], None]:
    """A kubelet whose pull of the Job's image fails with ``message`` (ErrImagePull)."""

    def kubelet(job: dict, api: FakeKubeApi) -> None:
        name = job["metadata"]["name"]
        template = job["spec"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{name}-abcde", "namespace": "default",
                            "labels": {**template["metadata"]["labels"], "job-name": name}},
               "spec": template["spec"],
               "status": {"phase": "Pending", "containerStatuses": [{
                   "name": "prepull", "image": template["spec"]["containers"][0]["image"], "imageID": "",
                   "ready": False, "restartCount": 0,
                   "state": {"waiting": {"reason": "ErrImagePull", "message": message}}}]}}
        api.put(pod)

    return kubelet


def ready_pod(name: str, model: str, node: str, created: str, started: str, ready: str) -> dict:
    """A model server's pod, ready: created, its container started, then Ready (times in ISO 8601)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": {"prewarm.io/model": model},
                         "creationTimestamp": created},
            "spec": {"nodeName": node, "containers": [{"name": "server", "image": "vllm/vllm-openai:v0.6.0"}]},
            "status": {"phase": "Running",
                       "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": created},
                                      {"type": "Ready", "status": "True", "lastTransitionTime": ready}],
                       "containerStatuses": [{"name": "server", "image": "vllm/vllm-openai:v0.6.0", "imageID": "",
                                              "ready": True, "restartCount": 0,
                                              "state": {"running": {"startedAt": started}}}]}}


def kubelet_event(pod: str, reason: str, message: str, when: str, node: str = "gpu-node-1", *,
                  uid: str | None = None, field_path: str | None = None) -> dict:
    """An event about ``pod`` as kubelet records it.

    ``uid``: the pod's ``metadata.uid`` (kubelet always sets it; the older tests leave it out, as an exported
    file edited by hand may); ``field_path``: the container it is about, ``spec.containers{server}`` or
    ``spec.initContainers{storage-initializer}`` (kubelet sets it on every container event: Pulling, Pulled,
    Created, Started).
    """
    involved = {"kind": "Pod", "name": pod, "namespace": "default", "apiVersion": "v1"}
    if uid is not None:
        involved["uid"] = uid
    if field_path is not None:
        involved["fieldPath"] = field_path
    return {"apiVersion": "v1", "kind": "Event",  # named as kubelet names them: the pod and a unique hex suffix
            "metadata": {"name": f"{pod}.{uuid.uuid4().hex[:16]}", "namespace": "default"},
            "involvedObject": involved,
            "reason": reason, "message": message, "firstTimestamp": when, "lastTimestamp": when,
            "source": {"component": "kubelet", "host": node}, "type": "Normal"}
