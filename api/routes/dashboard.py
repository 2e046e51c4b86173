"""Data for the dashboard (read scope), and the dashboard page itself under ``/dashboard``.

* ``GET /v1/models/{id}/series``: actual invocations per minute and the forecast
  made ``horizon`` minutes ahead of each minute, with its quantiles.
* ``GET /v1/models/{id}/coldstarts``: observed cold starts (and predicted ones
  where the store holds any; it says when it holds none).
* ``GET /v1/models/{id}/actions``: the model's pre-warm actions on a timeline.
* ``GET /v1/fleet``: every model ranked by forecast error at one horizon over a
  window, with its cold starts and actions.

Series arrays are columnar (one array per line of the chart), so a week of
minutes is 10,080 numbers per array and the page hands them to uPlot as they
are. Times are UTC; naive times in queries are read as UTC.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from enum import StrEnum
from pathlib import Path

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from sqlalchemy.exc import OperationalError

from api.deps import ClockDep, EngineDep, ReadToken, SettingsDep
from forecaster.store.dashboard import (
    ForecastError,
    finite_or_none,
    model_exists,
    read_action_timeline,
    read_cold_starts,
    read_fleet,
    read_forecast_series,
)

router = APIRouter(prefix="/v1", tags=["dashboard"])

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
#: Longest series one request may ask for: 31 days of minutes.
MAX_SERIES_MINUTES = 31 * 24 * 60
MAX_HORIZON_MIN = 1440
MINUTE = timedelta(minutes=1)
_EARLIEST = datetime(1970, 1, 1, tzinfo=timezone.utc)
_LATEST = datetime(2200, 1, 1, tzinfo=timezone.utc)

_UNKNOWN_MODEL = {404: {"description": "Unknown model"},
                  503: {"description": "Database unavailable: retry after the Retry-After seconds"}}


def static_files() -> StaticFiles:
    """The dashboard's HTML, JS, CSS and the vendored uPlot, to mount at ``/dashboard``."""
    return StaticFiles(directory=STATIC_DIR, html=True)


# --- schemas -----------------------------------------------------------------------


class ErrorPublic(BaseModel):
    scored_minutes: int = Field(description="Minutes where both the forecast and the actual count are known.")
    mae: float | None = Field(description="Mean absolute error, invocations per minute.")
    wmape: float | None = Field(description="Sum of absolute errors over sum of actuals (0.25 = 25%).")
    band_coverage: float | None = Field(default=None,
                                        description="Share of scored minutes inside the widest quantile band.")

    @classmethod
    def of(cls, error: ForecastError) -> "ErrorPublic":
        return cls(scored_minutes=error.scored_minutes, mae=error.mae, wmape=error.wmape,
                   band_coverage=error.band_coverage)


class SeriesPublic(BaseModel):
    """Columnar series: ``t[i]`` is the minute (Unix seconds, UTC) of ``actual[i]``, ``forecast[i]`` and so on."""

    model_id: str
    start: datetime
    end: datetime
    horizon_min: int = Field(description="Minutes between the forecast's issuing minute and the target minute.")
    step_s: int = 60
    t: list[int]
    actual: list[float | None] = Field(description="Invocations per minute; null = not known (outside coverage).")
    forecast: list[float | None] = Field(description="Point forecast; null = no forecast at this horizon.")
    quantiles: dict[str, list[float | None]] = Field(description="Level (\"0.9\") -> values, aligned on t.")
    band: list[str] | None = Field(description="The widest band's [low, high] levels, or null.")
    error: ErrorPublic


class ColdStartPublic(BaseModel):
    started_at: datetime
    node_id: str
    total_seconds: float
    image_pull_s: float | None = None
    weight_fetch_s: float | None = None
    weight_load_s: float | None = None
    runtime_init_s: float | None = None
    registration_s: float | None = None
    cache_state: str | None = None
    source: str | None = None


class ColdStartsPublic(BaseModel):
    model_id: str
    start: datetime
    end: datetime
    observed: list[ColdStartPublic]
    predicted: list[dict]
    predicted_stored: bool = Field(description="False when the store holds no cold-start predictions.")
    lead_time_s: float = Field(description="Lead time (s) the recommendation endpoint assumes now: the planner's, "
                                           "from the latency model's predicted start.")
    lead_time_source: str = Field(description="latency_model (the planner's prediction) or default (not available).")
    lead_time_start_state: str | None = Field(default=None, description="The state a new replica would start "
                                              "from (its warmest cached state on any node).")
    latency_model_version: str | None = Field(default=None, description="Latency model version (None: the "
                                              "physics prior, no model trained yet).")
    node_id: str | None = Field(default=None, description="The node asked for (``node`` query): the lead time "
                                "and start state are then those of a start on that node, from its own history "
                                "(falling back to the model's and tier's when the node has none).")
    observed_median_s: float | None = Field(default=None, description="Median total seconds of the last 20 "
                                            "observed cold starts (None: none observed).")
    note: str | None = None


