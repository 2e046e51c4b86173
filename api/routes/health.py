"""Liveness, readiness and Prometheus metrics of the service itself."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

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


@router.get("/readyz", responses={503: {"description": "Database unreachable or forecasts stale"}})
def readyz(engine: EngineDep, settings: SettingsDep, clock: ClockDep) -> JSONResponse:
    """Ready when the database answers and the newest forecast is fresh (or no model is registered yet)."""
    checks: dict[str, object] = {}
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
            newest = conn.execute(text("SELECT max(issued_at) FROM forecasts")).scalar()
            models = conn.execute(text("SELECT count(*) FROM serving_models")).scalar()
        checks["database"] = "ok"
    except OperationalError as exc:
        checks["database"] = f"unreachable: {type(exc.orig).__name__}"
        return JSONResponse({"status": "unavailable", "checks": checks}, status_code=503)
    if newest is None:
        checks["forecasts"] = "none yet" if models == 0 else "none yet for registered models"
        ok = models == 0
    else:
        age_s = (clock() - newest).total_seconds()
        checks["forecast_age_s"] = round(age_s, 1)
        ok = age_s <= settings.forecast_fresh_s
        checks["forecasts"] = "fresh" if ok else f"stale (older than {settings.forecast_fresh_s:g} s)"
    return JSONResponse({"status": "ok" if ok else "unavailable", "checks": checks}, status_code=200 if ok else 503)


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
