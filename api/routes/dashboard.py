"""Data for the dashboard (read scope), and the dashboard page itself under ``/dashboard``.

* ``GET /v1/models/{id}/series``: actual invocations per minute and the forecast
  made ``horizon`` minutes ahead of each minute, with its quantiles.
* ``GET /v1/models/{id}/coldstarts``: observed cold starts (and predicted ones
  where the store holds any; it says when it holds none).
* ``GET /v1/models/{id}/actions``: the model's pre-warm actions on a timeline.
* ``GET /v1/fleet``: one page (``limit``/``offset``) of every model ranked by
  forecast error (or another sort key) at one horizon over a window, with its
  cold starts, actions and the newest replay's figures; ``count`` is the total.
  Later pages of one ranking pass the first page's ``end`` and ``error_end``.
* ``GET /v1/dashboard/context``: the horizons the store holds (what the page
  offers) and where the default windows end.

Default windows end at the current minute while the store holds recent counts,
and at the newest known count when it does not (a 2019 trace served in 2026):
``end_source`` says which. ``end`` picks any window end (the page's date
picker); it must lie between 1970 and a day after now.

Series arrays are columnar (one array per line of the chart), so a week of
minutes is 10,080 numbers per array and the page hands them to uPlot as they
are. Times are UTC; naive times in queries are read as UTC.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone
from enum import StrEnum
from pathlib import Path

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from sqlalchemy.exc import OperationalError

from api.deps import ClockDep, EngineDep, ReadToken, SettingsDep
from api.model_routes import ModelIdRoute
from api.schemas import ActionRecord
from forecaster.store.dashboard import (
    FLEET_SORTS,
    ForecastError,
    finite_or_none,
    fleet_error_ends,
    known_until,
    model_exists,
    offered_horizons_min,
    read_action_timeline,
    read_cold_starts,
    read_fleet_page,
    read_forecast_series,
    stored_horizon_min,
)

router = APIRouter(prefix="/v1", tags=["dashboard"], route_class=ModelIdRoute)

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
#: Longest series one request may ask for: 31 days of minutes.
MAX_SERIES_MINUTES = 31 * 24 * 60
MAX_HORIZON_MIN = 1440
#: Latest window end one may ask for, after now: forecasts reach at most MAX_HORIZON_MIN ahead.
MAX_END_AFTER_NOW = timedelta(days=1)
MAX_FLEET_PAGE = 1000
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
    p_any_minutes: int = Field(default=0, description="Scored minutes whose forecast also stored p_any, the "
                                                      "probability of any invocation; the next three are over them.")
    brier_any: float | None = Field(default=None, description="Brier score of p_any against any invocation in "
                                    "the minute (0 is perfect; invoked_share x (1 - invoked_share) is the score of "
                                    "a constant that knew the share in advance).")
    p_any_mean: float | None = Field(default=None, description="Mean p_any (against invoked_share: runs high or "
                                                               "low).")
    invoked_share: float | None = Field(default=None, description="Share of those minutes with an invocation.")

    @classmethod
    def of(cls, error: ForecastError) -> "ErrorPublic":
        return cls(**dataclasses.asdict(error))  # the same fields, by name


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
    p_any: list[float | None] = Field(default_factory=list, description="Probability of any invocation in the "
                                      "minute, as forecast at this horizon; null = not stored.")
    band: list[str] | None = Field(description="The widest band's [low, high] levels, or null.")
    error: ErrorPublic
    end_source: str = Field(description="request (end given), now, or newest_data (nothing recent stored).")


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
    lead_time_source: str = Field(description="latency_model (the planner's prediction); observed (the planner's "
                                              "figure for a model without registered sizes: its own starts); or "
                                              "default (no sizes and no start of its own, or no prediction).")
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


class TimelineActionPublic(ActionRecord):
    """An action on a model's timeline (the model is the page's)."""


class TimelinePublic(BaseModel):
    model_id: str
    start: datetime
    end: datetime
    data: list[TimelineActionPublic]
    count: int = Field(description="Actions matching in all; more than len(data) when limited.")


class ReplayFiguresPublic(BaseModel):
    requests: int
    cold_requests: int
    replica_starts: int
    wait_total_s: float
    wait_max_s: float


class FleetReplayPublic(BaseModel):
    """The newest replay's figures for one model: prewarm against the reactive autoscaler."""

    prewarm: ReplayFiguresPublic
    reactive: ReplayFiguresPublic
    cold_requests_avoided: int
    wait_saved_s: float


