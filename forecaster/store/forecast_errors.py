"""Forecast-error rollup: per model, horizon and target hour, the sums behind the dashboard's error figures.

The fleet ranking by wMAPE or MAE (:mod:`forecaster.store.dashboard`) is defined per target minute: the
forecast made ``h`` minutes ahead (element ``h`` of the run issued during minute ``t - (h - 1)``, the later
run of a minute winning, runs that do not reach that far left out) against the minute's count where the
model's coverage (sources whose step divides 60 s) holds the minute, a covered minute without a row being
0 and an uncovered one left out. Computing that for the whole fleet reads one run per model per minute of
the window (6,000,000 runs per hour at 100,000 models), on every request.

:func:`score_hour` computes the same figures once per target hour, for every horizon the dashboard offers,
and stores per (horizon, hour, model) the scored minutes and the sums of |error|, actuals and forecasts
(``forecast_errors``, migration 0010), and over those of the minutes whose run stored ``p_any`` the sums behind
its Brier score (migration 0014). The sums are additive, so a window of whole hours is the sum of its hours:
wMAPE = sum |error| / sum actual, MAE = sum |error| / minutes, exactly the direct definitions.
Re-scoring an hour replaces it in one transaction (never double counts), and ``forecast_error_hours``
records which hours were scored, for which horizons, and the newest ingest batch whose counts the scoring
saw: :func:`hours_due` re-scores an hour when a later count batch's window overlaps it.

How it reads: counts through :func:`forecaster.store.invocations.read_grid` (the same known/zero/unknown
rules), and the runs as one binary ``COPY`` of fixed-width records (the run's model position, issuing
minute, issue time, and per horizon the element it forecast, NULL marked by a bit, and its ``p_any`` element,
NaN where unknown), parsed by numpy
without a Python loop per run; models are read in chunks so that memory stays bounded at any fleet size.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import numpy as np
from sqlalchemy import Connection, Engine, text

from forecaster.store.invocations import read_grid
from forecaster.store.db import driver_errors

HOUR = timedelta(hours=1)
MINUTE = timedelta(minutes=1)
#: Models read per query while scoring: about 20,000 x 119 runs x (30 + 8 per horizon) bytes in flight.
SCORE_CHUNK_MODELS = 20_000
#: Binary COPY framing: signature, flags and header-extension length before the rows; -1 field count after.
_COPY_HEADER_BYTES = 19
_COPY_TRAILER_BYTES = 2


def floor_hour(value: datetime) -> datetime:
    """The start of the UTC hour ``value`` falls in."""
    value = value.astimezone(UTC)
    return value.replace(minute=0, second=0, microsecond=0)


@dataclass(frozen=True)
class HourScore:
    """What one scoring of one target hour wrote.

    Attributes:
        hour: the target hour's start (UTC).
        horizons_min: horizons scored.
        models: models with at least one scored minute at some horizon.
        rows: ``forecast_errors`` rows written (one per model and horizon with a scored minute).
        runs_read: forecast runs read (those issued in the hour and the longest horizon's minutes before it).
        batch_watermark: the newest ingest batch visible to the scoring.
        seconds: wall time.
    """

    hour: datetime
    horizons_min: tuple[int, ...]
    models: int
    rows: int
    runs_read: int
    batch_watermark: int
    seconds: float


def _runs_sql(horizons_min: Sequence[int]) -> str:
    """Per run issued in ``[lo, hi)`` of the models of ``ids``: position, issuing minute, issue time, elements.

    For each horizon ``h`` the element is the one whose target minute is the issuing minute plus ``h - 1``
    minutes, as :func:`forecaster.store.dashboard._at_horizon_sql` defines it (``k`` from ``first_target``
    and ``step_seconds``); a NULL element (or none that far) is NaN with bit ``j`` of ``missing`` set, so that
    every record has the same width; after each element, the run's ``p_any`` at that horizon (NaN where the
    run stored none). ``horizons_min`` are validated integers, spelled as literals.
    """
    elements, missing = [], []
    for j, h in enumerate(horizons_min):
        offset = f"(r.minute_s + {60 * (int(h) - 1)} - r.first_s)"
        k = f"CASE WHEN mod({offset}, r.step) = 0 THEN CAST({offset} / r.step AS integer) + 1 END"
        element = f"r.point[{k}]"
        elements.append(f"coalesce({element}, CAST('NaN' AS real)), coalesce(r.p_any[{k}], CAST('NaN' AS real))")
        missing.append(f"CASE WHEN {element} IS NULL THEN {1 << j} ELSE 0 END")
    return f"""