class TimelineActionPublic(BaseModel):
    id: int
    plan_id: int | None
    kind: str
    node_id: str | None
    target: str | None
    spec: dict
    not_before: datetime | None
    deadline: datetime | None
    reason: str | None
    expected_benefit: float | None
    expected_cost: float | None
    status: str
    status_reason: str | None
    attempts: int
    updated_at: datetime


class TimelinePublic(BaseModel):
    model_id: str
    start: datetime
    end: datetime
    data: list[TimelineActionPublic]
    count: int = Field(description="Actions matching in all; more than len(data) when limited.")


class FleetRowPublic(BaseModel):
    rank: int
    model_id: str
    error: ErrorPublic
    actual_total: float
    forecast_total: float
    cold_starts: int
    actions_total: int
    actions_succeeded: int
    actions_failed: int
    expected_wait_avoided_s: float = Field(
        description="The planner's expected cold-start seconds avoided by the succeeded actions.")
    last_forecast_at: datetime | None


class FleetPublic(BaseModel):
    start: datetime
    end: datetime
    window_min: int
    horizon_min: int
    sort: str
    count: int = Field(description="Models matching (before limit).")
    data: list[FleetRowPublic]


class FleetSort(StrEnum):
    WMAPE = "wmape"
    MAE = "mae"
    COLD_STARTS = "cold_starts"
    ACTIONS_SUCCEEDED = "actions_succeeded"
    MODEL_ID = "model_id"


# --- helpers -----------------------------------------------------------------------


def _utc(value: datetime, name: str) -> datetime:
    try:
        value = value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
    except OverflowError:  # 0001-01-01T00:00+01:00 is before year 1 in UTC
        raise HTTPException(422, f"{name} is out of range once converted to UTC") from None
    if not _EARLIEST <= value < _LATEST:
        raise HTTPException(422, f"{name} must lie between 1970 and 2200, got {value.isoformat()}")
    return value


def _floor_minute(value: datetime) -> datetime:
    return value.replace(second=0, microsecond=0)


def _window(start: datetime | None, end: datetime | None, *, default_end: datetime,
            default_span: timedelta) -> tuple[datetime, datetime]:
    """Whole-minute ``[start, end)`` (start floored, end rounded up), validated."""
    end = _utc(end, "end") if end is not None else default_end
    end_floor = _floor_minute(end)
    end = end_floor if end == end_floor else end_floor + MINUTE
    start = _floor_minute(_utc(start, "start")) if start is not None else end - default_span
    if start >= end:
        raise HTTPException(422, f"start ({start.isoformat()}) must be before end ({end.isoformat()})")
    if end - start > MAX_SERIES_MINUTES * MINUTE:
        raise HTTPException(422, f"at most {MAX_SERIES_MINUTES} minutes (31 days) per request")
    return start, end


def _unavailable(settings) -> HTTPException:
    return HTTPException(503, "database unavailable", headers={"Retry-After": str(settings.ingest_retry_after_s)})


def _require_model(conn, model_id: str) -> None:
    # An id PostgreSQL cannot even compare (NUL) or longer than the column was never registered.
    if "\x00" in model_id or len(model_id) > 256 or not model_exists(conn, model_id=model_id):
        raise HTTPException(404, f"model {model_id!r} is not registered")


_START = Query(None, description="First minute (UTC); default one day before end.")
_SERIES_START = Query(None, description="First minute (UTC); default span_min minutes before end.")


# --- routes ------------------------------------------------------------------------


@router.get("/models/{model_id}/series", response_model=SeriesPublic, responses=_UNKNOWN_MODEL)
def get_series(model_id: str, engine: EngineDep, settings: SettingsDep, clock: ClockDep, _: ReadToken,
               start: datetime | None = _SERIES_START,
               end: datetime | None = Query(None, description="End, exclusive (UTC); default the minute after "
                                                              "the last one forecast at this horizon from now."),
               horizon: int = Query(5, ge=0, le=MAX_HORIZON_MIN, description="Minutes ahead."),
               span_min: int = Query(1440, ge=1, le=MAX_SERIES_MINUTES,
                                     description="Minutes before end when start is not given.")) -> SeriesPublic:
    """Actual invocations per minute and the forecast issued ``horizon`` minutes before each minute.

    Without ``end``, the window ends after the last minute forecast ``horizon``
    minutes ahead from now, so the forecast runs past the last actual count.
    """
    default_end = _floor_minute(clock().astimezone(timezone.utc)) + (horizon + 1) * MINUTE
    start, end = _window(start, end, default_end=default_end, default_span=span_min * MINUTE)
    try:
        with engine.connect() as conn:
            _require_model(conn, model_id)
            series = read_forecast_series(conn, model_id=model_id, start=start, end=end, horizon_min=horizon)
    except OperationalError:
        raise _unavailable(settings) from None
    band = series.band
    return SeriesPublic(
        model_id=model_id, start=start, end=end, horizon_min=horizon, t=series.minutes.tolist(),
        actual=finite_or_none(series.actual), forecast=finite_or_none(series.point),
        quantiles={level: finite_or_none(values) for level, values in series.quantiles.items()},
        band=list(band) if band else None, error=ErrorPublic.of(series.error()),
    )


