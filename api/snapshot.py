"""An in-memory view of the newest forecast run per model, for the autoscaler-facing reads.

Autoscalers poll every model every few seconds (KEDA: every 30 s per
ScaledObject), so 10,000 models make hundreds of requests a second that all ask
the same thing until the next forecast run lands, once a minute. The snapshot
reads only runs newer than the last one it saw, keeps each model's newest run,
and answers from memory; when the database is unreachable it keeps answering
from what it holds, and says the answer is stale.

Each model's lead time is the planner's: the latency model's predicted start
from the warmest state the model is cached in on any node (``none`` when
uncached), plus the planner's margins (:func:`forecaster.planning.lead_time.lead_time_s`). The latency is
per node, reduced the way the planner reduces it (the nodes holding that state with room for a replica,
:func:`forecaster.planning.fleet.node_latency`), so the API's lead is the plan job's.

The catalogue, caches and lead times (the "fleet" part, the costly one: a latency table for every model) are
read again when a forecast run lands (once a minute), when the catalogue changes (count and newest ``updated_at`` of
``serving_models``), when the latency champion or the UTC hour changes, and at least every
:data:`FLEET_REFRESH_S`; between those, a refresh is one indexed probe for newer runs. With ``refresh_s == 0``
(tests) everything is read again on every request, as before. Whenever a model's view changes, its default
recommendation is prepared as bytes (:mod:`api.prepared`) for the hot path (:mod:`api.hotpath`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from api.prepared import PreparedRecommendation, fragments, prepare_recommendation

from forecaster.coldstart.service import latency_table, latency_version, prefetch_next_hour
from forecaster.contracts.latency import NodeLatencyTable
from forecaster.planning.fleet import PlannerSettings
from forecaster.planning.lead_time import lead_time_s
from forecaster.planning.recommendation import MinuteQuantiles
from forecaster.planning.step import planner_settings
from forecaster.settings import Settings
from forecaster.store.catalog import read_catalogue_sizes
from forecaster.store.forecasts import MAX_ISSUED_AHEAD_S, read_newest_runs
from forecaster.store.nodecache import warmest_cached_states

log = logging.getLogger(__name__)

#: Longest a request for a model not held waits for a refresh already running, s.
REFRESH_WAIT_S = 10.0
#: Longest the catalogue, node caches and lead times held go unread while nothing else says they changed, s.
#: Node caches and free GPUs change with the plan job's actions, once a minute, as forecast runs land (each of
#: which reads them again); this bound is for when no run lands. At 100,000 models one reading costs about
#: 1.3 s of CPU in each worker, all of it holding the GIL the event loop needs.
FLEET_REFRESH_S = 300.0
_CATALOGUE_PROBE = text("SELECT count(*), max(updated_at) FROM serving_models")


@dataclass
class ModelView:
    replica_rps: float | None = None  # what one replica serves at the model's burst factor (read_catalogue_sizes)
    lead_time_s: float | None = None  # the planner's lead time from the latency model (None: not computed)
    start_state: str | None = None  # the state a new replica would start from (warmest cached)
    forecast: MinuteQuantiles | None = None


def planner_settings_for(settings: Settings) -> PlannerSettings:
    """The planner settings whose lead margins the API applies: the plan job's own (``PREWARM_PLANNER_*``)."""
    return planner_settings(settings)


@dataclass(frozen=True)
class HeldLatencyTable:
    """The per-node latency table the snapshot's lead times came from, and what it was computed for.

    The cold-start horizon (``/metrics`` gauges, ``GET /v1/models/{id}/cold-start``) reads its models' rows from it
    instead of asking the latency model again (:func:`api.coldstart_horizon.predict_horizon` checks that the hour,
    the champion, the nodes and the models' sizes still match).
    """

    table: NodeLatencyTable
    hour_utc: int
    latency_model_version: str | None
    sizes: pd.DataFrame  # image_bytes, weights_bytes per model id, as the table was computed from


