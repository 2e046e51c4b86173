"""Liveness, readiness and Prometheus metrics of the service itself."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as SATimeoutError

from api.deps import ClockDep, EngineDep, SettingsDep

router = APIRouter(tags=["health"])


@router.get("/healthz", responses={503: {"description": "This process's scheduler has stopped or is stuck"}})
def healthz(request: Request) -> JSONResponse:
    """The process answers (no dependencies checked); in a process that runs the scheduler, also its loop: 503 once
    the loop's thread has ended or it has not woken for several minutes (:mod:`forecaster.jobs.heartbeat`)."""
    check = getattr(request.app.state, "scheduler_health", None)
    if check is None:
        return JSONResponse({"status": "ok"})
    ok, detail = check()
    return JSONResponse({"status": "ok" if ok else "unavailable", "scheduler": detail}, status_code=200 if ok else 503)


@router.get("/readyz", responses={503: {"description": "Database unreachable, or this process's forecasts stale"}})
def readyz(request: Request, engine: EngineDep, settings: SettingsDep, clock: ClockDep) -> JSONResponse:
    """Ready when the database answers and this process's own forecast snapshot serves fresh forecasts: its last
    refresh succeeded within ``PREWARM_FORECAST_FRESH_S`` and its newest loaded run is no older than that (no run:
    ready only while no model is registered). What the snapshot serves is what this process's recommendations
    read, so a process whose refreshes fail (each worker of ``prewarm serve`` has its own snapshot and answers its
    own probes) is taken out of service rather than answering ``forecast_stale``. Runs stamped more than
    :data:`~forecaster.store.forecasts.MAX_ISSUED_AHEAD_S` ahead of the clock are never loaded, so one cannot keep
    the process ready."""
    checks: dict[str, object] = {}
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except (OperationalError, SATimeoutError) as exc:
        cause = exc.orig if isinstance(exc, OperationalError) else exc
        checks["database"] = f"unreachable: {type(cause).__name__}"
        return JSONResponse({"status": "unavailable", "checks": checks}, status_code=503)
    snapshot = request.app.state.snapshot
    if settings.api_snapshot_refresh_s == 0:  # no refresher: every read refreshes, and so does this one
        snapshot.refresh(wait=True)
    ok, detail = snapshot.readiness(clock(), settings.forecast_fresh_s)
    checks.update(detail)
    return JSONResponse({"status": "ok" if ok else "unavailable", "checks": checks}, status_code=200 if ok else 503)


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
