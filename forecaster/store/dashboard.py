"""Reads behind the dashboard: forecast vs actual per model, cold starts, the action timeline, the fleet ranking.

Horizon: as everywhere else in prewarm (``PREWARM_FORECAST_HORIZON_MIN``, the
forecast endpoint's ``horizon``, the planner's ``horizon_min``), a run's
element ``k`` (1-based) is the forecast ``k`` minutes ahead: its first target
minute is the minute the run was issued in, whose count is complete one
minute later (a run issued at 12:00:30 forecasts 12:00 at horizon 1 and 12:04
at horizon 5). A run of ``forecast_horizon_min`` = 60 elements therefore
holds horizons 1..60. So the forecast made ``h`` minutes ahead of minute
``t`` is element ``h`` of the run issued during minute ``t - (h - 1)``:
reading it for a week of target minutes reads one run per minute, found by a
range scan of the primary key (model_id, issued_at) over the days'
partitions, and takes one array element of each (:func:`_at_horizon_sql`).

Actual counts come from :func:`forecaster.store.invocations.read_counts`
semantics: a minute outside every source's coverage is unknown (NaN) and is
left out of every error figure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy import Connection, text

from forecaster.store.coldstarts import recent_cold_start_seconds
from forecaster.store.forecast_errors import HOUR, floor_hour, scored_hours
from forecaster.store.invocations import read_counts
from forecaster.store.replays import OUTCOME_COLUMNS
from forecaster.store.db import driver_errors

#: When an action happens on the timeline (planned start, else its last status change); indexed by 0003.
ACTION_TIME_SQL = "coalesce(not_before, updated_at)"
#: Actions that began this long before a window still show in it when their deadline falls inside.
ACTION_LOOKBACK = timedelta(days=1)

MINUTE = timedelta(minutes=1)


def model_exists(conn: Connection, *, model_id: str) -> bool:
    return conn.execute(text("SELECT 1 FROM serving_models WHERE id = :m"), {"m": model_id}).first() is not None


def _at_horizon_sql(where: str, param: Callable[[str], str]) -> str:
    """Runs issued in ``[lo, hi)`` (and matching ``where``), each with the element it forecast ``h`` minutes ahead.

    Columns: ``model_id``, ``target_minute`` (the issuing minute plus ``h - 1``
    minutes; ``target_s`` the same in Unix seconds), ``issued_at``, ``k``
    (1-based element), ``point_at`` (``point[k]`` as double precision),
    ``p_any_at`` (``p_any[k]``, NULL where the run stored none or NaN), and the run's
    ``quantile_levels`` and ``quantiles``. Runs that do not reach
    that far are left out. With ``lo``/``hi`` from :func:`_issued_bounds`,
    exactly the runs whose target minute falls in the window qualify, so the
    planner estimates the rows from ``issued_at`` alone. ``param`` spells a
    bind parameter (``:h`` for SQLAlchemy, ``%(h)s`` for psycopg).
    """
    # integer seconds (date_part is double precision): numeric arithmetic would cost microseconds per run;
    # horizon h is element h (1-based), the issuing minute plus h - 1 minutes (module docstring)
    target_s = (f"CAST(floor(date_part('epoch', f.issued_at) / 60) AS bigint) * 60 "
                f"+ 60 * (CAST({param('h')} AS bigint) - 1)")
    offset_s = f"({target_s} - CAST(date_part('epoch', f.first_target) AS bigint))"
    return f"""
        SELECT r.model_id, to_timestamp(r.target_s) AS target_minute, r.target_s, r.issued_at, r.k,
               CAST(r.point[r.k] AS double precision) AS point_at,
               nullif(CAST(r.p_any[r.k] AS double precision), 'NaN') AS p_any_at, r.quantile_levels, r.quantiles
        FROM (SELECT f.model_id, f.issued_at, f.point, f.p_any, f.quantile_levels, f.quantiles,
                     {target_s} AS target_s,
                     CASE WHEN mod({offset_s}, f.step_seconds) = 0
                          THEN CAST({offset_s} / f.step_seconds AS integer) + 1 END AS k
              FROM forecasts f
              WHERE {where} f.issued_at >= {param("lo")} AND f.issued_at < {param("hi")}) r
        WHERE r.point[r.k] IS NOT NULL"""


def _issued_bounds(start: datetime, end: datetime, horizon_min: int) -> dict:
    """``lo``/``hi``: the runs issued in ``[lo, hi)`` are those that target minutes of ``[start, end)`` ``horizon_min`` ahead.

    A run issued during minute ``m`` targets ``m + horizon - 1`` at ``horizon``;
    target minutes are whole minutes, so the window's bounds round up to one.
    """
    first, stop = (t if t == t.replace(second=0, microsecond=0) else t.replace(second=0, microsecond=0) + MINUTE
                   for t in (start, end))
    back = (horizon_min - 1) * MINUTE
    return {"lo": first - back, "hi": stop - back}


#: Per target minute: the forecast made ``h`` minutes ahead (the later run of a minute wins).
#: psycopg placeholders: it is run on a binary cursor, which parses the arrays twice as fast as text.
_SERIES_SQL = f"""
SELECT DISTINCT ON (target_s) target_s, point_at, CAST(quantile_levels AS text[]), quantiles[:][k:k], p_any_at
FROM ({_at_horizon_sql("f.model_id = %(m)s AND", lambda name: f"%({name})s")}) x
ORDER BY target_s, issued_at DESC
"""


@dataclass(frozen=True)
class ForecastError:
    """Forecast error over the minutes where both the forecast and the actual count are known.

    Attributes:
        scored_minutes: minutes that entered the figures.
        mae: mean absolute error (invocations per minute); None with no scored minute.
        wmape: sum of absolute errors over sum of actuals; None when the actuals sum to zero.
        band_coverage: share of scored minutes whose actual lies inside the widest stored quantile band.
        p_any_minutes: scored minutes whose run also stored ``p_any`` (the probability of any invocation);
            the three figures below are over these minutes, None with none.
        brier_any: Brier score of ``p_any`` against "any invocation in the minute": the mean of
            ``(p_any - [actual > 0])^2``. For a sparse model the planner's warm/cold decision rests on ``p_any``
            more than on the point forecast; ``invoked_share * (1 - invoked_share)`` is the score of a constant
            forecast that knew the window's share in advance.
        p_any_mean: mean ``p_any``; against ``invoked_share``, the share of those minutes with an invocation,
            it says whether ``p_any`` runs high or low.
    """

    scored_minutes: int
    mae: float | None
    wmape: float | None
    band_coverage: float | None = None
    p_any_minutes: int = 0
    brier_any: float | None = None
    p_any_mean: float | None = None
    invoked_share: float | None = None

    @classmethod
    def from_sums(cls, scored_minutes, abs_error, actual, p_any_minutes=0, p_any_sq_error=0.0, p_any_sum=0.0,
                  invoked_minutes=0) -> "ForecastError":
        """The figures from the rollup's sums (:class:`~forecaster.store.forecast_errors.ErrorSums`'s columns;
        SQL sums may be NULL, read as 0)."""
        n, p_n = int(scored_minutes or 0), int(p_any_minutes or 0)
        abs_error, actual = float(abs_error or 0.0), float(actual or 0.0)
        return cls(scored_minutes=n, mae=abs_error / n if n else None,
                   wmape=abs_error / actual if n and actual > 0 else None, p_any_minutes=p_n,
                   brier_any=float(p_any_sq_error or 0.0) / p_n if p_n else None,
                   p_any_mean=float(p_any_sum or 0.0) / p_n if p_n else None,
                   invoked_share=float(invoked_minutes or 0) / p_n if p_n else None)


def forecast_error(actual: np.ndarray, point: np.ndarray, lo: np.ndarray | None = None,
                   hi: np.ndarray | None = None, p_any: np.ndarray | None = None) -> ForecastError:
    """MAE, wMAPE and band coverage over the positions where ``actual`` and ``point`` are both known; with
    ``p_any``, its Brier score, mean and the invoked share over those of them where ``p_any`` is known too."""
    known = ~np.isnan(actual) & ~np.isnan(point)
    n = int(known.sum())
    if n == 0:
        return ForecastError(0, None, None, None)
    abs_err = np.abs(point[known] - actual[known])
    total = float(actual[known].sum())
    coverage = None
    if lo is not None and hi is not None:
        inside = (actual[known] >= lo[known]) & (actual[known] <= hi[known])
        coverage = float(inside.mean())
    any_figures = {}
    scored = known & ~np.isnan(p_any) if p_any is not None else np.zeros_like(known)
    if scored.any():
        p, invoked = p_any[scored], (actual[scored] > 0).astype(np.float64)
        any_figures = {"p_any_minutes": int(scored.sum()), "brier_any": float(np.mean((p - invoked) ** 2)),
                       "p_any_mean": float(p.mean()), "invoked_share": float(invoked.mean())}
    return ForecastError(n, float(abs_err.mean()), float(abs_err.sum()) / total if total > 0 else None, coverage,
                         **any_figures)


def _is_level(key: str) -> bool:
    try:
        return 0.0 < float(key) < 1.0
    except ValueError:
        return False


@dataclass(frozen=True)
class ForecastSeries:
    """One model's actual and forecast per minute over ``[start, end)`` at one horizon.

    Arrays are aligned on ``minutes`` (Unix seconds, one per minute); NaN marks
    an unknown actual or a minute with no forecast at that horizon.
    """

    model_id: str
    start: datetime
    end: datetime
    horizon_min: int
    minutes: np.ndarray
    actual: np.ndarray
    point: np.ndarray
    quantiles: dict[str, np.ndarray] = field(default_factory=dict)  # level ("0.9") -> values
    p_any: np.ndarray | None = None  # probability of any invocation, NaN where the run stored none

    @property
    def band(self) -> tuple[str, str] | None:
        """The central band the dashboard draws: the lowest level and its mirror (0.1 and 0.9), or None.

        With the stored levels 0.1, 0.5, 0.9, 0.95, 0.99 that is the 80% band
        (q0.95 and q0.99 are the planner's sizing levels, not a band). Without
        a mirrored pair, the widest stored band (lowest and highest level);
        None with fewer than two levels.
        """
        if len(self.quantiles) < 2:
            return None
        levels = sorted(self.quantiles, key=float)
        low = float(levels[0])
        mirror = [level for level in levels[1:] if abs(float(level) - (1.0 - low)) < 1e-6 and float(level) > low]
        return levels[0], (mirror[0] if mirror else levels[-1])

    def error(self) -> ForecastError:
        band = self.band
        if band is None:
            return forecast_error(self.actual, self.point, p_any=self.p_any)
        return forecast_error(self.actual, self.point, self.quantiles[band[0]], self.quantiles[band[1]],
                              p_any=self.p_any)


def read_forecast_series(conn: Connection, *, model_id: str, start: datetime, end: datetime,
                         horizon_min: int) -> ForecastSeries:
    """Actual counts and the forecast made ``horizon_min`` minutes ahead, per minute of ``[start, end)``.

    Args:
        conn: an open connection.
        model_id: the serving model.
        start: first minute (UTC, whole minute).
        end: end of the window, exclusive (UTC, whole minute).
        horizon_min: minutes ahead, 1 = the minute the run was issued in (module docstring).

    When two runs were issued in the same minute, the later one counts.
    """
    n = int((end - start) / MINUTE)
    origin = start.timestamp()
    minutes = origin + 60.0 * np.arange(n)
    counts = read_counts(conn, [model_id], start, end)
    actual = counts["y"].to_numpy(dtype="float64")
    with driver_errors(conn, _SERIES_SQL), conn.connection.driver_connection.cursor(binary=True) as cur:
        cur.execute(_SERIES_SQL, {"m": model_id, "h": horizon_min, **_issued_bounds(start, end, horizon_min)})
        rows = cur.fetchall()
    point = np.full(n, np.nan)
    p_any = np.full(n, np.nan)
    quantiles: dict[str, np.ndarray] = {}
    if rows:
        index = np.rint((np.array([r[0] for r in rows], dtype=np.float64) - origin) / 60.0).astype(np.int64)
        inside = (index >= 0) & (index < n)  # defensive: the query keeps targets inside the window
        point[index[inside]] = np.array([r[1] for r in rows], dtype=np.float64)[inside]
        p_any[index[inside]] = np.array([np.nan if r[4] is None else r[4] for r in rows], dtype=np.float64)[inside]
        by_levels: dict[tuple[str, ...], list[int]] = {}
        for j, row in enumerate(rows):  # runs share their levels, as a rule: one group
            by_levels.setdefault(tuple(row[2] or ()), []).append(j)
        for levels, members in by_levels.items():
            members = np.asarray(members)[inside[members]]
            if not levels or not len(members):
                continue
            # (runs, levels) from each run's [[q_level1], [q_level2], ...]; NULL elements become NaN
            values = np.array([rows[j][3] for j in members], dtype=np.float64).reshape(len(members), len(levels))
            for column, level in enumerate(levels):
                if not _is_level(level):
                    continue  # not a quantile level ("0.9"): nothing to draw it as
                quantiles.setdefault(level, np.full(n, np.nan))[index[members]] = values[:, column]
    return ForecastSeries(model_id=model_id, start=start, end=end, horizon_min=horizon_min,
                          minutes=minutes.astype(np.int64), actual=actual, point=point,
                          quantiles=dict(sorted(quantiles.items(), key=lambda kv: float(kv[0]))), p_any=p_any)


@dataclass(frozen=True)
class ColdStartView:
    """Observed cold starts in a window, and predicted ones when the store holds any.

    Attributes:
        observed: one dict per event (``started_at``, ``node_id``, ``total_seconds``, phases, ``cache_state``).
        predicted: stored predictions; empty while nothing stores them.
        predicted_stored: False when the store has no cold-start predictions at all.
        lead_time_s: median total seconds of the model's last 20 observed cold starts, or None when none was
            observed (shown beside the lead time, which comes from the latency model; see
            :mod:`forecaster.planning.lead_time`).
    """

    observed: list[dict]
    predicted: list[dict]
    predicted_stored: bool
    lead_time_s: float | None


COLD_START_COLUMNS = ("started_at", "node_id", "total_seconds", "image_pull_s", "weight_fetch_s", "weight_load_s",
                      "runtime_init_s", "registration_s", "cache_state", "source")


def read_cold_starts(conn: Connection, *, model_id: str, start: datetime, end: datetime,
                     limit: int = 10_000) -> ColdStartView:
    """Cold starts of ``model_id`` that began in ``[start, end)``, oldest first (at most ``limit``).

    No table holds predicted cold starts yet (the latency model of the planning
    work does not store its predictions), so ``predicted`` is empty and
    ``predicted_stored`` False; callers say so rather than draw nothing.
    """
    rows = conn.execute(
        text(f"SELECT {', '.join(COLD_START_COLUMNS)} FROM cold_starts "
             "WHERE model_id = :m AND started_at >= :s AND started_at < :e ORDER BY started_at, node_id LIMIT :n"),
        {"m": model_id, "s": start, "e": end, "n": limit},
    ).mappings().all()
    lead = recent_cold_start_seconds(conn, model_id=model_id)
    return ColdStartView(observed=[dict(r) for r in rows], predicted=[], predicted_stored=False,
                         lead_time_s=None if lead is None else float(lead))


ACTION_COLUMNS = ("id", "plan_id", "kind", "node_id", "target", "spec", "not_before", "deadline", "reason",
                  "expected_benefit", "expected_cost", "status", "status_reason", "attempts", "updated_at")


def read_action_timeline(conn: Connection, *, model_id: str, start: datetime, end: datetime,
                         limit: int = 5_000) -> tuple[list[dict], int]:
    """Actions of ``model_id`` whose span ``[not_before, deadline]`` meets ``[start, end)``, oldest first.

    An action without ``not_before`` sits at its ``updated_at``. Actions that
    began more than :data:`ACTION_LOOKBACK` before ``start`` are not looked at.

    Returns:
        (up to ``limit`` actions as dicts, how many matched in all).
    """
    where = (f"WHERE model_id = :m AND {ACTION_TIME_SQL} >= :lookback AND {ACTION_TIME_SQL} < :e "
             "AND coalesce(deadline, not_before, updated_at) >= :s")
    params = {"m": model_id, "s": start, "e": end, "lookback": start - ACTION_LOOKBACK}
    rows = conn.execute(
        text(f"SELECT {', '.join(ACTION_COLUMNS)} FROM actions {where} ORDER BY {ACTION_TIME_SQL}, id LIMIT :n"),
        {**params, "n": limit},
    ).mappings().all()
    total = len(rows) if len(rows) < limit else conn.execute(text(f"SELECT count(*) FROM actions {where}"),
                                                             params).scalar_one()
    return [dict(r) for r in rows], total


#: Sort keys of the fleet ranking (largest first; ``model_id`` ascending by code point).
FLEET_SORTS = ("wmape", "mae", "brier_any", "cold_starts", "actions_succeeded", "cold_requests_avoided",
               "wait_saved_s", "model_id")
#: The newest replay (``replays``), its subject and baseline policy.
_REPLAY_SQL = "SELECT id, policies->>0 AS subject, policies->>1 AS baseline FROM replays " \
              "ORDER BY created_at DESC, id DESC LIMIT 1"


def _err_sql(only_page: bool) -> str:
    """Per model: scored minutes, sum |error|, sum actual, sum forecast at ``:h`` over ``[:es, :ee)``, and over
    those minutes whose run stored ``p_any`` how many, the sum of ``(p_any - [actual > 0])^2``, the sum of
    ``p_any`` and how many had an invocation; from the runs.

    The forecasts at the horizon are read for the whole fleet at once (``only_page`` False): the window's runs
    lie together in the newest pages, which one scan reads once. With ``only_page`` only the models of
    ``:ids`` are read, each by its primary key range. :func:`_rollup_err_sql` gives the same figures from the
    error rollup.
    """
    ids = "model_id = ANY(:ids) AND" if only_page else ""
    if only_page:  # a page's minutes: one primary-key probe each (the planner misjudges range_agg's rows)
        counts = ("LEFT JOIN LATERAL (SELECT sum(count) AS count FROM invocations WHERE model_id = f.model_id "
                  "AND minute = f.target_minute) i ON true")
    else:  # the fleet's: one range read of the window's counts, merged with the forecast minutes
        counts = ("LEFT JOIN (SELECT model_id, minute, sum(count) AS count FROM invocations "
                  "WHERE minute >= :es AND minute < :ee GROUP BY model_id, minute) i "
                  "ON i.model_id = f.model_id AND i.minute = f.target_minute")
    return f"""
cov AS (
    SELECT model_id, range_agg(ranges) AS ranges FROM coverage
    WHERE {ids} 60 % step_seconds = 0 AND ranges && tstzrange(:es, :ee, '[)') GROUP BY model_id
), f AS MATERIALIZED (
    SELECT DISTINCT ON (model_id, target_minute) model_id, target_minute, point_at AS point, p_any_at AS p_any
    FROM ({_at_horizon_sql("f.model_id = ANY(:ids) AND" if only_page else "", lambda name: f":{name}")}) x
    ORDER BY model_id, target_minute, issued_at DESC
), err AS (
    SELECT f.model_id, count(*) AS n, sum(abs(f.point - coalesce(i.count, 0))) AS abs_err,
           sum(coalesce(i.count, 0)) AS actual, sum(f.point) AS forecast, count(f.p_any) AS p_n,
           sum((f.p_any - CASE WHEN coalesce(i.count, 0) > 0 THEN 1 ELSE 0 END) ^ 2) AS p_sq,
           sum(f.p_any) AS p_sum, count(f.p_any) FILTER (WHERE coalesce(i.count, 0) > 0) AS p_invoked
    FROM f JOIN cov ON cov.model_id = f.model_id
    {counts}
    WHERE cov.ranges @> tstzrange(f.target_minute, f.target_minute + interval '1 minute', '[)')
    GROUP BY f.model_id
)"""


def _rollup_err_sql(only_page: bool) -> str:
    """The CTE ``err`` of :func:`_err_sql` (same columns, same values) summed from the rollup's hours.

    ``[:es, :ee)`` must be whole hours that :mod:`forecaster.store.forecast_errors` scored at ``:h``.
    """
    ids = " AND model_id = ANY(:ids)" if only_page else ""
    return ("err AS (SELECT model_id, sum(scored_minutes) AS n, sum(abs_error) AS abs_err, sum(actual) AS actual, "
            "sum(forecast) AS forecast, sum(p_any_minutes) AS p_n, sum(p_any_sq_error) AS p_sq, "
            "sum(p_any_sum) AS p_sum, sum(invoked_minutes) AS p_invoked FROM forecast_errors "
            f"WHERE horizon_min = :h AND hour >= :es AND hour < :ee{ids} GROUP BY model_id)")


#: Where the error figures come from: the rollup's hours, or the runs read minute by minute.
ERROR_SOURCES = ("rollup", "runs")


def _replay_gain_sql(column: str) -> str:
    """CTE ``ro``: per model, the newest replay's baseline ``column`` minus its subject's (what prewarm saved)."""
    return (f"rp AS ({_REPLAY_SQL}), ro AS (SELECT o.model_id, "
            f"sum(CASE WHEN o.policy = rp.baseline THEN o.{column} ELSE -o.{column} END) AS v "
            "FROM replay_outcomes o JOIN rp ON o.replay_id = rp.id AND o.policy IN (rp.subject, rp.baseline) "
            "GROUP BY o.model_id)")


_WMAPE = "CASE WHEN err.n > 0 AND err.actual > 0 THEN err.abs_err / err.actual END"
_MAE = "CASE WHEN err.n > 0 THEN err.abs_err / err.n END"
_BRIER = "CASE WHEN err.p_n > 0 THEN err.p_sq / err.p_n END"

def _rank(sort: str, source: str) -> tuple[str, str, str]:
    """Per sort key: the CTEs it needs (after WITH), the join onto ``serving_models m``, and the ORDER BY.

    Largest first, models with nothing to rank by last, then by MAE (error sorts), then by id.
    """
    err = _rollup_err_sql(False) if source == "rollup" else _err_sql(False)
    return {
        "wmape": (err, "LEFT JOIN err ON err.model_id = m.id",
                  f"({_WMAPE}) IS NULL, ({_WMAPE}) DESC, coalesce({_MAE}, 0) DESC"),
        "mae": (err, "LEFT JOIN err ON err.model_id = m.id", f"({_MAE}) IS NULL, ({_MAE}) DESC"),
        "brier_any": (err, "LEFT JOIN err ON err.model_id = m.id",
                      f"({_BRIER}) IS NULL, ({_BRIER}) DESC, coalesce({_MAE}, 0) DESC"),
        "cold_starts": (("cs AS (SELECT model_id, count(*) AS n FROM cold_starts "
                         "WHERE started_at >= :s AND started_at < :e GROUP BY model_id)"),
                        "LEFT JOIN cs ON cs.model_id = m.id", "coalesce(cs.n, 0) DESC"),
        "actions_succeeded": ((f"ac AS (SELECT model_id, count(*) AS n FROM actions WHERE status = 'succeeded' "
                               f"AND {ACTION_TIME_SQL} >= :s AND {ACTION_TIME_SQL} < :e GROUP BY model_id)"),
                              "LEFT JOIN ac ON ac.model_id = m.id", "coalesce(ac.n, 0) DESC"),
        "cold_requests_avoided": (_replay_gain_sql("cold_requests"), "LEFT JOIN ro ON ro.model_id = m.id",
                                  "ro.v IS NULL, ro.v DESC"),
        "wait_saved_s": (_replay_gain_sql("wait_total_s"), "LEFT JOIN ro ON ro.model_id = m.id",
                         "ro.v IS NULL, ro.v DESC"),
        "model_id": ("", "", ""),
    }[sort]


#: Sorts that count a window's rows of every model (cold starts, succeeded actions): hundreds of thousands of
#: rows grouped by model at fleet scale.
_COUNT_SORTS = ("cold_starts", "actions_succeeded")
#: Planner settings for those rankings (transaction-local, restored after the query):
#: * no parallel worker: PostgreSQL plans the count with one worker that repeats the whole aggregate and hash
#:   (a non-parallel-aware hash join), so the second core buys nothing and, on shared cores, costs as much again;
#: * ``work_mem`` 64 MB: 100,000 groups overflow the default 4 MB into batches on disk;
#: * ``random_page_cost`` 1.1 (the usual figure for SSD or cached data; the default 4 prices spinning disks):
#:   with 4 the planner prefers a sequential scan of the whole table to the index-only scans of
#:   ``cold_starts_model_time`` (model order: a streaming count merged with ``serving_models``, no hash) and of
#:   0011's ``actions_succeeded_time_model``, which are faster on the fleet's hot pages.
#: Measured at 100,000 models (500,000 cold starts and 400,000 succeeded actions in the window, 2 cores,
#: bench/dashboard.py's database): the ranking query from 136 to 67 ms (cold starts) and 172 to 133 ms
#: (succeeded actions), medians of 7.
_COUNT_SORT_SETTINGS = {"max_parallel_workers_per_gather": "0", "work_mem": "64MB", "random_page_cost": "1.1"}


@contextmanager
def _local_settings(conn: Connection, settings: dict[str, str]) -> Iterator[None]:
    """Run the block with ``settings`` set for the current transaction, then put the previous values back."""
    previous = {name: conn.execute(text("SELECT current_setting(:n)"), {"n": name}).scalar_one()
                for name in settings}
    for name, value in settings.items():
        conn.execute(text("SELECT set_config(:n, :v, true)"), {"n": name, "v": value})
    try:
        yield
    finally:
        for name, value in previous.items():
            conn.execute(text("SELECT set_config(:n, :v, true)"), {"n": name, "v": value})


def _rank_sql(sort: str, source: str, searched: bool) -> str:
    """``id, rank, matching`` of one page of the fleet ranked by ``sort`` (rank over every model).

    Without a search the page is the ranking's rows ``[:o, :o + :n)`` (``id`` only): a bounded top-N sort,
    whose ranks the caller counts from the offset. With one the whole fleet is ranked first (the
    rank stays the model's place in the fleet), then filtered: ids containing ``:q``, ignoring case, both sides
    lower-cased by PostgreSQL (the query lower-cased in Python missed ids whose case PostgreSQL maps otherwise:
    a final sigma, the dotted capital I).
    """
    ctes, join, order = _rank(sort, source)
    order = f"{order}, m.id COLLATE \"C\"" if order else "m.id COLLATE \"C\""
    with_ctes = "WITH " + ctes if ctes else ""
    if not searched:
        return f"""
{with_ctes}
SELECT m.id FROM serving_models m {join} ORDER BY {order} LIMIT :n OFFSET :o"""
    return f"""
{with_ctes}
SELECT id, rank, count(*) OVER () AS matching FROM (
    SELECT m.id, row_number() OVER (ORDER BY {order}) AS rank FROM serving_models m {join}
) ranked
WHERE strpos(lower(id), lower(:q)) > 0
ORDER BY rank LIMIT :n OFFSET :o"""


def _page_sql(source: str) -> str:
    """The figures of the page's models (``:ids``): error, cold starts, actions, newest forecast."""
    return f"""
WITH {_rollup_err_sql(True) if source == "rollup" else _err_sql(True)}
SELECT m.id, err.n, err.abs_err, err.actual, err.forecast, err.p_n, err.p_sq, err.p_sum, err.p_invoked,
       cs.n AS cold_starts,
       ac.total, ac.succeeded, ac.failed, ac.benefit, lf.issued_at
FROM serving_models m
LEFT JOIN err ON err.model_id = m.id
LEFT JOIN LATERAL (
    SELECT count(*) AS n FROM cold_starts c WHERE c.model_id = m.id AND c.started_at >= :s AND c.started_at < :e
) cs ON true
LEFT JOIN LATERAL (
    SELECT count(*) AS total, count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE status IN ('failed', 'dropped')) AS failed,
           coalesce(sum(expected_benefit) FILTER (WHERE status = 'succeeded'), 0) AS benefit
    FROM actions a WHERE a.model_id = m.id AND {ACTION_TIME_SQL} >= :s AND {ACTION_TIME_SQL} < :e
) ac ON true
LEFT JOIN LATERAL (
    SELECT issued_at FROM forecasts f WHERE f.model_id = m.id ORDER BY issued_at DESC LIMIT 1
) lf ON true
WHERE m.id = ANY(:ids)
"""


#: The newest replay's figures for the page's models, per policy.
_PAGE_REPLAY_SQL = f"""
WITH rp AS ({_REPLAY_SQL})
SELECT o.model_id, o.policy = rp.subject AS is_subject, {", ".join("o." + c for c in OUTCOME_COLUMNS)}
FROM replay_outcomes o JOIN rp ON o.replay_id = rp.id AND o.policy IN (rp.subject, rp.baseline)
WHERE o.model_id = ANY(:ids)
"""


@dataclass(frozen=True)
class FleetRow:
    """One model's forecast error and pre-warm record over the fleet window.

    Attributes:
        model_id: the serving model.
        rank: position in the whole fleet by the page's sort key (1 = first), before any search.
        error: forecast error at the window's horizon (MAE, wMAPE, p_any's figures; band coverage not computed here).
        actual_total: invocations in the scored minutes.
        forecast_total: forecast invocations in the scored minutes.
        cold_starts: observed cold starts that began in the window.
        actions_total: actions planned in the window (by :data:`ACTION_TIME_SQL`).
        actions_succeeded: of those, succeeded.
        actions_failed: of those, failed or dropped.
        expected_wait_avoided_s: the planner's expected cold-start seconds avoided by the succeeded actions.
        last_forecast_at: when the model's newest forecast was issued (any time), or None.
        replay: the newest replay's figures, ``{"prewarm": {...}, "reactive": {...}}`` by role (subject,
            baseline) with :data:`OUTCOME_COLUMNS`; None when the replay has no row for the model.
    """

    model_id: str
    rank: int
    error: ForecastError
    actual_total: float
    forecast_total: float
    cold_starts: int
    actions_total: int
    actions_succeeded: int
    actions_failed: int
    expected_wait_avoided_s: float
    last_forecast_at: datetime | None
    replay: dict | None = None


@dataclass(frozen=True)
class FleetPage:
    """One page of the fleet ranking: its rows, how many models match the search, and where errors come from.

    Attributes:
        rows: the page.
        matching: models matching the search in all.
        error_start: first hour of the error figures' window (UTC).
        error_end: end of that window, exclusive: whole hours (see :func:`error_window`).
        error_source: ``rollup`` (the scored hours of :mod:`forecaster.store.forecast_errors`) or ``runs``
            (read from the forecast runs minute by minute: a horizon or an hour the rollup does not hold).
    """

    rows: list[FleetRow]
    matching: int
    error_start: datetime | None = None
    error_end: datetime | None = None
    error_source: str = "runs"


def error_window(end: datetime, window_min: int) -> tuple[datetime, datetime]:
    """The whole hours the fleet's error figures cover for a window of ``window_min`` minutes ending at ``end``.

    The window is snapped to hours: it ends at the start of ``end``'s hour and spans ``window_min`` minutes
    rounded up to whole hours (at least one), so the figures are sums of the rollup's hours. A window ending
    at 12:37 scores 11:00-12:00 (60 minutes) or 06:00-12:00 (360 minutes); the hour in progress is never in
    it (its counts are not complete).
    """
    error_end = floor_hour(end)
    return error_end - max(1, math.ceil(window_min / 60)) * HOUR, error_end


def fleet_error_ends(end: datetime) -> tuple[datetime, datetime]:
    """Where a fleet page's error window may end for a window ending at ``end``: the start of ``end``'s hour
    (:func:`error_window`), or the hour before (``follow_scored``, while that hour is not scored yet)."""
    error_end = floor_hour(end)
    return error_end, error_end - HOUR


@dataclass(frozen=True)
class FleetHourError:
    """The whole fleet's forecast error over one scored hour at one horizon (the rollup's sums over models).

    ``error`` pools every model's minutes: its wMAPE is the fleet's sum of absolute errors over the fleet's
    sum of counts (busy models weigh most), its Brier score the mean over every scored model-minute with a
    ``p_any`` (sparse models weigh as much a minute as busy ones), and ``p_any_mean`` against
    ``invoked_share`` says whether the fleet's ``p_any`` runs high or low in that hour.
    """

    hour: datetime
    scored_at: datetime
    horizon_min: int
    models: int  # models with a scored minute in the hour
    error: ForecastError


def newest_scored_hour(conn: Connection) -> tuple[datetime, datetime] | None:
    """(hour, when it was scored) of the newest hour in the error rollup, or None before the first."""
    row = conn.execute(text("SELECT hour, scored_at FROM forecast_error_hours ORDER BY hour DESC LIMIT 1")).first()
    return None if row is None else (row[0], row[1])


def fleet_hour_errors(conn: Connection, *, hour: datetime) -> list[FleetHourError]:
    """The fleet's error at each horizon the rollup scored ``hour`` at (in horizon order; none for a horizon no
    model was scored at). One index range of the rollup per horizon: about 10^5 rows at 100,000 models."""
    rows = conn.execute(text("""
        SELECT h.hour, h.scored_at, e.horizon_min, count(*) FILTER (WHERE e.scored_minutes > 0),
               sum(e.scored_minutes), sum(e.abs_error),
               sum(e.actual), sum(e.p_any_minutes), sum(e.p_any_sq_error), sum(e.p_any_sum), sum(e.invoked_minutes)
        FROM forecast_error_hours h JOIN forecast_errors e ON e.hour = h.hour AND e.horizon_min = ANY(h.horizons_min)
        WHERE h.hour = :hour GROUP BY h.hour, h.scored_at, e.horizon_min ORDER BY e.horizon_min"""),
        {"hour": hour}).all()
    return [FleetHourError(hour=r[0], scored_at=r[1], horizon_min=int(r[2]), models=int(r[3]),
                           error=ForecastError.from_sums(*r[4:])) for r in rows]


#: Upper edges of the bands of a model-hour's mean ``p_any`` that :func:`p_any_bands` pools by (the last band ends
#: at 1): a reliability table read off the forecast, not the outcome, so that sparse models are checked apart from
#: the busy ones that dominate any fleet-wide mean.
P_ANY_BAND_EDGES = (0.02, 0.1, 0.3)


def p_any_band_names() -> list[str]:
    """``"0-0.02"``, ``"0.02-0.1"``, ``"0.1-0.3"``, ``"0.3-1"``: the bands' labels, in order."""
    edges = (0, *P_ANY_BAND_EDGES, 1)
    return [f"{lo:g}-{hi:g}" for lo, hi in zip(edges[:-1], edges[1:])]


@dataclass(frozen=True)
class PAnyBand:
    """The model-hours of one scored hour and horizon whose mean ``p_any`` falls in one band, pooled: their minutes
    with a ``p_any``, its mean over them and the share of them with a request (calibrated: the two agree)."""

    horizon_min: int
    band: str
    model_hours: int
    p_any_minutes: int
    p_any_mean: float
    invoked_share: float


def p_any_bands(conn: Connection, *, hour: datetime) -> list[PAnyBand]:
    """The reliability of ``p_any`` over ``hour``, per horizon and band of each model's mean ``p_any`` in the hour
    (:data:`P_ANY_BAND_EDGES`); bands with no model left out."""
    bands = " ".join(f"WHEN m < {edge} THEN {i}" for i, edge in enumerate(P_ANY_BAND_EDGES))
    rows = conn.execute(text(f"""
        SELECT horizon_min, CASE {bands} ELSE {len(P_ANY_BAND_EDGES)} END AS band, count(*), sum(p_any_minutes),
               sum(p_any_sum), sum(invoked_minutes)
        FROM (SELECT horizon_min, p_any_minutes, p_any_sum, invoked_minutes, p_any_sum / p_any_minutes AS m
              FROM forecast_errors WHERE hour = :hour AND p_any_minutes > 0) e
        GROUP BY 1, 2 ORDER BY 1, 2"""), {"hour": hour}).all()
    names = p_any_band_names()
    return [PAnyBand(horizon_min=int(h), band=names[int(b)], model_hours=int(n), p_any_minutes=int(minutes),
                     p_any_mean=float(p_sum) / int(minutes), invoked_share=float(invoked) / int(minutes))
            for h, b, n, minutes, p_sum, invoked in rows]


def read_fleet_page(conn: Connection, *, end: datetime, window_min: int, horizon_min: int, sort: str = "wmape",
                    search: str | None = None, limit: int = 50, offset: int = 0,
                    follow_scored: bool = False, error_end: datetime | None = None) -> FleetPage:
    """One page of every registered model ranked by ``sort`` over the ``window_min`` minutes before ``end``.

    Error figures (and the error sorts) cover the window snapped to whole hours (:func:`error_window`) and
    are read from the error rollup when it holds every one of those hours at ``horizon_min``, else from the
    forecast runs (the same definitions; at fleet scale reading the runs costs one run per model and minute).
    With ``follow_scored`` (a window whose end was not asked for) and the hour that just ended not scored
    yet, the error window ends an hour earlier when that makes the rollup hold it. ``error_end`` (a whole hour,
    one of the two :func:`fleet_error_ends` of ``end``) fixes where the error window ends instead, so that a
    later page ranks over the hours the first one did whatever the rollup holds by then. Cold starts and
    actions cover the window ``[end - window_min, end)`` itself.

    Two queries: the ranking over the whole fleet (without a search a bounded top-N sort of ``offset +
    limit`` rows), then the figures of the page's models alone (their rollup rows or runs by primary key,
    cold starts and actions by their (model, time) indexes). Ties rank by MAE (error sorts), then by model id.

    Raises:
        ValueError: an unknown ``sort``.
    """
    if sort not in FLEET_SORTS:
        raise ValueError(f"unknown sort {sort!r}; one of {', '.join(FLEET_SORTS)}")
    start = end - window_min * MINUTE
    pinned = error_end
    error_start, error_end = error_window(end, window_min)
    hours = int((error_end - error_start) / HOUR)
    if pinned is not None:
        if pinned not in fleet_error_ends(end):
            raise ValueError(f"error_end {pinned.isoformat()} is not the start of end's hour or the hour before")
        error_start, error_end = pinned - hours * HOUR, pinned
    source = "runs"
    if scored_hours(conn, horizon_min=horizon_min, start=error_start, end=error_end) == hours:
        source = "rollup"
    elif follow_scored and pinned is None and scored_hours(conn, horizon_min=horizon_min, start=error_start - HOUR,
                                                           end=error_end - HOUR) == hours:
        error_start, error_end, source = error_start - HOUR, error_end - HOUR, "rollup"
    params = {"h": horizon_min, "s": start, "e": end, "es": error_start, "ee": error_end,
              **_issued_bounds(error_start, error_end, horizon_min)}
    searched = bool(search)
    with _local_settings(conn, _COUNT_SORT_SETTINGS if sort in _COUNT_SORTS else {}):
        ranked, matching = _ranked(conn, text(_rank_sql(sort, source, searched)), params, search=search,
                                   limit=limit, offset=offset)
    page = FleetPage(rows=[], matching=matching, error_start=error_start, error_end=error_end,
                     error_source=source)
    if not ranked:
        return page
    ids = [r[0] for r in ranked]
    figures = {r[0]: r for r in conn.execute(text(_page_sql(source)), {**params, "ids": ids}).all()}
    replays: dict[str, dict] = {}
    for r in conn.execute(text(_PAGE_REPLAY_SQL), {"ids": ids}).mappings():
        role = "prewarm" if r["is_subject"] else "reactive"
        replays.setdefault(r["model_id"], {})[role] = {c: r[c] for c in OUTCOME_COLUMNS}
    for model_id, rank in ranked:
        (_, n, abs_err, actual, forecast, p_n, p_sq, p_sum, p_invoked, cold, total, succeeded, failed, benefit,
         last) = figures[model_id]
        error = ForecastError.from_sums(n, abs_err, actual, p_n, p_sq, p_sum, p_invoked)
        page.rows.append(FleetRow(model_id=model_id, rank=rank, error=error, actual_total=float(actual or 0.0),
                                  forecast_total=float(forecast or 0.0), cold_starts=int(cold),
                                  actions_total=int(total), actions_succeeded=int(succeeded),
                                  actions_failed=int(failed), expected_wait_avoided_s=float(benefit),
                                  last_forecast_at=last, replay=replays.get(model_id)))
    return page


def _ranked(conn: Connection, query, params: dict, *, search: str | None, limit: int,
            offset: int) -> tuple[list[tuple[str, int]], int]:
    """((model id, rank) of the page, models matching the search) from the ranking ``query`` (:func:`_rank_sql`)."""
    if search:
        ranked = conn.execute(query, {**params, "q": search, "n": limit, "o": offset}).all()
        if ranked:
            matching = int(ranked[0][2])
        else:  # past the last match: the total from the first page
            first = conn.execute(query, {**params, "q": search, "n": 1, "o": 0}).all()
            matching = int(first[0][2]) if first else 0
        return [(r[0], int(r[1])) for r in ranked], matching
    ranked = [(r[0], offset + 1 + i) for i, r in enumerate(conn.execute(query, {**params, "n": limit, "o": offset}))]
    return ranked, int(conn.execute(text("SELECT count(*) FROM serving_models")).scalar_one())


def known_until(conn: Connection, *, model_id: str | None = None) -> datetime | None:
    """End of the newest known count (coverage's upper bound) of ``model_id``, or of any model; None: nothing.

    The fleet-wide maximum is one probe of the ``coverage_known_until`` index (migration 0009).
    """
    if model_id is None:
        return conn.execute(text("SELECT max(upper(ranges)) FROM coverage")).scalar()
    return conn.execute(text("SELECT max(upper(ranges)) FROM coverage WHERE model_id = :m"),
                        {"m": model_id}).scalar()


#: Horizons the dashboard offers, where the store holds them (plus the longest stored one).
HORIZON_LADDER_MIN = (1, 5, 10, 15, 30, 60, 120, 240, 480, 720, 1440)


def offered_horizons_min(stored: int | None, setting: int) -> tuple[int, list[int]]:
    """(longest stored horizon, the horizons to offer): the ladder's up to it, and it.

    ``stored`` is :func:`stored_horizon_min` (None: no run stored, then ``setting``, the
    ``PREWARM_FORECAST_HORIZON_MIN`` the forecast job will store). The error rollup scores these horizons.
    """
    longest = stored or setting
    return longest, sorted({h for h in HORIZON_LADDER_MIN if h <= longest} | {longest})


def stored_horizon_min(conn: Connection) -> int | None:
    """Minutes ahead the newest stored run reaches (its element count), or None when no run is stored.

    The forecast job stores ``PREWARM_FORECAST_HORIZON_MIN`` elements per run, horizons 1 to that number.
    """
    return conn.execute(text("SELECT cardinality(point) FROM forecasts ORDER BY issued_at DESC LIMIT 1")).scalar()


def finite_or_none(values: np.ndarray) -> list[float | None]:
    """A JSON-ready list: NaN becomes None."""
    return [None if math.isnan(v) else v for v in values.tolist()]