class FleetRowPublic(BaseModel):
    rank: int = Field(description="Position in the whole fleet by the sort key (search keeps it).")
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
    replay: FleetReplayPublic | None = Field(description="Null when the newest replay has no row for it.")


class FleetPublic(BaseModel):
    start: datetime
    end: datetime
    end_source: str = Field(description="request (end given), now, or newest_data (nothing recent stored).")
    window_min: int
    horizon_min: int
    sort: str
    error_start: datetime = Field(description="First hour of the error figures' window: the window snapped to "
                                              "whole hours (ending at the start of end's hour, window_min "
                                              "rounded up to hours); cold starts and actions cover start..end.")
    error_end: datetime = Field(description="End of the error figures' window, exclusive (a whole hour). Later "
                                            "pages of this ranking: ask with this end and error_end.")
    error_source: str = Field(description="rollup: summed from the scored hours of the error rollup (the "
                                          "forecast_errors job); runs: read from the forecast runs minute by "
                                          "minute (a horizon or hour not scored yet; slow at fleet scale).")
    count: int = Field(description="Models matching the search in all (every page).")
    offset: int
    limit: int
    data: list[FleetRowPublic]


class DashboardContextPublic(BaseModel):
    now: datetime
    known_until: datetime | None = Field(description="End of the newest known count of any model (null: none).")
    default_end: datetime = Field(description="Where the fleet window ends when no end is given.")
    end_source: str = Field(description="now, or newest_data when nothing recent is stored.")
    stored_horizon_min: int = Field(description="Minutes ahead the newest stored run reaches (the setting "
                                                "PREWARM_FORECAST_HORIZON_MIN when no run is stored).")
    horizons_min: list[int] = Field(description="Horizons to offer: those of a ladder the store holds.")


FleetSort = StrEnum("FleetSort", {name.upper(): name for name in FLEET_SORTS})


# --- helpers -----------------------------------------------------------------------


def _utc(value: datetime, name: str, now: datetime | None = None) -> datetime:
    """``value`` in UTC (naive = UTC); 422 outside 1970..2200 or, given ``now``, later than a day after it."""
    try:
        value = value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
    except OverflowError:  # 0001-01-01T00:00+01:00 is before year 1 in UTC
        raise HTTPException(422, f"{name} is out of range once converted to UTC") from None
    if not _EARLIEST <= value < _LATEST:
        raise HTTPException(422, f"{name} must lie between 1970 and 2200, got {value.isoformat()}")
    if now is not None and value > now + MAX_END_AFTER_NOW:
        raise HTTPException(422, f"{name} {value.isoformat()} is more than a day after now "
                                 f"({now.isoformat()}): no forecast reaches that far")
    return value


def _ceil_minute(value: datetime) -> datetime:
    floor = value.replace(second=0, microsecond=0)
    return floor if floor == value else floor + MINUTE


def _anchor(conn, now: datetime, recent: timedelta, model_id: str | None = None) -> tuple[datetime, str]:
    """(window anchor, source): the current minute while counts newer than ``recent`` before it are stored,
    else the end of the newest known count (of ``model_id``, or of any model), else the current minute."""
    now_minute = now.replace(second=0, microsecond=0)
    newest = known_until(conn, model_id=model_id)
    if newest is None or newest > now_minute - recent:
        return now_minute, "now"
    return _ceil_minute(newest.astimezone(timezone.utc)), "newest_data"


def _floor_minute(value: datetime) -> datetime:
    return value.replace(second=0, microsecond=0)


