"""Cold starts of new replicas from Kubernetes pod status and kubelet events.

For each pod of a serving model (pods carry the model label):

* ``started_at`` = the pod's creation; ``total_seconds`` = creation -> ``Ready`` condition;
* ``image_pull_s`` from the kubelet's ``Pulled`` event of the serving container,
  ``Successfully pulled image "x" in 3.2s (3.5s including waiting)`` (the first figure), or 0 with
  ``cache_state = "image"`` for ``Container image "x" already present on machine``;
* ``weight_load_s`` = the serving container's start -> ``Ready``: the server loading weights and initialising its
  runtime, which pod status cannot tell apart (recorded as the load phase, the larger part for LLM servers).

The serving container is the one the ``kubectl.kubernetes.io/default-container`` annotation names, else the pod's
first container. Its ``Pulled`` event is the one whose ``involvedObject.fieldPath`` is ``spec.containers{name}``
(an event without a field path: whose image is the container's), of the same pod (``involvedObject.uid``; by name
only for an event without a uid), at or after the pod's creation: never an init container's (KServe's
``storage-initializer``), a sidecar's, or the pull of an earlier pod of the same name (a recreated StatefulSet
replica). A pull longer than the whole cold start is dropped.

Ready's ``lastTransitionTime`` is the *latest* transition: a readiness probe that fails and recovers moves it
(``restartCount`` stays 0), and a pod created at 06:00, first Ready at 06:01:30 and flapped at 11:30 reads as a
19,800 s start. The pod status keeps no earlier transition, so only pods created at or after the watermark (on the
first run, now) less ``max_start_s`` (the longest plausible cold start, ``PREWARM_KUBERNETES_COLDSTART_MAX_START_S``)
count, and a creation -> Ready longer than ``max_start_s`` is dropped: a flap after that window is never taken as the
start. Pods whose first Ready fell in a collector outage longer than the window are lost, not misread. A flap within
the window of a pod's creation is still read as its start (nothing in the pod status tells it apart).

A pod whose containers restarted (``restartCount > 0`` or a ``lastState.terminated``) is left out: its ``Ready``
time and its container's start are those of the last restart, not of the cold start. So are prewarm's own pre-pull
Job pods (they carry the model label too).

Pods may come from the API or from an exported JSON file (``kubectl get pods,events -o json``: a ``List``
of Pods and Events, or an ``EventList`` alone). With ``pods_from_events=True`` (an exported file only) a pod known
from its events alone counts from its ``Scheduled`` event to its ``Started`` event, and its model is the workload
name in the pod name (``<name>-<rs hash>-<pod hash>``, KServe ``<name>-predictor-...``). The live collector never
does this: there a pod missing from the list is deleted, not a model's, or not ours, and its events say nothing
true about a stored cold start.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

log = logging.getLogger(__name__)

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PULLED = re.compile(r'Successfully pulled image "[^"]*" in ([0-9.a-zµ]+)')
_IMAGE = re.compile(r'image "([^"]*)"')
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_PRESENT = re.compile(r"already present on machine")
#: The annotation naming a pod's main container (``kubectl logs`` and ``exec`` use it too).
DEFAULT_CONTAINER_ANNOTATION = "kubectl.kubernetes.io/default-container"
#: Labels of prewarm's own pre-pull Job pods (see ``prepull_job_manifest``), and their names' prefix.
_PREPULL_LABELS = {"app.kubernetes.io/managed-by": "prewarm", "app.kubernetes.io/component": "prepull"}
_PREPULL_POD_PREFIX = "prewarm-pull-"


def parse_go_duration(text: str) -> float | None:
    """Seconds in a Go duration string (``1m2.5s``, ``812ms``, ``3.2s``); None if it is not one."""
    text = text.strip()
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def _event_id(uid: str | None, name: str) -> str:
    """The cold start's ``event_id``: the pod's uid (two replicas created on one node in the same second are two
    starts, though Kubernetes stamps creation in whole seconds), or its name where the uid is unknown."""
    return uid if uid else f"pod/{name}"


def _time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _event_time(event: dict) -> datetime | None:
    return _time(event.get("eventTime") or event.get("firstTimestamp") or event.get("lastTimestamp")
                 or (event.get("metadata") or {}).get("creationTimestamp"))


def _involved(event: dict) -> dict:
    return event.get("involvedObject") or event.get("regarding") or {}


def workload_of_pod(pod_name: str) -> str:
    """The Deployment (or KServe InferenceService) a pod belongs to, from its generated name."""
    name = re.sub(r"-predictor(-default)?(-\d{5})?(-deployment)?(-[a-z0-9]{5,10})?-[a-z0-9]{5}$", "", pod_name)
    if name != pod_name:
        return name
    return re.sub(r"-[a-z0-9]{6,10}-[a-z0-9]{5}$", "", pod_name)


def _pull_from_events(events: list[dict]) -> tuple[float | None, str | None]:
    """Pull seconds and cache state from the first ``Pulled`` event of ``events`` (sorted by time) that says."""
    for event in events:
        if event.get("reason") != "Pulled":
            continue
        message = event.get("message") or ""
        match = _PULLED.search(message)
        if match:
            seconds = parse_go_duration(match.group(1))
            if seconds is not None:
                return seconds, "none"
        if _PRESENT.search(message):
            return 0.0, "image"
    return None, None


def _serving_container(pod: dict) -> tuple[str | None, set[str]]:
    """Name and images (spec and status) of the pod's serving container: the annotated default, else the first."""
    containers = (pod.get("spec") or {}).get("containers") or []
    names = [c.get("name") for c in containers]
    wanted = ((pod.get("metadata") or {}).get("annotations") or {}).get(DEFAULT_CONTAINER_ANNOTATION)
    name = wanted if wanted in names else (names[0] if names else None)
    images = {c.get("image") for c in containers if c.get("name") == name}
    images |= {s.get("image") for s in (pod.get("status") or {}).get("containerStatuses") or []
               if s.get("name") == name}
    return name, {i for i in images if i}


