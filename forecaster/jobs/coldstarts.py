"""The ``coldstarts`` job (every minute): cold starts of new replicas observed in the cluster, stored.

The Kubernetes backend reads them from pod status and kubelet events (:mod:`forecaster.actuation.kube_coldstarts`);
the rows go through the actuator's observation sink (validated row by row, the first observation of each kept,
source ``actuator-kubernetes``), so the latency model learns from the cluster's real starts. A job of its own, not
a step of the plan job: a collector that fails (the API server away, a pod it cannot read) fails this job's slot,
recorded in ``job_runs``, and never a plan. A backend that cannot see cold starts (``dry-run``, ``agent``, a
``composite`` whose scale backend is one of those) makes the run a no-op, ``skipped``.

Watermark: every run lists the namespace's model pods (what the cluster holds now, not its history) but pushes
only those that became Ready at or after the slot of the job's last successful, not skipped, run less
:data:`WATERMARK_MARGIN_S` (clock skew between nodes and the scheduler, status updates reaching the API late). A
failed run does not move it, so the next run covers the gap; the first run pushes every ready pod there is that was
created within ``PREWARM_KUBERNETES_COLDSTART_MAX_START_S`` of now (the backend counts only pods created at or after
the watermark less that bound: a later Ready transition of an older pod, a readiness flap, is not its cold start).
Pods the margin shows again are kept as stored (first observation wins). A start longer than that bound is not
stored, so the latency model never learns it: the run counts such pods (``dropped_long_start``) and logs a warning.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Engine

from forecaster.settings import Settings
from forecaster.store.job_runs import last_ok_slot

#: The job's name in the scheduler and in ``job_runs`` (its last successful run is the watermark).
JOB_NAME = "coldstarts"
#: Seconds before the last successful run's slot from which Ready pods are pushed again.
WATERMARK_MARGIN_S = 600


def collector_watermark(engine: Engine) -> datetime | None:
    """The Ready time from which pods count: the last successful, not skipped, run's slot less the margin."""
    slot = last_ok_slot(engine, JOB_NAME)
    return None if slot is None else slot - timedelta(seconds=WATERMARK_MARGIN_S)


def coldstarts_job(engine: Engine, settings: Settings, now: datetime, *, backend=None) -> dict:
    """Collect and store the cold starts the actuator's backend can observe, from the watermark on.

    Args:
        backend: the backend to observe through (tests pass a Kubernetes backend on a fake API server); default
            the one ``settings.actuator_backend`` names, built for this run and closed after it.

    Returns:
        The sink's counts (``inserted``, ``already_stored``, ``rejected`` with reasons), ``observed`` (rows the
        backend returned), ``dropped_long_start`` (Kubernetes: ready pods left out because Ready came more than
        ``PREWARM_KUBERNETES_COLDSTART_MAX_START_S`` after creation; such a start is not learned) and ``since``
        (the watermark, ISO; None on the first run); or ``skipped``.
    """
    from forecaster.actuation.actuator import Actuator, build_backend

    own = backend is None
    backend = build_backend(settings) if own else backend
    try:
        since = collector_watermark(engine)
        summary = Actuator(engine, settings, backend).collect_observations(now=now, since=since)
    finally:
        close = getattr(backend, "close", None) if own else None
        if close is not None:
            close()
    if "skipped" in summary:
        return summary
    return {**summary, "since": None if since is None else since.isoformat()}