def _window(start: datetime | None, end: datetime | None, *, default_end: datetime,
            default_span: timedelta, now: datetime) -> tuple[datetime, datetime]:
    """Whole-minute ``[start, end)`` (start floored, end rounded up), validated."""
    end = _utc(end, "end", now) if end is not None else default_end
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
                                                              "the last one forecast at this horizon from now "
                                                              "(from the newest known count when nothing "
                                                              "recent is stored)."),
               horizon: int = Query(5, ge=1, le=MAX_HORIZON_MIN, description="Minutes ahead (1 = the minute "
                                                                               "the run was issued in)."),
               span_min: int = Query(1440, ge=1, le=MAX_SERIES_MINUTES,
                                     description="Minutes before end when start is not given.")) -> Response:
    """Actual invocations per minute and the forecast issued ``horizon`` minutes before each minute.

    Without ``end``, the window ends after the last minute forecast ``horizon``
    minutes ahead from now, so the forecast runs past the last actual count;
    when the model has no count in the ``span_min`` minutes before now, it
    ends that way from the model's newest known count instead.
    """
    now = clock().astimezone(timezone.utc)
    try:
        with engine.connect() as conn:
            _require_model(conn, model_id)
            source = "request"
            if end is None:
                anchor, source = _anchor(conn, now, span_min * MINUTE, model_id)
                default_end = anchor + horizon * MINUTE
            else:
                default_end = None
            start, end = _window(start, end, default_end=default_end, default_span=span_min * MINUTE, now=now)
            series = read_forecast_series(conn, model_id=model_id, start=start, end=end, horizon_min=horizon)
    except OperationalError:
        raise _unavailable(settings) from None
    band = series.band
    body = SeriesPublic(
        model_id=model_id, start=start, end=end, horizon_min=horizon, t=series.minutes.tolist(),
        actual=finite_or_none(series.actual), forecast=finite_or_none(series.point),
        quantiles={level: finite_or_none(values) for level, values in series.quantiles.items()},
        p_any=finite_or_none(series.p_any), band=list(band) if band else None,
        error=ErrorPublic.of(series.error()), end_source=source,
    )
    # Encoded by pydantic-core directly: a week is ~50,000 numbers, which FastAPI's default path (validate
    # again, jsonable dict, json.dumps) takes ~60 ms to encode, model_dump_json ~2 ms (bench/dashboard.py).
    return Response(content=body.model_dump_json(), media_type="application/json")