def _serving_pulls(events: list[dict], *, container: str | None, images: set[str], created: datetime) -> list[dict]:
    """The ``Pulled`` events of the serving container of the pod created at ``created``, oldest first."""
    wanted_path = f"spec.containers{{{container}}}"
    chosen = []
    for event in events:
        if event.get("reason") != "Pulled":
            continue
        when = _event_time(event)
        if when is None or when < created:
            continue  # an earlier pod of the same name, or an event without a time
        field_path = _involved(event).get("fieldPath")
        if field_path:
            if field_path != wanted_path:
                continue  # an init container or a sidecar
        else:
            image = _IMAGE.search(event.get("message") or "")
            if image is None or image.group(1) not in images:
                continue
        chosen.append(event)
    return chosen


def _restarted(status: dict) -> bool:
    """Whether a container of the pod restarted: its Ready time and start are then the restart's."""
    return any((s.get("restartCount") or 0) > 0 or ((s.get("lastState") or {}).get("terminated") is not None)
               for s in status.get("containerStatuses") or [])


def _is_prepull(meta: dict) -> bool:
    labels = meta.get("labels") or {}
    return all(labels.get(k) == v for k, v in _PREPULL_LABELS.items())


def cold_starts_from_k8s(pods: list[dict], events: list[dict], *, model_label: str = "prewarm.io/model",
                         since: datetime | None = None, model_by_workload: dict[str, str] | None = None,
                         pods_from_events: bool = False, now: datetime | None = None,
                         max_start_s: float | None = None, dropped: dict | None = None) -> list[dict]:
    """Cold-start events (the ``cold_starts`` push schema) from pods (camelCase JSON) and events.

    Pods not yet ready, that became ready before ``since``, whose containers restarted, or that are prewarm's
    pre-pull Job pods, are left out.

    Args:
        since: the Ready time from which pods count (the collector's watermark): a pod that was ready before it
            was seen by an earlier run; one created earlier and ready since still counts.
        pods_from_events: also count pods known only from their events (an exported events file, see the module
            docstring); never for the live API.
        now, max_start_s: with ``max_start_s``, only pods created at or after ``since`` (None: ``now``; both
            None: no bound) less ``max_start_s`` count, and none whose creation -> Ready exceeds it (see the module
            docstring: Ready's transition time moves when a readiness probe flaps).
        dropped: where given, ``dropped["dropped_long_start"]`` is set to the number of ready pods left out because
            Ready came more than ``max_start_s`` after their creation (a start longer than the window, which is
            not learned, or a readiness flap of an older pod: the two cannot be told apart here).
    """
    created_after = None
    if max_start_s is not None and (since is not None or now is not None):
        created_after = (since if since is not None else now) - timedelta(seconds=max_start_s)
    by_object: dict[tuple[str, str], list[dict]] = {}  # ("uid", uid), or ("name", name) for events without a uid
    for event in events:
        involved = _involved(event)
        if involved.get("kind", "Pod") != "Pod" or not involved.get("name"):
            continue
        key = ("uid", involved["uid"]) if involved.get("uid") else ("name", involved["name"])
        by_object.setdefault(key, []).append(event)
    for items in by_object.values():
        items.sort(key=lambda e: (_event_time(e) is None, _event_time(e) or _EPOCH))
    found = []
    seen_names: set[str] = set()
    seen_uids: set[str] = set()
    restarted = stale = 0
    for pod in pods:
        meta = pod.get("metadata") or {}
        name = meta.get("name")
        # Every listed pod is known, whatever is left out below: its events never count as a pod of their own.
        if name:
            seen_names.add(name)
        if meta.get("uid"):
            seen_uids.add(meta["uid"])
        model = (meta.get("labels") or {}).get(model_label)
        created = _time(meta.get("creationTimestamp"))
        node = (pod.get("spec") or {}).get("nodeName")
        if not (name and model and created and node) or _is_prepull(meta):
            continue
        status = pod.get("status") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        ready = conditions.get("Ready")
        if not ready or ready.get("status") != "True":
            continue
        ready_at = _time(ready.get("lastTransitionTime"))
        if ready_at is None or ready_at < created or (since is not None and ready_at < since):
            continue
        if max_start_s is not None and ((created_after is not None and created < created_after)
                                        or (ready_at - created).total_seconds() > max_start_s):
            stale += 1
            continue
        if _restarted(status):
            restarted += 1
            continue
        container, images = _serving_container(pod)
        own_events = by_object.get(("uid", meta.get("uid")), []) if meta.get("uid") else []
        own_events = sorted(own_events + by_object.get(("name", name), []),
                            key=lambda e: (_event_time(e) is None, _event_time(e) or _EPOCH))
        total_s = (ready_at - created).total_seconds()
        pull_s, cache_state = _pull_from_events(_serving_pulls(own_events, container=container, images=images,
                                                               created=created))
        row = {"model_id": model, "node_id": node, "started_at": created.isoformat(),
               "total_seconds": round(total_s, 3), "event_id": _event_id(meta.get("uid"), name)}
        if pull_s is not None and pull_s <= total_s:
            row["image_pull_s"] = round(pull_s, 3)
            row["cache_state"] = cache_state
        started = next((_time(((s.get("state") or {}).get("running") or {}).get("startedAt"))
                        for s in status.get("containerStatuses") or [] if s.get("name") == container), None)
        if started is not None and started <= ready_at:
            row["weight_load_s"] = round((ready_at - started).total_seconds(), 3)
        found.append(row)
    if restarted:
        log.info("%d ready model pods left out: their containers restarted, so their Ready time is not the cold "
                 "start's", restarted)
    if stale:
        log.warning("%d ready model pods left out: Ready more than %.0f s (PREWARM_KUBERNETES_COLDSTART_MAX_START_S) "
                    "after creation. Their Ready time need not be their first (a readiness flap), so they are not "
                    "stored; a start really that long is not learned: raise the setting if starts take longer",
                    stale, max_start_s)
    if dropped is not None:
        dropped["dropped_long_start"] = stale
    if pods_from_events:
        found.extend(_cold_starts_from_events(by_object, seen_names, seen_uids, since=since,
                                              mapping=model_by_workload or {}))
    return found