@dataclass
class ForecastSnapshot:
    """Newest forecast per model plus what a recommendation needs (replica_rps, the planner's lead time)."""

    engine: Engine
    refresh_s: float = 2.0
    settings: Settings | None = None  # models_dir of the latency model; default Settings()
    clock: Callable[[], datetime] | None = None  # the hour the latency model predicts for; default wall clock
    latency_model_version: str | None = None  # the latency model the lead times came from (None: the prior)
    held_latency: HeldLatencyTable | None = None  # the per-node table of those lead times (None: none per node)
    models: dict[str, ModelView] = field(default_factory=dict)
    #: Each model's default recommendation as bytes (None: only the full path answers it); replaced, not mutated.
    prepared: dict[str, PreparedRecommendation | None] = field(default_factory=dict)
    newest_issued_at: datetime | None = None  # the newest run loaded (never more than MAX_ISSUED_AHEAD_S ahead)
    healthy: bool = False  # the last refresh succeeded
    last_error: str | None = None  # why the last refresh failed (None: it succeeded)
    #: time.monotonic() of the last successful refresh (None: none yet)
    last_success: float | None = None
    #: runs issued up to this are loaded: the newest loaded run's issue time, but never past the clock at its load,
    #: so that a run stamped a little ahead (within MAX_ISSUED_AHEAD_S) hides no other model's later runs
    _cursor: datetime | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _refreshing: threading.Lock = field(default_factory=threading.Lock)
    _last_refresh: float = 0.0
    _fleet_read_at: float = float("-inf")
    _fleet_key: tuple | None = None
    _prepared_inputs: dict[str, tuple] = field(default_factory=dict)  # what each prepared body was made from

    def refresh(self, *, wait: bool = False) -> bool:
        """Load catalogue changes and forecast runs newer than the newest seen. False if the database is away.

        Single-flight: while one refresh runs, another caller returns at once with what is held; with
        ``wait`` (a request for a model not held: registered since?) it waits for that refresh to end, at most
        :data:`REFRESH_WAIT_S`, and then refreshes itself, so that a model registered through another worker
        is never answered 404 because the background refresh had started just before.
        """
        acquired = (self._refreshing.acquire(timeout=REFRESH_WAIT_S) if wait
                    else self._refreshing.acquire(blocking=False))
        if not acquired:
            return self.healthy
        try:
            return self._refresh()
        finally:
            self._refreshing.release()

    def _refresh(self) -> bool:
        """One refresh; any failure marks the snapshot unhealthy (answers say ``stale``, /readyz fails) and is
        logged, never raised: the refresher thread must outlive a pool timeout or a bug as well as a lost database."""
        try:
            return self._refresh_once()
        except OperationalError as exc:
            self.healthy, self.last_error = False, f"database unavailable: {type(exc.orig).__name__}"
            log.warning("forecast snapshot: database unavailable, serving what is held: %s", exc.orig)
        except Exception as exc:  # noqa: BLE001 - e.g. sqlalchemy.exc.TimeoutError (pool exhausted)
            self.healthy, self.last_error = False, f"refresh failed: {type(exc).__name__}: {exc}"[:300]
            log.exception("forecast snapshot: refresh failed, serving what is held")
        return False

    def _refresh_once(self) -> bool:
        settings = self.settings or Settings()
        now = (self.clock or (lambda: datetime.now(timezone.utc)))()
        catalogue = states = leads = None
        with self.engine.connect() as conn:
            # runs stamped further ahead of this clock than the tolerance are not loaded (a writer's clock was
            # ahead): loaded, they would be served as the newest until the clock caught up with them
            runs = _newer_runs(conn, self._cursor, until=now + timedelta(seconds=MAX_ISSUED_AHEAD_S))
            fleet_key = (tuple(conn.execute(_CATALOGUE_PROBE).one()), now.astimezone(timezone.utc).hour)
        # a run stamped a little ahead of this clock is read again until the clock passes it (the cursor stops at
        # the clock); one a model already holds is not news, and must not rebuild the fleet on every refresh
        runs = {model_id: run for model_id, run in runs.items()
                if (held := self.models.get(model_id)) is None or held.forecast is None
                or run.issued_at > held.forecast.issued_at}
        try:
            fleet_key += (latency_version(self.engine, settings),)
        except OperationalError:
            raise
        except Exception:  # noqa: BLE001 - a broken latency model must not stop forecasts being served
            fleet_key += ("unreadable",)
        if (self.refresh_s == 0 or runs or not self.healthy or fleet_key != self._fleet_key
                or time.monotonic() - self._fleet_read_at >= FLEET_REFRESH_S):
            with self.engine.connect() as conn:
                catalogue = read_catalogue_sizes(conn)
                states = warmest_cached_states(conn)
            leads = self._lead_times(catalogue, states)
        # Built aside and swapped in: a reader (the event loop's thread) never waits for a fleet's preparation.
        if catalogue is not None:
            known = {}
            lead_of = {} if leads is None else leads.to_dict()
            for model_id, replica_rps, _, _ in catalogue:
                view = self.models.get(model_id) or ModelView()
                view.replica_rps = replica_rps
                view.lead_time_s = None if leads is None else float(lead_of[model_id])
                view.start_state = states.get(model_id, "none")
                known[model_id] = view
            changed = None  # every model
        else:
            known, changed = self.models, set()
        newest, cursor = self.newest_issued_at, self._cursor
        for model_id, run in runs.items():
            held = known.get(model_id)
            if held is not None and (held.forecast is None or run.issued_at >= held.forecast.issued_at):
                held.forecast = run
                if changed is not None:
                    changed.add(model_id)
            newest = run.issued_at if newest is None else max(newest, run.issued_at)
            loaded_to = min(run.issued_at, now)
            cursor = loaded_to if cursor is None else max(cursor, loaded_to)
        prepared = self._prepare(known, changed, settings) if changed is None or changed else self.prepared
        with self._lock:
            self.models = known
            self.prepared = prepared
            self.newest_issued_at = newest
        self._cursor = cursor
        if catalogue is not None:
            self._fleet_key, self._fleet_read_at = fleet_key, time.monotonic()
        self.healthy, self.last_error = True, None
        self._last_refresh = self.last_success = time.monotonic()
        return True

    def readiness(self, now: datetime, fresh_s: float) -> tuple[bool, dict]:
        """Whether this process's own snapshot serves fresh forecasts: its last refresh succeeded, within
        ``fresh_s`` seconds, and its newest loaded run is at most ``fresh_s`` old (no run: ready only while no
        model is registered). The details say which check failed."""
        detail: dict[str, object] = {}
        ok = True
        if not self.healthy:
            ok = False
            detail["snapshot"] = self.last_error or "not loaded yet"
        elif self.last_success is not None and self.refresh_s > 0:
            since = time.monotonic() - self.last_success
            detail["snapshot_refreshed_s_ago"] = round(since, 1)
            if since > fresh_s:
                ok = False
                detail["snapshot"] = f"not refreshed for {since:.0f} s (more than {fresh_s:g} s)"
        if ok:
            detail["snapshot"] = "ok"
        newest = self.newest_issued_at
        if newest is None:
            with self._lock:
                registered = len(self.models)
            detail["forecasts"] = "none yet" if registered == 0 else "none yet for registered models"
            return ok and registered == 0, detail
        age_s = (now - newest).total_seconds()
        detail["forecast_age_s"] = round(age_s, 1)
        fresh = age_s <= fresh_s
        detail["forecasts"] = "fresh" if fresh else f"stale (older than {fresh_s:g} s)"
        return ok and fresh, detail

    def _prepare(self, models: dict[str, ModelView], changed, settings: Settings
                 ) -> dict[str, PreparedRecommendation | None]:
        """The prepared bodies, those of ``changed`` models (None: all) made again; a new dict, readers keep theirs."""
        prepared = {} if changed is None else dict(self.prepared)
        inputs = {} if changed is None else dict(self._prepared_inputs)
        shared = fragments()
        quantile, default_lead_s = settings.recommendation_quantile, settings.default_cold_start_s
        for i, model_id in enumerate(models if changed is None else changed):
            view = models.get(model_id)
            if view is None:
                continue
            lead_s = float(view.lead_time_s or default_lead_s)
            key = (view.forecast, lead_s, view.replica_rps)
            held = self._prepared_inputs.get(model_id)
            if held is not None and held[0] is key[0] and held[1:] == key[1:]:
                prepared[model_id] = self.prepared.get(model_id)  # the same inputs: the same bytes
            else:
                prepared[model_id] = prepare_recommendation(model_id, view.forecast, lead_time_s=lead_s,
                                                            replica_rps=view.replica_rps, quantile=quantile,
                                                            max_age_s=settings.forecast_fresh_s, fragments=shared)
            inputs[model_id] = key
            if i % 2000 == 1999:
                time.sleep(0)  # let the event loop's thread take the GIL between slices of a big fleet
        self._prepared_inputs = inputs
        return prepared

    def _lead_times(self, catalogue: list[tuple], states: dict[str, str]) -> pd.Series | None:
        """Per model, the planner's lead time from the latency champion (cached per version and hour; the next
        hour's table prefetched in the last minutes of an hour)."""
        if not catalogue:
            return pd.Series(dtype="float64")
        settings = self.settings or Settings()
        now = (self.clock or (lambda: datetime.now(timezone.utc)))()
        models = pd.DataFrame({"image_bytes": [float(r[2] or 0) for r in catalogue],
                               "weights_bytes": [float(r[3] or 0) for r in catalogue]},
                              index=pd.Index([r[0] for r in catalogue], name="model_id"))
        try:
            from forecaster.jobs.planning import fleet_from_store  # the plan job's own fleet, for its node choice

            fleet = fleet_from_store(self.engine, now=now, default_cold_cost=settings.planner_cold_cost)
            nodes = list(fleet.nodes.index.astype(str)) if len(fleet.nodes) else None
            hour = now.astimezone(timezone.utc).hour
            table = latency_table(self.engine, settings, models, hour=hour, nodes=nodes, now=now)
            self.latency_model_version = latency_version(self.engine, settings)
            self.held_latency = HeldLatencyTable(table, hour, self.latency_model_version, models) \
                if isinstance(table, NodeLatencyTable) else None
            # in an hour's last minutes, the next hour's table is built in the background: the refresh after
            # the hour turns then finds it (this process's cache; the plan job's when it runs here too)
            prefetch_next_hour(self.engine, settings, models, now=now, nodes=nodes)
        except OperationalError:
            raise
        except Exception:  # noqa: BLE001 - a broken latency model must not stop forecasts being served
            log.exception("latency model unavailable; lead times fall back to the default")
            self.held_latency = None
            return None
        return lead_time_s(table, states, planner_settings_for(settings), model_ids=models.index,
                           fleet=None if nodes is None else fleet)

    def refresh_if_due(self) -> None:
        if time.monotonic() - self._last_refresh >= self.refresh_s:
            self.refresh()

    def get(self, model_id: str) -> ModelView | None:
        with self._lock:
            return self.models.get(model_id)


def _newer_runs(conn, since: datetime | None, until: datetime | None = None) -> dict[str, MinuteQuantiles]:
    """Each model's newest run issued in ``(since, until]`` (``since`` None: all models' newest up to ``until``),
    streamed with COPY."""
    runs = read_newest_runs(conn, issued_after=since, issued_at_most=until)
    out = {}
    minutes_all = runs.target_minutes_s()
    for i, model_id in enumerate(runs.model_ids):
        lo, hi = runs.offsets[i], runs.offsets[i + 1]
        point = runs.point[lo:hi]
        known = ~np.isnan(point)
        levels = runs.levels[i]
        keep = [j for j, level in enumerate(levels) if 0.0 < level < 1.0]
        values = runs.quantiles(i)[:, keep] if len(keep) < len(levels) else runs.quantiles(i)
        if not known.all():  # NULL elements (runs converted from the row layout with gaps): no forecast there
            point, values = point[known], values[known]
        out[model_id] = MinuteQuantiles(
            issued_at=datetime.fromtimestamp(runs.issued_at_s[i], tz=timezone.utc),
            model_version_id=runs.model_version_ids[i],
            minutes_s=minutes_all[lo:hi][known], levels=tuple(levels[j] for j in keep), values=values, point=point)
    return out
