"""Cold starts of new replicas from Kubernetes pod status and kubelet events.

For each pod of a serving model (pods carry the model label):

* ``started_at`` = the pod's creation; ``total_seconds`` = creation -> ``Ready`` condition;
* ``image_pull_s`` from the kubelet's ``Pulled`` event, ``Successfully pulled image "x" in 3.2s (3.5s
  including waiting)`` (the first figure), or 0 with ``cache_state = "image"`` for
  ``Container image "x" already present on machine``;
* ``weight_load_s`` = container start -> ``Ready``: the server loading weights and initialising its
  runtime, which pod status cannot tell apart (recorded as the load phase, the larger part for LLM servers).

Pods may come from the API or from an exported JSON file (``kubectl get pods,events -o json``: a ``List``
of Pods and Events, or an ``EventList`` alone). From events alone a pod counts from its ``Scheduled`` event
to its ``Started`` event, and its model is the workload name in the pod name (``<name>-<rs hash>-<pod hash>``,
KServe ``<name>-predictor-...``).
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from pathlib import Path

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PULLED = re.compile(r'Successfully pulled image "[^"]*" in ([0-9.a-zµ]+)')
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_PRESENT = re.compile(r"already present on machine")


def parse_go_duration(text: str) -> float | None:
    """Seconds in a Go duration string (``1m2.5s``, ``812ms``, ``3.2s``); None if it is not one."""
    text = text.strip()
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def _time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _event_time(event: dict) -> datetime | None:
    return _time(event.get("eventTime") or event.get("firstTimestamp") or event.get("lastTimestamp")
                 or (event.get("metadata") or {}).get("creationTimestamp"))


def workload_of_pod(pod_name: str) -> str:
    """The Deployment (or KServe InferenceService) a pod belongs to, from its generated name."""
    name = re.sub(r"-predictor(-default)?(-\d{5})?(-deployment)?(-[a-z0-9]{5,10})?-[a-z0-9]{5}$", "", pod_name)
    if name != pod_name:
        return name
    return re.sub(r"-[a-z0-9]{6,10}-[a-z0-9]{5}$", "", pod_name)


def _pull_from_events(events: list[dict]) -> tuple[float | None, str | None]:
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


def cold_starts_from_k8s(pods: list[dict], events: list[dict], *, model_label: str = "prewarm.io/model",
                         since: datetime | None = None, model_by_workload: dict[str, str] | None = None) -> list[dict]:
    """Cold-start events (the ``cold_starts`` push schema) from pods (camelCase JSON) and events.

    Pods not yet ready, or created before ``since``, are left out.
    """
    by_pod: dict[str, list[dict]] = {}
    for event in events:
        involved = event.get("involvedObject") or event.get("regarding") or {}
        if involved.get("kind", "Pod") == "Pod" and involved.get("name"):
            by_pod.setdefault(involved["name"], []).append(event)
    for items in by_pod.values():
        items.sort(key=lambda e: (_event_time(e) is None, _event_time(e) or _EPOCH))
    found = []
    seen = set()
    for pod in pods:
        meta = pod.get("metadata") or {}
        name = meta.get("name")
        model = (meta.get("labels") or {}).get(model_label)
        created = _time(meta.get("creationTimestamp"))
        node = (pod.get("spec") or {}).get("nodeName")
        if not (name and model and created and node) or (since is not None and created < since):
            continue
        seen.add(name)
        status = pod.get("status") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        ready = conditions.get("Ready")
        if not ready or ready.get("status") != "True":
            continue
        ready_at = _time(ready.get("lastTransitionTime"))
        started = [_time(((c.get("state") or {}).get("running") or {}).get("startedAt"))
                   for c in status.get("containerStatuses") or []]
        started = [s for s in started if s is not None]
        if ready_at is None or ready_at < created:
            continue
        pull_s, cache_state = _pull_from_events(by_pod.get(name, []))
        row = {"model_id": model, "node_id": node, "started_at": created.isoformat(),
               "total_seconds": round((ready_at - created).total_seconds(), 3)}
        if pull_s is not None:
            row["image_pull_s"] = round(pull_s, 3)
            row["cache_state"] = cache_state
        if started and min(started) <= ready_at:
            row["weight_load_s"] = round((ready_at - min(started)).total_seconds(), 3)
        found.append(row)
    # Pods known only from events (an exported events file).
    mapping = model_by_workload or {}
    for name, items in by_pod.items():
        if name in seen:
            continue
        scheduled = next((e for e in items if e.get("reason") == "Scheduled"), None)
        container_started = next((e for e in items if e.get("reason") == "Started"), None)
        if scheduled is None or container_started is None:
            continue
        t0, t1 = _event_time(scheduled), _event_time(container_started)
        if t0 is None or t1 is None or t1 < t0 or (since is not None and t0 < since):
            continue
        node_match = re.search(r" to (\S+)$", scheduled.get("message") or "")
        node = (scheduled.get("source") or {}).get("host") or (node_match.group(1) if node_match else None) \
            or (container_started.get("source") or {}).get("host")
        if not node:
            continue
        workload = workload_of_pod(name)
        pull_s, cache_state = _pull_from_events(items)
        row = {"model_id": mapping.get(workload, workload), "node_id": node, "started_at": t0.isoformat(),
               "total_seconds": round((t1 - t0).total_seconds(), 3)}
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
