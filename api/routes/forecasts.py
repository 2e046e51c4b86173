"""Forecast and recommendation reads: what autoscalers query every few seconds.

Both keep serving their last good answer, marked ``stale``, while the database
is unreachable.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Query
from sqlalchemy.exc import OperationalError

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from api.deps import ClockDep, EngineDep, ReadToken, SettingsDep
from api.model_routes import ModelIdRoute
from api.schemas import ForecastPoint, ForecastPublic, RecommendationPublic
from forecaster.contracts.forecast import FORECAST_LEVELS
from forecaster.planning.recommendation import recommend
from forecaster.store.forecasts import latest_forecast, quantile_columns

router = APIRouter(prefix="/v1/models", tags=["forecasts"], route_class=ModelIdRoute)

QUANTILES_HELP = ("Comma-separated levels among those stored, e.g. 0.5,0.95,0.99; default: all of them (the "
                  f"forecast job stores {','.join(f'{q:g}' for q in FORECAST_LEVELS)}).")


def _parse_levels(quantiles: str | None) -> list[float] | None:
    if not quantiles:
        return None
    try:
        levels = [float(q) for q in quantiles.split(",") if q.strip()]
    except ValueError:
        raise HTTPException(422, f"quantiles must be comma-separated numbers in (0, 1), got {quantiles!r}") from None
    if not levels or any(not 0 < q < 1 for q in levels):
        raise HTTPException(422, f"quantiles must be comma-separated numbers in (0, 1), got {quantiles!r}")
    return levels


def _stale_or_503(request: Request, key: str):
    cached = request.app.state.last_good.get(key)
    if cached is None:
        raise HTTPException(503, "database unavailable and no earlier answer to serve",
                            headers={"Retry-After": str(request.app.state.settings.ingest_retry_after_s)})
    return cached.model_copy(update={"stale": True})


@router.get("/{model_id}/forecast", response_model=ForecastPublic,
            responses={404: {"description": "Unknown model or no forecast yet"}})
def get_forecast(model_id: str, request: Request, engine: EngineDep, clock: ClockDep, _: ReadToken,
                 horizon: int = Query(60, ge=1, le=1440, description="Minutes ahead."),
                 quantiles: str | None = Query(None, description=QUANTILES_HELP)
                 ) -> ForecastPublic:
    """The newest stored run: every stored level by default (the forecast job stores ``FORECAST_LEVELS``)."""
    levels = _parse_levels(quantiles)
    key = f"forecast:{model_id}:{horizon}:{quantiles}"
    try:
        with engine.connect() as conn:
            exists = conn.exec_driver_sql("SELECT 1 FROM serving_models WHERE id = %s", (model_id,)).first()
            if exists is None:
                raise HTTPException(404, f"model {model_id!r} is not registered")
            stored = latest_forecast(conn, model_id=model_id, horizon_min=horizon)
    except OperationalError:
        return _stale_or_503(request, key)
    if stored is None:
        raise HTTPException(404, f"no forecast for model {model_id!r} yet")
    columns = quantile_columns(stored.frame)
    wanted = {c: lvl for c, lvl in columns.items()
              if levels is None or any(abs(lvl - q) < 1e-9 for q in levels)}
    if levels is not None and len(wanted) < len(levels):
        have = sorted(columns.values())
        raise HTTPException(422, f"forecast has quantiles {have}; asked for {levels}")
    points = [
        ForecastPoint(target_minute=row["target_minute"], point=row["point"],
                      p_any=None if row["p_any"] is None or row["p_any"] != row["p_any"] else row["p_any"],
                      quantiles={f"{lvl:g}": float(row[c]) for c, lvl in wanted.items()})
        for row in stored.frame.to_dict("records")
    ]
    now = clock()
    body = ForecastPublic(model_id=model_id, issued_at=stored.issued_at,
                          age_s=(now - stored.issued_at).total_seconds(), model_version_id=stored.model_version_id,
                          stale=False, horizon_min=horizon, points=points)
    request.app.state.last_good.put(key, body)
    return body


@router.get("/{model_id}/recommendation", response_model=RecommendationPublic,
            responses={404: {"description": "Unknown model"}, 503: {"description": "Database unavailable"}})
async def get_recommendation(model_id: str, request: Request, settings: SettingsDep, clock: ClockDep, _: ReadToken,
                       quantile: float | None = Query(None, gt=0, lt=1,
                                                      description="Demand quantile; default the setting.")
                       ) -> RecommendationPublic:
    """Replicas to have ready now and at the cold-start lead time, from the newest forecast run in memory.

    A forecast older than ``PREWARM_FORECAST_FRESH_S`` answers 200 with the replica fields null and reason
    ``forecast_stale`` (its issue time and age given), as ``no_forecast`` and ``forecast_expired`` do: KEDA's
    metrics-api scaler then counts a failure and applies the ScaledObject's fallback. Not a 5xx: the service is up
    and the body says why there is no number, in the schema clients already read.
    """
    # async and in memory: the hot path takes no thread hop; refreshes run in a worker thread
    snapshot = request.app.state.snapshot
    if settings.api_snapshot_refresh_s == 0 or snapshot.newest_issued_at is None:
        await run_in_threadpool(snapshot.refresh_if_due)
    view = snapshot.get(model_id)
    if view is None and snapshot.healthy:
        await run_in_threadpool(snapshot.refresh, wait=True)  # registered since the last refresh?
        view = snapshot.get(model_id)
    if view is None:
        if snapshot.healthy:
            raise HTTPException(404, f"model {model_id!r} is not registered")
        raise HTTPException(503, "database unavailable and the model is not in memory",
                            headers={"Retry-After": str(settings.ingest_retry_after_s)})
    result = recommend(view.forecast, model_id=model_id, now=clock(),
                       lead_time_s=float(view.lead_time_s or settings.default_cold_start_s),
                       replica_rps=view.replica_rps, quantile=quantile or settings.recommendation_quantile,
                       max_age_s=settings.forecast_fresh_s)
    return RecommendationPublic(**result.as_dict(), stale=not snapshot.healthy)