@router.get("/models/{model_id}/coldstarts", response_model=ColdStartsPublic, responses=_UNKNOWN_MODEL)
async def get_cold_starts(model_id: str, request: Request, engine: EngineDep, settings: SettingsDep,
                          clock: ClockDep, _: ReadToken, start: datetime | None = _START,
                    end: datetime | None = Query(None, description="End, exclusive (UTC); default now (the "
                                                                   "newest known count when none is recent)."),
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
    now = clock().astimezone(timezone.utc)

    def read():
        with engine.connect() as conn:
            _require_model(conn, model_id)
            anchor = _anchor(conn, now, timedelta(days=1), model_id)[0] if end is None else None
            window = _window(start, end, default_end=anchor and anchor + MINUTE, default_span=timedelta(days=1),
                             now=now)
            return window, read_cold_starts(conn, model_id=model_id, start=window[0], end=window[1], limit=limit)

    try:
        (start, end), view = await run_in_threadpool(read)
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
            on_node = await run_in_threadpool(_node_lead_time, engine, settings, clock(), model_id, node,
                                              snapshot.held_latency)
        except OperationalError:
            raise _unavailable(settings) from None
        if on_node is None:
            raise HTTPException(status_code=404, detail=f"unknown node {node!r}")
        lead, state, source = on_node
        return ColdStartsPublic(
            model_id=model_id, start=start, end=end, observed=[ColdStartPublic(**e) for e in view.observed],
            predicted=view.predicted, predicted_stored=view.predicted_stored, lead_time_s=lead,
            lead_time_source=source, lead_time_start_state=state,
            latency_model_version=snapshot.latency_model_version, observed_median_s=view.lead_time_s,
            node_id=node,
            note=None if view.predicted_stored else "no cold-start predictions are stored; showing observed only")
    source = "default"
    if predicted:
        from api.coldstart_horizon import lead_source

        try:
            source = await run_in_threadpool(lead_source, engine, settings, clock(), model_id)
        except OperationalError:
            raise _unavailable(settings) from None
    return ColdStartsPublic(
        model_id=model_id, start=start, end=end, observed=[ColdStartPublic(**e) for e in view.observed],
        predicted=view.predicted, predicted_stored=view.predicted_stored,
        lead_time_s=model_view.lead_time_s if predicted else settings.default_cold_start_s,
        lead_time_source=source,
        lead_time_start_state=model_view.start_state if model_view is not None else None,
        latency_model_version=snapshot.latency_model_version, observed_median_s=view.lead_time_s,
        note=None if view.predicted_stored else "no cold-start predictions are stored; showing observed only",
    )


def _node_lead_time(engine, settings, now: datetime, model_id: str, node: str, held=None
                    ) -> tuple[float, str, str] | None:
    """(lead seconds, start state, source of the figures) of a start of ``model_id`` on ``node``; None when the fleet has no such node.

    The numbers of ``GET /v1/models/{id}/cold-start?node=`` (:func:`api.coldstart_horizon.predict_horizon`): the
    model's own rows and the node, not the fleet, read from the snapshot's held table where it answers for them
    (``held``), else the latency model called directly, so a per-model view never evicts the fleet's table from
    the service's cache.
    """
    from api.coldstart_horizon import predict_horizon

    horizon = predict_horizon(engine, settings, now, [model_id], node=node, held=held)
    if horizon is None:
        return None
    source = "latency_model" if horizon.source is None else str(horizon.source[model_id])
    return float(horizon.lead_time_s[model_id]), str(horizon.start_state[model_id]), source


@router.get("/models/{model_id}/actions", response_model=TimelinePublic, responses=_UNKNOWN_MODEL)
def get_action_timeline(model_id: str, engine: EngineDep, settings: SettingsDep, clock: ClockDep, _: ReadToken,
                        start: datetime | None = _START,
                        end: datetime | None = Query(None, description="End, exclusive (UTC); default an hour "
                                                                       "from now (planned actions)."),
                        limit: int = Query(5_000, ge=1, le=50_000)) -> TimelinePublic:
    """The model's actions whose ``[not_before, deadline]`` meets the window, oldest first."""
    now = clock().astimezone(timezone.utc)
    try:
        with engine.connect() as conn:
            _require_model(conn, model_id)
            anchor = _anchor(conn, now, timedelta(days=1), model_id)[0] if end is None else None
            start, end = _window(start, end, default_end=anchor and anchor + 61 * MINUTE,
                                 default_span=timedelta(days=1), now=now)
            rows, count = read_action_timeline(conn, model_id=model_id, start=start, end=end, limit=limit)
    except OperationalError:
        raise _unavailable(settings) from None
    return TimelinePublic(model_id=model_id, start=start, end=end,
                          data=[TimelineActionPublic(**r) for r in rows], count=count)


def _horizons(settings, stored: int | None) -> tuple[int, list[int]]:
    """(longest stored horizon, the horizons to offer): the ladder's up to it, and it."""
    return offered_horizons_min(stored, settings.forecast_horizon_min)


@router.get("/dashboard/context", response_model=DashboardContextPublic,
            responses={503: {"description": "Database unavailable: retry after the Retry-After seconds"}})
def get_dashboard_context(engine: EngineDep, settings: SettingsDep, clock: ClockDep,
                          _: ReadToken) -> DashboardContextPublic:
    """What the page offers: the stored horizons, and where the default fleet window ends (now, or the newest
    known count when nothing in the last hour is stored)."""
    now = clock().astimezone(timezone.utc)
    try:
        with engine.connect() as conn:
            anchor, source = _anchor(conn, now, 60 * MINUTE)
            newest = known_until(conn)
            stored = stored_horizon_min(conn)
    except OperationalError:
        raise _unavailable(settings) from None
    longest, offered = _horizons(settings, stored)
    return DashboardContextPublic(now=now, known_until=newest, default_end=anchor, end_source=source,
                                  stored_horizon_min=longest, horizons_min=offered)


@router.get("/fleet", response_model=FleetPublic,
            responses={503: {"description": "Database unavailable: retry after the Retry-After seconds"}})
def get_fleet(engine: EngineDep, settings: SettingsDep, clock: ClockDep, _: ReadToken,
              horizon: int = Query(5, ge=1, le=MAX_HORIZON_MIN, description="Minutes ahead."),
              window_min: int = Query(60, ge=1, le=7 * 24 * 60, description="Minutes before end to score."),
              end: datetime | None = Query(None, description="End of the window, exclusive (UTC); default the "
                                                             "current minute's start, or the newest known count "
                                                             "when none lies in the window before now."),
              sort: FleetSort = Query(FleetSort.WMAPE, description="Rank by this, largest first (model_id: "
                                                                   "ascending)."),
              search: str | None = Query(None, max_length=256, description="Only models whose id contains this, "
                                                                          "ignoring case."),
              limit: int = Query(50, ge=1, le=MAX_FLEET_PAGE, description="Rows per page."),
              offset: int = Query(0, ge=0, le=10_000_000, description="Rows of the ranking to skip."),
              error_end: datetime | None = Query(None, description="Where the error figures' window ends (a whole "
                                                 "hour: the start of end's hour or the hour before; needs end). A "
                                                 "later page passes the first page's end and error_end, so that "
                                                 "every page ranks over the same window; default: see error_end "
                                                 "in the answer.")
              ) -> FleetPublic:
    """One page of the registered models ranked by ``sort`` at ``horizon`` over the window; ``count`` is all.

    Without ``end`` each request's window ends at its own now: to page through one ranking, ask for the later
    pages with the first page's ``end`` and ``error_end`` (the dashboard does).
    """
    now = clock().astimezone(timezone.utc)
    if error_end is not None:
        if end is None:
            raise HTTPException(422, "error_end needs end (the first page's end and error_end, together)")
        error_end = _utc(error_end, "error_end", now)
    try:
        with engine.connect() as conn:
            follow_scored = end is None
            if end is None:
                end, source = _anchor(conn, now, window_min * MINUTE)
            else:
                end, source = _floor_minute(_utc(end, "end", now)), "request"
            if error_end is not None and error_end not in fleet_error_ends(end):
                allowed = " or ".join(e.isoformat() for e in fleet_error_ends(end))
                raise HTTPException(422, f"error_end must be {allowed} (the start of end's hour or the hour "
                                         f"before), got {error_end.isoformat()}")
            page = read_fleet_page(conn, end=end, window_min=window_min, horizon_min=horizon, sort=sort.value,
                                   search=search or None, limit=limit, offset=offset, follow_scored=follow_scored,
                                   error_end=error_end)
    except OperationalError:
        raise _unavailable(settings) from None
    data = [
        FleetRowPublic(rank=r.rank, model_id=r.model_id, error=ErrorPublic.of(r.error), actual_total=r.actual_total,
                       forecast_total=r.forecast_total, cold_starts=r.cold_starts, actions_total=r.actions_total,
                       actions_succeeded=r.actions_succeeded, actions_failed=r.actions_failed,
                       expected_wait_avoided_s=r.expected_wait_avoided_s, last_forecast_at=r.last_forecast_at,
                       replay=_replay_public(r.replay))
        for r in page.rows
    ]
    return FleetPublic(start=end - window_min * MINUTE, end=end, end_source=source, window_min=window_min,
                       horizon_min=horizon, sort=sort.value, error_start=page.error_start,
                       error_end=page.error_end, error_source=page.error_source, count=page.matching,
                       offset=offset, limit=limit, data=data)


def _replay_public(replay: dict | None) -> FleetReplayPublic | None:
    if not replay or "prewarm" not in replay or "reactive" not in replay:
        return None
    mine, theirs = replay["prewarm"], replay["reactive"]
    return FleetReplayPublic(prewarm=ReplayFiguresPublic(**mine), reactive=ReplayFiguresPublic(**theirs),
                             cold_requests_avoided=int(theirs["cold_requests"] - mine["cold_requests"]),
                             wait_saved_s=float(theirs["wait_total_s"] - mine["wait_total_s"]))