COPY (
    SELECT CAST(r.i AS integer) - 1, r.minute_s, r.issued_at, CAST({" + ".join(missing)} AS integer),
           {", ".join(elements)}
    FROM (SELECT w.i, CAST(floor(date_part('epoch', f.issued_at) / 60) AS bigint) * 60 AS minute_s,
                 CAST(date_part('epoch', f.first_target) AS bigint) AS first_s, f.step_seconds AS step,
                 f.issued_at, f.point, f.p_any
          FROM forecasts f JOIN unnest(CAST(%(ids)s AS text[])) WITH ORDINALITY AS w(id, i) ON f.model_id = w.id
          WHERE f.issued_at >= %(lo)s AND f.issued_at < %(hi)s) r
) TO STDOUT (FORMAT binary)"""


def _record_dtype(horizons: int) -> np.dtype:
    fields = [("fields", ">i2"), ("row_len", ">i4"), ("row", ">i4"), ("minute_len", ">i4"), ("minute_s", ">i8"),
              ("issued_len", ">i4"), ("issued_us", ">i8"), ("missing_len", ">i4"), ("missing", ">i4")]
    for j in range(horizons):
        fields += [(f"v{j}_len", ">i4"), (f"v{j}", ">f4"), (f"a{j}_len", ">i4"), (f"a{j}", ">f4")]
    return np.dtype(fields)


def _read_runs(conn: Connection, ids: list[str], lo: datetime, hi: datetime, horizons_min: Sequence[int]) -> np.ndarray:
    """The records of :func:`_runs_sql` as a numpy structured array (one element per run)."""
    dtype = _record_dtype(len(horizons_min))
    chunks = []
    raw = conn.connection.driver_connection
    statement = _runs_sql(horizons_min)
    with driver_errors(conn, statement), raw.cursor() as cur, cur.copy(statement, {"ids": ids, "lo": lo,
                                                                                   "hi": hi}) as copy:
        for block in copy:
            chunks.append(bytes(block))
    buf = b"".join(chunks)
    body = len(buf) - _COPY_HEADER_BYTES - _COPY_TRAILER_BYTES
    if body <= 0:
        return np.empty(0, dtype=dtype)
    if body % dtype.itemsize:
        raise RuntimeError(f"forecast records of {body} bytes are not a multiple of {dtype.itemsize}")
    return np.frombuffer(buf, dtype=dtype, count=body // dtype.itemsize, offset=_COPY_HEADER_BYTES)


@dataclass(frozen=True)
class ErrorSums:
    """Per model (rows of ``ids``) and horizon (columns): scored minutes and the sums over them."""

    ids: list[str]
    horizons_min: tuple[int, ...]
    scored_minutes: np.ndarray  # (models, horizons) int64
    abs_error: np.ndarray  # (models, horizons) float64
    actual: np.ndarray
    forecast: np.ndarray
    #: over the scored minutes whose run stored p_any: how many, sum (p_any - [actual > 0])^2, sum p_any, invoked
    p_any_minutes: np.ndarray
    p_any_sq_error: np.ndarray
    p_any_sum: np.ndarray
    invoked_minutes: np.ndarray
    runs_read: int = 0


def hour_error_sums(conn: Connection, ids: list[str], *, hour: datetime, horizons_min: Sequence[int]) -> ErrorSums:
    """The error sums of ``ids`` over the target minutes of ``hour`` at each of ``horizons_min``.

    The definitions are those of the dashboard's direct computation (module docstring); ``ids`` are sorted
    (code points), the order of the returned rows.
    """
    ids, _, actual = read_grid(conn, ids, hour, hour + HOUR)  # (models, 60): NaN unknown, 0 covered zero
    horizons = tuple(int(h) for h in horizons_min)
    shape = (len(ids), len(horizons))
    lo, hi = hour - (max(horizons) - 1) * MINUTE, hour + HOUR
    runs = _read_runs(conn, ids, lo, hi, horizons) if ids else np.empty(0, dtype=_record_dtype(len(horizons)))
    minutes, total = (lambda: np.zeros(shape, dtype=np.int64)), (lambda: np.zeros(shape))
    sums = ErrorSums(ids, horizons, scored_minutes=minutes(), abs_error=total(), actual=total(), forecast=total(),
                     p_any_minutes=minutes(), p_any_sq_error=total(), p_any_sum=total(),
                     invoked_minutes=minutes(), runs_read=len(runs))
    if not len(runs):
        return sums
    row = runs["row"].astype(np.int64)
    minute_s = runs["minute_s"].astype(np.int64)
    # run order within a (model, issuing minute): the later issue time last, so it wins below
    order = np.lexsort((runs["issued_us"].astype(np.int64), minute_s, row))
    row, minute_s, runs = row[order], minute_s[order], runs[order]
    run_key = row * 2**32 + (minute_s - int(lo.timestamp())) // 60
    missing = runs["missing"].astype(np.int64)
    hour_s = int(hour.timestamp())
    for j, h in enumerate(horizons):
        target = (minute_s + 60 * (h - 1) - hour_s) // 60  # minute of the hour, 0..59 when inside it
        candidates = np.flatnonzero(((missing >> j) & 1 == 0) & (target >= 0) & (target < 60))
        if not len(candidates):
            continue
        keys = run_key[candidates]
        latest = candidates[np.r_[keys[1:] != keys[:-1], True]]  # the later run of a minute wins
        seen = actual[row[latest], target[latest]]
        known = ~np.isnan(seen)
        rows, seen = row[latest][known], seen[known]
        point = runs[f"v{j}"][latest][known].astype(np.float64)
        n = len(ids)
        sums.scored_minutes[:, j] = np.bincount(rows, minlength=n)
        sums.abs_error[:, j] = np.bincount(rows, weights=np.abs(point - seen), minlength=n)
        sums.actual[:, j] = np.bincount(rows, weights=seen, minlength=n)
        sums.forecast[:, j] = np.bincount(rows, weights=point, minlength=n)
        p_any = runs[f"a{j}"][latest][known].astype(np.float64)
        stored = ~np.isnan(p_any)
        rows, p_any, invoked = rows[stored], p_any[stored], (seen[stored] > 0).astype(np.float64)
        sums.p_any_minutes[:, j] = np.bincount(rows, minlength=n)
        sums.p_any_sq_error[:, j] = np.bincount(rows, weights=(p_any - invoked) ** 2, minlength=n)
        sums.p_any_sum[:, j] = np.bincount(rows, weights=p_any, minlength=n)
        sums.invoked_minutes[:, j] = np.bincount(rows, weights=invoked, minlength=n).astype(np.int64)
    return sums


def score_hour(engine: Engine, *, hour: datetime, horizons_min: Sequence[int],
               chunk_models: int = SCORE_CHUNK_MODELS) -> HourScore:
    """Score target hour ``hour`` for every model with runs that may target it; replaces the hour's rows.

    One ``REPEATABLE READ`` transaction: every chunk of models, the counts and the batch watermark are read
    from one snapshot, and the hour's old rows are deleted and the new ones written at commit, so a reader
    sees the old hour or the new one, and running it again for the same data writes the same rows.

    Args:
        engine: the store.
        hour: a whole UTC hour (its start).
        horizons_min: minutes ahead to score (1..1440).
        chunk_models: models read per query (memory bound).

    Raises:
        ValueError: ``hour`` not a whole hour, or a horizon outside 1..1440.
    """
    started = time.perf_counter()
    hour = hour.astimezone(UTC)
    if hour != floor_hour(hour):
        raise ValueError(f"hour must be a whole UTC hour, got {hour.isoformat()}")
    horizons = tuple(sorted({int(h) for h in horizons_min}))
    if not horizons or horizons[0] < 1 or horizons[-1] > 1440:
        raise ValueError(f"horizons must lie in 1..1440 minutes, got {list(horizons_min)}")
    with engine.connect() as conn:
        conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            watermark = int(conn.execute(text("SELECT coalesce(max(id), 0) FROM ingest_batches")).scalar())
            lo = hour - (horizons[-1] - 1) * MINUTE
            # the models with a run that may target the hour (the others score nothing): the key's index only
            ids = sorted(conn.execute(text("SELECT DISTINCT model_id FROM forecasts WHERE issued_at >= :lo "
                                           "AND issued_at < :hi"), {"lo": lo, "hi": hour + HOUR}).scalars())
            parts = [hour_error_sums(conn, ids[i:i + chunk_models], hour=hour, horizons_min=horizons)
                     for i in range(0, len(ids), chunk_models)]
            runs_read = sum(part.runs_read for part in parts)
            conn.execute(text("DELETE FROM forecast_errors WHERE hour = :hour"), {"hour": hour})
            rows, models = _write_sums(conn, hour, parts)
            seconds = time.perf_counter() - started
            conn.execute(text(
                "INSERT INTO forecast_error_hours (hour, horizons_min, batch_watermark, models, scored_at, seconds) "
                "VALUES (:hour, :horizons, :watermark, :models, now(), :seconds) ON CONFLICT (hour) DO UPDATE SET "
                "horizons_min = EXCLUDED.horizons_min, batch_watermark = EXCLUDED.batch_watermark, "
                "models = EXCLUDED.models, scored_at = EXCLUDED.scored_at, seconds = EXCLUDED.seconds"),
                {"hour": hour, "horizons": list(horizons), "watermark": watermark, "models": models,
                 "seconds": seconds})
    return HourScore(hour=hour, horizons_min=horizons, models=models, rows=rows, runs_read=runs_read,
                     batch_watermark=watermark, seconds=time.perf_counter() - started)


def _write_sums(conn: Connection, hour: datetime, parts: list[ErrorSums]) -> tuple[int, int]:
    """COPY the (model, horizon) cells with a scored minute; returns (rows, models)."""
    rows = models = 0
    raw = conn.connection.driver_connection
    statement = ("COPY forecast_errors (horizon_min, hour, model_id, scored_minutes, abs_error, actual, forecast, "
                 "p_any_minutes, p_any_sq_error, p_any_sum, invoked_minutes) FROM STDIN")
    with driver_errors(conn, statement), raw.cursor() as cur, cur.copy(statement) as copy:
        for part in parts:
            scored = part.scored_minutes > 0
            models += int(scored.any(axis=1).sum())
            for j, h in enumerate(part.horizons_min):
                for i in np.flatnonzero(scored[:, j]):
                    copy.write_row((h, hour, part.ids[i], int(part.scored_minutes[i, j]),
                                    float(part.abs_error[i, j]), float(part.actual[i, j]),
                                    float(part.forecast[i, j]), int(part.p_any_minutes[i, j]),
                                    float(part.p_any_sq_error[i, j]), float(part.p_any_sum[i, j]),
                                    int(part.invoked_minutes[i, j])))
                    rows += 1
    return rows, models


def hours_due(conn: Connection, *, now: datetime, delay_s: float, lookback_h: int,
              horizons_min: Sequence[int], limit: int) -> list[datetime]:
    """Target hours to (re-)score now, newest first, at most ``limit``.

    An hour is due once ``delay_s`` seconds have passed since it ended (its counts ingested, the runs that
    forecast it written) and it lies within ``lookback_h`` hours, when it was never scored, was scored for
    other horizons than ``horizons_min``, or a count batch later than the scoring's watermark covers part of
    it (late or corrected counts; batch ids are taken when a batch starts, so a batch that commits after the
    scoring with a smaller id than the watermark is not seen; as in :mod:`forecaster.jobs.history`).
    """
    last = floor_hour(now - timedelta(seconds=delay_s)) - HOUR
    first = floor_hour(now) - lookback_h * HOUR
    if last < first:
        return []
    rows = conn.execute(text("""
        SELECT g.hour FROM generate_series(CAST(:first AS timestamptz), CAST(:last AS timestamptz),
                                           interval '1 hour') AS g(hour)
        LEFT JOIN forecast_error_hours s ON s.hour = g.hour
        WHERE s.hour IS NULL OR NOT (CAST(:horizons AS smallint[]) <@ s.horizons_min)
           OR EXISTS (SELECT 1 FROM ingest_batches b WHERE b.kind = 'counts' AND b.id > s.batch_watermark
                      AND b.window_start < g.hour + interval '1 hour' AND b.window_end > g.hour)
        ORDER BY g.hour DESC LIMIT :n"""),
        {"first": first, "last": last, "horizons": [int(h) for h in horizons_min], "n": limit}).scalars().all()
    return list(rows)


def drop_hours_before(conn: Connection, *, before: datetime) -> int:
    """Delete the rollup's hours older than ``before``; returns the hours dropped."""
    conn.execute(text("DELETE FROM forecast_errors WHERE hour < :b"), {"b": before})
    return conn.execute(text("DELETE FROM forecast_error_hours WHERE hour < :b"), {"b": before}).rowcount


def scored_hours(conn: Connection, *, horizon_min: int, start: datetime, end: datetime) -> int:
    """How many hours of ``[start, end)`` the rollup holds scored at ``horizon_min``."""
    return int(conn.execute(text("SELECT count(*) FROM forecast_error_hours WHERE hour >= :s AND hour < :e "
                                 "AND CAST(:h AS smallint) = ANY(horizons_min)"),
                            {"s": start, "e": end, "h": horizon_min}).scalar())