@router.get("/models/{model_id}/coldstarts", response_model=ColdStartsPublic, responses=_UNKNOWN_MODEL)
async def get_cold_starts(model_id: str, request: Request, engine: EngineDep, settings: SettingsDep,
                          clock: ClockDep, _: ReadToken, start: datetime | None = _START,
                    end: datetime | None = Query(None, description="End, exclusive (UTC); default now."),
                    limit: int = Query(10_000, ge=1, le=100_000),
                    node: str | None = Query(None, min_length=1, max_length=200,
                                             description="A node id: the lead time of a start of this model on "
                                                         "that node (404 when the fleet has no such node).")
                    ) -> ColdStartsPublic:
    """Observed cold starts that began in the window; predicted ones only where the store holds them.

    With ``node``, ``lead_time_s`` and ``lead_time_start_state`` are those of a start on that node (the
    latency model's per-node prediction from the state the node holds the model in, plus the planner's
    margins); an unknown node is a 404.
    """
    default_end = _floor_minute(clock().astimezone(timezone.utc)) + MINUTE
    start, end = _window(start, end, default_end=default_end, default_span=timedelta(days=1))

    def read():
        with engine.connect() as conn:
            _require_model(conn, model_id)
            return read_cold_starts(conn, model_id=model_id, start=start, end=end, limit=limit)

    try:
        view = await run_in_threadpool(read)
    except OperationalError:
        raise _unavailable(settings) from None
    snapshot = request.app.state.snapshot
    if settings.api_snapshot_refresh_s == 0 or snapshot.newest_issued_at is None:
        await run_in_threadpool(snapshot.refresh_if_due)
    model_view = snapshot.get(model_id)
    if model_view is None and snapshot.healthy:
        await run_in_threadpool(snapshot.refresh)
        model_view = snapshot.get(model_id)
    predicted = model_view is not None and model_view.lead_time_s is not None
    if node is not None:
        try:
            on_node = await run_in_threadpool(_node_lead_time, engine, settings, clock(), model_id, node)
        except OperationalError:
            raise _unavailable(settings) from None
        if on_node is None:
            raise HTTPException(status_code=404, detail=f"unknown node {node!r}")
        lead, state = on_node
        return ColdStartsPublic(
            model_id=model_id, start=start, end=end, observed=[ColdStartPublic(**e) for e in view.observed],
            predicted=view.predicted, predicted_stored=view.predicted_stored, lead_time_s=lead,
            lead_time_source="latency_model", lead_time_start_state=state,
            latency_model_version=snapshot.latency_model_version, observed_median_s=view.lead_time_s,
            node_id=node,
            note=None if view.predicted_stored else "no cold-start predictions are stored; showing observed only")
    return ColdStartsPublic(
        model_id=model_id, start=start, end=end, observed=[ColdStartPublic(**e) for e in view.observed],
        predicted=view.predicted, predicted_stored=view.predicted_stored,
        lead_time_s=model_view.lead_time_s if predicted else settings.default_cold_start_s,
        lead_time_source="latency_model" if predicted else "default",
        lead_time_start_state=model_view.start_state if model_view is not None else None,
        latency_model_version=snapshot.latency_model_version, observed_median_s=view.lead_time_s,
        note=None if view.predicted_stored else "no cold-start predictions are stored; showing observed only",
    )