def _cold_starts_from_events(by_object: dict[tuple[str, str], list[dict]], seen_names: set[str],
                             seen_uids: set[str], *, since: datetime | None, mapping: dict[str, str]) -> list[dict]:
    """Pods known only from an exported file's events: ``Scheduled`` -> ``Started``, the model from the name."""
    found = []
    for (key_kind, key), items in by_object.items():
        name = _involved(items[0])["name"]
        if name in seen_names or (key_kind == "uid" and key in seen_uids) or name.startswith(_PREPULL_POD_PREFIX):
            continue
        scheduled = next((e for e in items if e.get("reason") == "Scheduled"), None)
        container_started = next((e for e in items if e.get("reason") == "Started"), None)
        if scheduled is None or container_started is None:
            continue
        t0, t1 = _event_time(scheduled), _event_time(container_started)
        if t0 is None or t1 is None or t1 < t0 or (since is not None and t1 < since):
            continue
        node_match = re.search(r" to (\S+)$", scheduled.get("message") or "")
        node = (scheduled.get("source") or {}).get("host") or (node_match.group(1) if node_match else None) \
            or (container_started.get("source") or {}).get("host")
        if not node:
            continue
        workload = workload_of_pod(name)
        pull_s, cache_state = _pull_from_events(items)
        row = {"model_id": mapping.get(workload, workload), "node_id": node, "started_at": t0.isoformat(),
               "total_seconds": round((t1 - t0).total_seconds(), 3),
               "event_id": _event_id(key if key_kind == "uid" else None, name)}
        if pull_s is not None and pull_s <= row["total_seconds"] * 1.05:
            row["image_pull_s"] = round(pull_s, 3)
            row["cache_state"] = cache_state
        found.append(row)
    return found


def load_k8s_export(path: Path) -> tuple[list[dict], list[dict]]:
    """(pods, events) from ``kubectl get ... -o json`` output: a List, PodList, EventList, or one object."""
    document = json.loads(Path(path).read_text())
    items = document.get("items") if isinstance(document, dict) and "items" in document else [document]
    pods = [i for i in items if i.get("kind") == "Pod" or (document.get("kind") == "PodList")]
    events = [i for i in items if i.get("kind") == "Event" or (document.get("kind") == "EventList")
              or ("involvedObject" in i and "reason" in i)]
    return pods, [e for e in events if e not in pods]