def _node_lead_time(engine, settings, now: datetime, model_id: str, node: str) -> tuple[float, str] | None:
    """(lead seconds, start state) of a start of ``model_id`` on ``node``; None when the fleet has no such node."""
    import pandas as pd

    from api.snapshot import planner_settings_for
    from forecaster.coldstart.service import latency_table
    from forecaster.jobs.planning import fleet_from_store
    from forecaster.planning.fleet import node_states
    from forecaster.planning.lead_time import lead_time_s

    fleet = fleet_from_store(engine, now=now, default_cold_cost=settings.planner_cold_cost)
    if node not in set(fleet.nodes.index.astype(str)):
        return None
    if model_id in set(fleet.models.index.astype(str)):
        held = node_states(fleet)
        state = str(held.loc[(held["model_id"] == model_id) & (held["node_id"] == node), "state"].iloc[0])
        sizes = fleet.models.loc[[model_id], ["image_bytes", "weights_bytes"]]
    else:  # in the catalogue but not plannable (e.g. no usable sizes): nothing cached, sizes unknown
        state, sizes = "none", pd.DataFrame({"image_bytes": [0.0], "weights_bytes": [0.0]}, index=[model_id])
    table = latency_table(engine, settings, sizes, hour=now.astimezone(timezone.utc).hour, nodes=[node])
    lead = lead_time_s(table.drop(columns="node_id"), {model_id: state}, planner_settings_for(settings),
                       model_ids=[model_id])
    return float(lead[model_id]), state


@router.get("/models/{model_id}/actions", response_model=TimelinePublic, responses=_UNKNOWN_MODEL)
def get_action_timeline(model_id: str, engine: EngineDep, settings: SettingsDep, clock: ClockDep, _: ReadToken,
                        start: datetime | None = _START,
                        end: datetime | None = Query(None, description="End, exclusive (UTC); default an hour "
                                                                       "from now (planned actions)."),
                        limit: int = Query(5_000, ge=1, le=50_000)) -> TimelinePublic:
    """The model's actions whose ``[not_before, deadline]`` meets the window, oldest first."""
    default_end = _floor_minute(clock().astimezone(timezone.utc)) + 61 * MINUTE
    start, end = _window(start, end, default_end=default_end, default_span=timedelta(days=1))
    try:
        with engine.connect() as conn:
            _require_model(conn, model_id)
            rows, count = read_action_timeline(conn, model_id=model_id, start=start, end=end, limit=limit)
    except OperationalError:
        raise _unavailable(settings) from None
    return TimelinePublic(model_id=model_id, start=start, end=end,
                          data=[TimelineActionPublic(**r) for r in rows], count=count)


def _sort_key(sort: FleetSort):
    def key(row) -> tuple:
        if sort is FleetSort.MODEL_ID:
            return (row.model_id,)
        value = {FleetSort.WMAPE: row.error.wmape, FleetSort.MAE: row.error.mae,
                 FleetSort.COLD_STARTS: row.cold_starts, FleetSort.ACTIONS_SUCCEEDED: row.actions_succeeded}[sort]
        # Largest first; models with nothing to score last; ties by MAE, then id.
        return (value is None, -(value or 0.0), -(row.error.mae or 0.0), row.model_id)

    return key


@router.get("/fleet", response_model=FleetPublic,
            responses={503: {"description": "Database unavailable: retry after the Retry-After seconds"}})
def get_fleet(engine: EngineDep, settings: SettingsDep, clock: ClockDep, _: ReadToken,
              horizon: int = Query(5, ge=0, le=MAX_HORIZON_MIN, description="Minutes ahead."),
              window_min: int = Query(60, ge=1, le=7 * 24 * 60, description="Minutes before end to score."),
              end: datetime | None = Query(None, description="End of the window, exclusive (UTC); default the "
                                                             "current minute's start."),
              sort: FleetSort = Query(FleetSort.WMAPE, description="Rank by this, largest first."),
              search: str | None = Query(None, max_length=256, description="Only models whose id contains this."),
              limit: int | None = Query(None, ge=1, le=100_000)) -> FleetPublic:
    """Every registered model ranked by forecast error (MAE, wMAPE) at ``horizon`` over the window."""
    end = _floor_minute(_utc(end, "end") if end is not None else clock().astimezone(timezone.utc))
    try:
        with engine.connect() as conn:
            rows = read_fleet(conn, end=end, window_min=window_min, horizon_min=horizon)
    except OperationalError:
        raise _unavailable(settings) from None
    rows.sort(key=_sort_key(sort))
    ranked = [(i + 1, r) for i, r in enumerate(rows)]
    if search:
        needle = search.lower()
        ranked = [(rank, r) for rank, r in ranked if needle in r.model_id.lower()]
    count = len(ranked)
    data = [
        FleetRowPublic(rank=rank, model_id=r.model_id, error=ErrorPublic.of(r.error), actual_total=r.actual_total,
                       forecast_total=r.forecast_total, cold_starts=r.cold_starts, actions_total=r.actions_total,
                       actions_succeeded=r.actions_succeeded, actions_failed=r.actions_failed,
                       expected_wait_avoided_s=r.expected_wait_avoided_s, last_forecast_at=r.last_forecast_at)
        for rank, r in (ranked[:limit] if limit else ranked)
    ]
    return FleetPublic(start=end - window_min * MINUTE, end=end, window_min=window_min, horizon_min=horizon,
                       sort=sort.value, count=count, data=data)
