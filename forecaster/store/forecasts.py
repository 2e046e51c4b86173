"""Forecasts in the store: written each minute by the forecast job, read by the API, dashboard and planner.

One forecast run of one model is ONE row (migration 0005): element ``k``
(1-based) of ``point``, ``p_any`` and of each row of ``quantiles`` is the
target minute ``first_target + (k - 1) * step_seconds``; ``quantiles`` has one
row per level, in the order of ``quantile_levels`` (ascending). Values are
invocations per minute as ``real`` (float32: 7 significant digits, plenty for
a forecast); a NaN ``p_any`` element means "not known". With 60 target
minutes, a run of point, p_any and three quantiles holds about 1.3 KB (1.6 KB
of heap: five runs fill an 8 kB page), so a fleet of 100,000 models adds
100,000 rows (about 160 MB) a minute instead of 6,000,000 rows. The forecast
job stores the five levels of ``FORECAST_LEVELS`` (0.1, 0.5, 0.9, 0.95, 0.99):
about 1.8 KB of values per run.

The table is range-partitioned by the UTC day of ``issued_at``
(``forecasts_YYYYMMDD``). :func:`write_forecasts` creates the partition it
needs; :func:`maintain_forecast_partitions` creates the coming days' ahead of
time and drops whole days past retention, which is the only way forecasts are
ever deleted (dropping a partition costs the same at any size and leaves no
dead rows behind to vacuum).
"""

from __future__ import annotations

import logging
import re
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone

import numpy as np
import pandas as pd
from psycopg.copy import QueuedLibpqWriter
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from forecaster.contracts.forecast import REQUEST_RATE_COLUMN, quantile_column, quantile_levels
from forecaster.store.db import driver_errors
from forecaster.store.partitions import (PARTITION_LOCK_TIMEOUT_S, create_partition_once, is_lock_timeout,
                                         set_partition_lock_timeout)

log = logging.getLogger(__name__)

#: Partitions are named after the UTC day whose runs they hold.
PARTITION_PATTERN = re.compile(r"^forecasts_(\d{8})$")
#: Microseconds between the Unix epoch and PostgreSQL's (2000-01-01), for binary ``timestamptz``.
PG_EPOCH_US = 946_684_800 * 1_000_000
STEP_SECONDS = 60
FLOAT4_OID = 700
COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
COPY_TRAILER = struct.pack(">h", -1)
COPY_COLUMNS = ("model_id", "issued_at", "first_target", "step_seconds", "model_version_id", "point", "p_any",
                "quantile_levels", "quantiles", "request_rate_rpm")


def newest_issued_at(engine: Engine, *, now: datetime) -> datetime | None:
    """The issue time of the newest run issued at or before ``now`` (None: none), through the ``issued_at`` index."""
    with engine.connect() as conn:
        return conn.execute(text("SELECT max(issued_at) FROM forecasts WHERE issued_at <= :now"),
                            {"now": now}).scalar()


def quantile_columns(frame: pd.DataFrame) -> dict[str, float]:
    """Map the quantile columns of ``frame`` (``q0.9``, ``q0.99``) to their levels, in ascending level.

    The contract's parser (:func:`forecaster.contracts.forecast.quantile_levels`):
    one naming from the ensemble through the store to the API.
    """
    return {column: level for level, column in quantile_levels(frame)}


def stored_level(value: float) -> float:
    """A quantile level as read back from ``real``: 0.1 stays 0.1, not 0.10000000149."""
    return float(str(np.float32(value)))


# --- partitions --------------------------------------------------------------------


def forecast_partition_name(day: date) -> str:
    return f"forecasts_{day:%Y%m%d}"


def forecast_partitions(conn: Connection) -> dict[date, str]:
    """The daily partitions of ``forecasts`` that exist, by UTC day."""
    rows = conn.execute(text(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = 'forecasts'")).scalars()
    out = {}
    for name in rows:
        match = PARTITION_PATTERN.match(name)
        if match:
            out[datetime.strptime(match.group(1), "%Y%m%d").date()] = name
    return out


def _create_partition(engine: Engine, day: date) -> None:
    lo = datetime(day.year, day.month, day.day, tzinfo=timezone.utc)
    name, hi = forecast_partition_name(day), lo + timedelta(days=1)
    with engine.begin() as conn:  # another writer or the maintenance job may be creating it too
        create_partition_once(conn, name, f'CREATE TABLE IF NOT EXISTS "{name}" PARTITION OF forecasts '
                                          f"FOR VALUES FROM ('{lo.isoformat()}') TO ('{hi.isoformat()}')")


def _skipped(what: str, name: str) -> None:
    log.warning("forecast partition %s not %s: a long transaction holds forecasts for more than %.0f s "
                "(PARTITION_LOCK_TIMEOUT_S); the next run tries again", name, what, PARTITION_LOCK_TIMEOUT_S)


def ensure_forecast_partitions(engine: Engine, days: Iterable[date], *, skipped: list[str] | None = None) -> list[str]:
    """Create the partitions of ``days`` that are missing, each in its own short transaction; return those created.

    A day whose lock on ``forecasts`` is not had within the partition lock timeout raises a DBAPIError with
    SQLSTATE 55P03 (a writer needs its partition); given a ``skipped`` list, it is logged and added there instead.
    """
    with engine.connect() as conn:
        present = forecast_partitions(conn)
    created = []
    for day in sorted(set(days)):
        if day not in present:
            try:
                _create_partition(engine, day)
            except DBAPIError as exc:
                if skipped is None or not is_lock_timeout(exc):
                    raise
                _skipped("created", forecast_partition_name(day))
                skipped.append(forecast_partition_name(day))
                continue
            created.append(forecast_partition_name(day))
    return created


def maintain_forecast_partitions(engine: Engine, *, now: datetime, days_ahead: int, retention_days: int) -> dict:
    """Create partitions from ``now``'s day through ``days_ahead`` days ahead; drop days past retention.

    A partition is dropped when its day ended more than ``retention_days``
    before ``now`` (with 2 days, at 10:00 on the 5th, the 2nd goes: it ended at
    00:00 on the 3rd, 58 hours ago; the 3rd stays until 00:00 on the 6th).
    Dropping whole partitions is the only deletion of forecasts.

    Both need the exclusive lock on ``forecasts`` and would wait behind any open
    reader while every later query queued behind them; each waits at most the
    partition lock timeout, then the partition is logged, listed in ``skipped``
    and left for the next run.

    Returns:
        ``{"created": [names], "dropped": [names], "skipped": [names]}``.
    """
    if retention_days < 1:
        raise ValueError(f"retention_days must be at least 1, got {retention_days}")
    today = now.astimezone(timezone.utc).date()
    skipped: list[str] = []
    created = ensure_forecast_partitions(engine, (today + timedelta(days=i) for i in range(days_ahead + 1)),
                                         skipped=skipped)
    oldest_kept_end = now - timedelta(days=retention_days)
    with engine.connect() as conn:
        present = forecast_partitions(conn)
    dropped = []
    for day, name in sorted(present.items()):
        day_end = datetime(day.year, day.month, day.day, tzinfo=timezone.utc) + timedelta(days=1)
        if day_end < oldest_kept_end:
            try:
                with engine.begin() as conn:
                    set_partition_lock_timeout(conn)
                    conn.execute(text(f'DROP TABLE IF EXISTS "{name}"'))
            except DBAPIError as exc:
                if not is_lock_timeout(exc):
                    raise
                _skipped("dropped", name)
                skipped.append(name)
                continue
            dropped.append(name)
    return {"created": created, "dropped": dropped, "skipped": skipped}


# --- writing -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Runs:
    """A long forecast frame regrouped into one run per model (values sorted by model, then target minute)."""

    model_ids: list[str]
    first_target_us: np.ndarray  # (M,) Unix microseconds
    lengths: np.ndarray  # (M,) target minutes per model
    starts: np.ndarray  # (M,) first value of each model in the sorted values
    point: np.ndarray  # (values,) float64
    p_any: np.ndarray | None  # (values,) float64, NaN = unknown; None = no p_any column
    levels: tuple[float, ...]  # ascending
    quantiles: np.ndarray  # (values, L) float64, columns in the order of ``levels``
    request_rate_rpm: np.ndarray | None = None  # (M,) per model, NaN = not known; None = no rates


def _target_us(ds: pd.Series) -> np.ndarray:
    """Target minutes as Unix microseconds (naive times are UTC)."""
    if isinstance(ds.dtype, pd.DatetimeTZDtype) or pd.api.types.is_datetime64_dtype(ds.dtype):
        return pd.DatetimeIndex(ds).as_unit("us").asi8  # tz-aware: UTC instants; naive: read as UTC
    return pd.DatetimeIndex(pd.to_datetime(ds, utc=True)).as_unit("us").asi8


def _model_blocks(ids: pd.Series, target: np.ndarray) -> tuple[np.ndarray | None, list[str], np.ndarray]:
    """(order, model ids, first value of each model) with the values sorted by model, then target minute.

    ``order`` is None when the frame already is (each model's rows together,
    targets rising), as the forecast job writes it: then no sort is needed.
    """
    change = ids.ne(ids.shift()).to_numpy(dtype=bool)
    starts = np.flatnonzero(change)
    block_ids = ids.iloc[starts].astype(str).tolist()
    rising = np.diff(target) > 0
    rising[starts[1:] - 1] = True  # a model's first target need not follow the previous model's last
    if len(set(block_ids)) == len(block_ids) and rising.all():
        return None, block_ids, starts
    codes, uniques = pd.factorize(ids, sort=False)
    order = np.lexsort((target, codes))
    sorted_codes = codes[order]
    starts = np.flatnonzero(np.concatenate([[True], sorted_codes[1:] != sorted_codes[:-1]]))
    return order, [str(u) for u in uniques[sorted_codes[starts]]], starts


#: Largest value a forecast may hold: the columns are ``real`` (float32), and a larger float64 is stored as infinity.
MAX_FORECAST_VALUE = float(np.finfo(np.float32).max)
#: Seconds a run's ``issued_at`` may be ahead of the database's clock (a writer's clock a little ahead). A run
#: stamped further ahead is refused at write; readers (the API snapshot, /readyz) load none issued further ahead
#: of their own clock, and the plan job none issued after its ``now``.
MAX_ISSUED_AHEAD_S = 60.0


def bad_value_rows(point: np.ndarray, q: np.ndarray, p_any: np.ndarray | None = None) -> np.ndarray:
    """Per value row, whether it is unusable: NaN, infinite, negative or beyond ``real`` in ``point`` or a quantile,
    or a ``p_any`` outside [0, 1] (NaN ``p_any`` is "not known" and allowed)."""
    point = np.asarray(point, dtype="float64")
    bad = ~((point >= 0) & (point <= MAX_FORECAST_VALUE))  # NaN fails this too
    if q.size:
        bad |= ~((q >= 0) & (q <= MAX_FORECAST_VALUE)).all(axis=1)
    if p_any is not None:
        p = np.asarray(p_any, dtype="float64")
        bad |= ~np.isnan(p) & ~((p >= 0) & (p <= 1))
    return bad


def _refuse_bad_values(point: np.ndarray, q: np.ndarray, p_any: np.ndarray | None, model_of) -> None:
    """Refuse values no reader can use, naming the first model that has one (``model_of(row)``)."""
    if np.isnan(point).any() or np.isnan(q).any():
        raise ValueError("forecast has NaN values; the forecast job must fall back, not store NaN")
    bad = bad_value_rows(point, q, p_any)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        values = [float(point[row]), *map(float, q[row])] + ([] if p_any is None else [float(p_any[row])])
        raise ValueError(f"forecast of model {model_of(row)!r} has an infinite, negative or too large value "
                         f"(point and quantiles must be finite, >= 0 and <= {MAX_FORECAST_VALUE:.3g}; p_any in "
                         f"[0, 1] or NaN): {values}; nothing was written")


def _runs(frame: pd.DataFrame) -> _Runs:
    """Validate the long frame and regroup it per model, vectorised (no Python loop per value)."""
    columns = quantile_columns(frame)
    ordered = sorted(columns, key=columns.get)
    point = frame["point"].to_numpy(dtype="float64")
    q = frame[ordered].to_numpy(dtype="float64") if ordered else np.empty((len(frame), 0))
    p_any = frame["p_any"].to_numpy(dtype="float64") if "p_any" in frame else None
    _refuse_bad_values(point, q, p_any, lambda row: str(frame["unique_id"].iloc[row]))
    rate = frame[REQUEST_RATE_COLUMN].to_numpy(dtype="float64") if REQUEST_RATE_COLUMN in frame else None
    target = _target_us(frame["ds"])
    order, ids, starts = _model_blocks(frame["unique_id"], target)
    if order is not None:
        target, point, q = target[order], point[order], q[order]
        p_any = None if p_any is None else p_any[order]
        rate = None if rate is None else rate[order]
    lengths = np.diff(np.append(starts, len(target)))
    step_us = STEP_SECONDS * 1_000_000
    bad = np.diff(target) != step_us
    bad[starts[1:] - 1] = False  # between two models
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        model = ids[int(np.searchsorted(starts, at, side="right")) - 1]
        before, after = (pd.Timestamp(int(v), unit="us", tz="UTC") for v in (target[at], target[at + 1]))
        raise ValueError(f"forecast of model {model!r}: target minutes (ds) must be consecutive minutes "
                         f"from one first target; {after} follows {before}")
    first = target[starts]
    off_minute = first % step_us != 0
    if off_minute.any():
        at = int(np.flatnonzero(off_minute)[0])
        raise ValueError(f"forecast of model {ids[at]!r}: target minutes (ds) must be whole minutes, got "
                         f"{pd.Timestamp(int(first[at]), unit='us', tz='UTC')}")
    return _Runs(model_ids=ids, first_target_us=first, lengths=lengths, starts=starts, point=point, p_any=p_any,
                 levels=tuple(columns[c] for c in ordered), quantiles=q,
                 request_rate_rpm=None if rate is None else _valid_rates(rate[starts], ids))


def _valid_rates(rates: np.ndarray, ids: Sequence[str]) -> np.ndarray:
    """Request rates per model: finite, >= 0 and within ``real``, or NaN (not known); anything else is refused,
    naming the model."""
    rates = np.asarray(rates, dtype="float64")
    bad = ~np.isnan(rates) & ~((rates >= 0) & (rates <= np.finfo(np.float32).max))
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        raise ValueError(f"forecast of model {ids[at]!r}: {REQUEST_RATE_COLUMN} must be a finite number >= 0, "
                         f"got {rates[at]}")
    return rates


def _array_fields(prefix: str, shape: tuple[int, ...]) -> list[tuple]:
    """Binary COPY layout of a ``real`` array of ``shape`` without NULLs: length, header, (4, value) pairs."""
    n = int(np.prod(shape)) if shape else 0
    if n == 0:
        return [(f"{prefix}_len", ">i4"), (f"{prefix}_hdr", ">i4", (3,))]
    return [(f"{prefix}_len", ">i4"), (f"{prefix}_hdr", ">i4", (3 + 2 * len(shape),)),
            (f"{prefix}_el", ">i4", (n, 2))]


def _fill_array(rows: np.ndarray, prefix: str, shape: tuple[int, ...], values: np.ndarray | None) -> None:
    """Fill one array column of the structured ``rows``; ``values`` is ``(len(rows), prod(shape))`` float32."""
    n = int(np.prod(shape)) if shape else 0
    if n == 0:
        rows[f"{prefix}_len"] = 12
        rows[f"{prefix}_hdr"] = (0, 0, FLOAT4_OID)
        return
    rows[f"{prefix}_len"] = 12 + 8 * len(shape) + 8 * n
    header = [len(shape), 0, FLOAT4_OID]
    for size in shape:
        header += [size, 1]
    rows[f"{prefix}_hdr"] = header
    elements = rows[f"{prefix}_el"]
    elements[:, :, 0] = 4
    elements[:, :, 1] = np.asarray(values, dtype=">f4").view(">i4")


#: Rows per COPY block: large enough for numpy to pay off, small enough to send one while building the next.
BLOCK_ROWS = 8192


def _version_codes(model_version_id, n_models: int) -> tuple[list[bytes | None], np.ndarray]:
    """The distinct versions (encoded; None = no version) and each model's index into them.

    ``model_version_id`` is one version for every model, or a sequence of one per model."""
    if model_version_id is None or isinstance(model_version_id, str):
        return [None if model_version_id is None else model_version_id.encode()], np.zeros(n_models, dtype=np.int64)
    per_model = list(model_version_id)
    if len(per_model) != n_models:
        raise ValueError(f"model_version_id: {len(per_model)} versions for {n_models} models")
    distinct = list(dict.fromkeys(per_model))
    index = {v: i for i, v in enumerate(distinct)}
    return ([None if v is None else str(v).encode() for v in distinct],
            np.fromiter((index[v] for v in per_model), dtype=np.int64, count=n_models))


def _copy_blocks(runs: _Runs, *, issued_at: datetime, model_version_id) -> Iterator[bytes]:
    """``COPY ... (FORMAT binary)`` data, one row per model, built as numpy structured arrays.

    Rows of equal byte length (same id length, number of target minutes, p_any
    present or not, request rate known or not, same model version) share one fixed layout; up to
    :data:`BLOCK_ROWS` of them are filled column by column and serialised with one ``tobytes``. The
    first block starts with the COPY signature, the last one ends with its trailer. ``model_version_id``:
    one for all models, or one per model (:func:`_version_codes`).
    """
    id_bytes = [m.encode() for m in runs.model_ids]
    id_len = np.fromiter((len(b) for b in id_bytes), dtype=np.int64, count=len(id_bytes))
    has_p_any = np.zeros(len(id_bytes), dtype=bool)
    if runs.p_any is not None:
        # a model whose p_any is all NaN stores NULL, as the row layout did
        has_p_any = np.add.reduceat(~np.isnan(runs.p_any), runs.starts) > 0
    issued_us = (issued_at - datetime(2000, 1, 1, tzinfo=timezone.utc)) // timedelta(microseconds=1)
    versions, version_of = _version_codes(model_version_id, len(id_bytes))
    n_levels = len(runs.levels)
    levels = np.asarray(runs.levels, dtype=np.float32)
    has_rate = np.zeros(len(id_bytes), dtype=bool) if runs.request_rate_rpm is None else \
        ~np.isnan(runs.request_rate_rpm)
    keys = pd.DataFrame({"id_len": id_len, "t": runs.lengths, "p": has_p_any, "r": has_rate, "v": version_of})
    yield COPY_SIGNATURE
    for (length, steps, with_p_any, with_rate, which), group in keys.groupby(["id_len", "t", "p", "r", "v"],
                                                                             sort=False).indices.items():
        steps = int(steps)
        version = versions[int(which)]
        fields = [("nf", ">i2"), ("id_len", ">i4"), ("id", f"S{int(length)}"),
                  ("iss_len", ">i4"), ("iss", ">i8"), ("ft_len", ">i4"), ("ft", ">i8"),
                  ("st_len", ">i4"), ("st", ">i4"), ("mv_len", ">i4")]
        if version is not None:
            fields.append(("mv", f"S{len(version)}"))
        fields += _array_fields("pt", (steps,))
        fields += _array_fields("pa", (steps,)) if with_p_any else [("pa_len", ">i4")]
        fields += _array_fields("lv", (n_levels,))
        fields += _array_fields("q", (n_levels, steps))
        fields += [("rr_len", ">i4"), ("rr", ">f4")] if with_rate else [("rr_len", ">i4")]
        layout = np.dtype(fields)
        for lo in range(0, len(group), BLOCK_ROWS):
            members = group[lo:lo + BLOCK_ROWS]
            rows = np.empty(len(members), dtype=layout)
            rows["nf"] = len(COPY_COLUMNS)
            rows["id_len"] = length
            rows["id"] = [id_bytes[i] for i in members]
            rows["iss_len"], rows["iss"] = 8, issued_us
            rows["ft_len"], rows["ft"] = 8, runs.first_target_us[members] - PG_EPOCH_US
            rows["st_len"], rows["st"] = 4, STEP_SECONDS
            if version is not None:
                rows["mv_len"], rows["mv"] = len(version), version
            else:
                rows["mv_len"] = -1
            # (models, steps) positions of these runs' values in the sorted long arrays
            at = runs.starts[members][:, None] + np.arange(steps)[None, :]
            _fill_array(rows, "pt", (steps,), runs.point[at])
            if with_p_any:
                _fill_array(rows, "pa", (steps,), runs.p_any[at])
            else:
                rows["pa_len"] = -1
            _fill_array(rows, "lv", (n_levels,), np.broadcast_to(levels, (len(members), n_levels)))
            # quantiles[level][minute]: (models, L, steps) from the (values, L) long columns
            _fill_array(rows, "q", (n_levels, steps),
                        runs.quantiles[at].transpose(0, 2, 1).reshape(len(members), n_levels * steps))
            if with_rate:
                rows["rr_len"], rows["rr"] = 4, runs.request_rate_rpm[members]
            else:
                rows["rr_len"] = -1
            yield rows.tobytes()
    yield COPY_TRAILER


def write_forecasts(
    engine: Engine,
    frame: pd.DataFrame,
    *,
    issued_at: datetime,
    model_version_id: str | None,
) -> int:
    """Store one forecast run, one row per model, with binary COPY; re-running the same ``issued_at`` replaces it.

    Args:
        frame: ``unique_id, ds`` (target minute, UTC), ``point``, optional
            ``p_any``, quantile columns named ``q<level>`` (``q0.9``), and an optional
            ``request_rate_rpm`` (a model's first row's is stored). Each
            model's ``ds`` must be consecutive whole minutes (any order).
        issued_at: when the forecast was made (the job's ``now``); its UTC day's
            partition is created when missing.
        model_version_id: the registry version that produced it.

    Returns:
        Target minutes written (models x minutes; the table holds one row per model).

    Raises:
        ValueError: NaN, an infinite, negative or too large value (beyond
            ``real``) in ``point`` or a quantile, a ``p_any`` outside [0, 1],
            a model whose target minutes are not consecutive whole minutes
            (the model is named), or an ``issued_at`` more than
            :data:`MAX_ISSUED_AHEAD_S` ahead of the database's clock.
            Nothing is written then.
    """
    if frame.empty:
        return 0
    return _store_runs(engine, _runs(frame), issued_at=issued_at, model_version_id=model_version_id)


def write_forecast_arrays(
    engine: Engine,
    model_ids: Sequence[str],
    first_target: datetime,
    columns: dict[str, np.ndarray],
    *,
    issued_at: datetime,
    model_version_id: str | None | Sequence[str | None],
    request_rate_rpm: np.ndarray | None = None,
) -> int:
    """Store one forecast run from ``(models x minutes)`` arrays, as the forecast job produces them.

    The same rows as :func:`write_forecasts`, without building (and then
    regrouping) a long frame of models x minutes rows: at 100,000 models that
    frame is 6 million rows every minute.

    Args:
        model_ids: one per array row.
        first_target: the target minute of column 0 (every model's first target).
        columns: ``point``, optional ``p_any``, and ``q<level>`` arrays, each ``(models, minutes)``.
        model_version_id: the registry version that produced the run, or one per model (a sharded champion
            whose failed shard was forecast by the fallback model: None for those rows). Every row of the run is
            written in one transaction whatever the versions, so a reader that loads runs issued after the
            newest it has seen never sees a part of one.
        request_rate_rpm: ``(models,)`` each model's requests per minute over the history forecast from
            (:func:`~forecaster.contracts.forecast.history_request_rate_rpm`); NaN where not known.
    """
    point = np.asarray(columns["point"], dtype="float64")
    n_models, n_minutes = point.shape
    if not n_models or not n_minutes:
        return 0
    levels = quantile_columns(pd.DataFrame(columns=list(columns)))
    ordered = sorted(levels, key=levels.get)
    q = (np.stack([np.asarray(columns[c], dtype="float64").reshape(-1) for c in ordered], axis=1) if ordered
         else np.empty((n_models * n_minutes, 0)))
    p_any_flat = None if columns.get("p_any") is None else np.asarray(columns["p_any"], "float64").reshape(-1)
    _refuse_bad_values(point.reshape(-1), q, p_any_flat, lambda row: str(model_ids[row // n_minutes]))
    first_ts = pd.Timestamp(first_target)
    first_us = (first_ts.tz_localize("UTC") if first_ts.tzinfo is None else first_ts).value // 1000  # ns -> us
    if first_us % (STEP_SECONDS * 1_000_000):
        raise ValueError(f"target minutes must be whole minutes, got first_target={first_target}")
    p_any = columns.get("p_any")
    runs = _Runs(model_ids=[str(m) for m in model_ids], first_target_us=np.full(n_models, first_us, dtype=np.int64),
                 lengths=np.full(n_models, n_minutes), starts=np.arange(n_models) * n_minutes,
                 point=point.reshape(-1), p_any=None if p_any is None else np.asarray(p_any, "float64").reshape(-1),
                 levels=tuple(levels[c] for c in ordered), quantiles=q,
                 request_rate_rpm=None if request_rate_rpm is None else _valid_rates(
                     np.asarray(request_rate_rpm, dtype="float64").reshape(n_models), model_ids))
    _version_codes(model_version_id, n_models)  # a wrong count is refused before anything is written
    return _store_runs(engine, runs, issued_at=issued_at, model_version_id=model_version_id)


def _store_runs(engine: Engine, runs: _Runs, *, issued_at: datetime, model_version_id) -> int:
    """Write validated runs (one row per model) in one transaction, replacing the same ``issued_at``."""
    if issued_at.tzinfo is None:
        issued_at = issued_at.replace(tzinfo=timezone.utc)
    with engine.connect() as conn:
        db_now = conn.execute(text("SELECT clock_timestamp()")).scalar()
    if (issued_at - db_now).total_seconds() > MAX_ISSUED_AHEAD_S:
        raise ValueError(f"forecast run issued_at {issued_at.isoformat()} is {(issued_at - db_now).total_seconds():.0f} s "
                         f"ahead of the database's clock ({db_now.isoformat()}; at most {MAX_ISSUED_AHEAD_S:g} s "
                         "allowed): is this writer's clock ahead? Nothing was written")
    ensure_forecast_partitions(engine, [issued_at.astimezone(timezone.utc).date()])
    with engine.begin() as conn:
        replaced = conn.execute(text("SELECT EXISTS (SELECT 1 FROM forecasts WHERE issued_at = :t)"),
                                {"t": issued_at}).scalar()
        if replaced:
            conn.execute(text("DELETE FROM forecasts WHERE issued_at = :t AND model_id = ANY(CAST(:ids AS text[]))"),
                         {"t": issued_at, "ids": runs.model_ids})
        cur = conn.connection.driver_connection.cursor()
        statement = f"COPY forecasts ({', '.join(COPY_COLUMNS)}) FROM STDIN (FORMAT binary)"
        # A queued writer sends from its own thread: the server parses one block while numpy builds the next.
        with driver_errors(conn, statement), cur, cur.copy(statement, writer=QueuedLibpqWriter(cur)) as copy:
            for block in _copy_blocks(runs, issued_at=issued_at, model_version_id=model_version_id):
                copy.write(block)
    return int(runs.lengths.sum())


# --- reading -----------------------------------------------------------------------


@dataclass(frozen=True)
class StoredForecast:
    """The latest forecast of one model."""

    model_id: str
    issued_at: datetime
    model_version_id: str | None
    frame: pd.DataFrame  # target_minute, point, p_any, q<level> columns


def _floats(values) -> np.ndarray:
    """A ``real[]`` as read by psycopg (NULL elements are None) -> float64, NaN for NULL."""
    return np.array([np.nan if v is None else v for v in (values or [])], dtype="float64")


def latest_forecast(conn: Connection, *, model_id: str, horizon_min: int | None = None) -> StoredForecast | None:
    """The most recent forecast run of ``model_id`` (first ``horizon_min`` target minutes), or None.

    One index probe of the primary key (model_id, issued_at) per partition.
    """
    row = conn.execute(
        text("SELECT issued_at, first_target, step_seconds, model_version_id, point, p_any, quantile_levels, "
             "quantiles FROM forecasts WHERE model_id = :m ORDER BY issued_at DESC LIMIT 1"),
        {"m": model_id},
    ).first()
    if row is None:
        return None
    issued, first, step_s, version, point, p_any, levels, quantiles = row
    point = _floats(point)
    steps = len(point) if not horizon_min else min(len(point), horizon_min)
    keep = np.flatnonzero(~np.isnan(point[:steps]))  # NULL elements (converted gaps) are no target minute
    frame = pd.DataFrame({
        "target_minute": [first + timedelta(seconds=int(step_s) * int(k)) for k in keep],
        "point": point[keep],
        "p_any": _floats(p_any)[keep] if p_any is not None else np.full(len(keep), np.nan),
    })
    for j, level in enumerate(levels or []):
        frame[quantile_column(stored_level(level))] = _floats(quantiles[j])[keep]
    return StoredForecast(model_id=model_id, issued_at=issued, model_version_id=version, frame=frame)


@dataclass(frozen=True)
class ForecastRuns:
    """Several models' runs as flat arrays: run ``i``'s values are ``[offsets[i], offsets[i + 1])``.

    Attributes:
        model_ids: (R,) one run per model, in no particular order.
        issued_at_s: (R,) Unix seconds.
        first_target_s: (R,) Unix seconds of each run's first element.
        step_seconds: (R,) seconds between elements.
        model_version_ids: (R,) None where unknown.
        offsets: (R + 1,) into ``point`` and ``p_any``.
        point, p_any: flat float64; NaN for NULL elements (and for every element of a NULL ``p_any``).
        levels: (R,) each run's ascending quantile levels.
        quantile_offsets: (R + 1,) into ``quantile_values``.
        quantile_values: flat float64, each run's ``(L, T)`` array row by row; see :meth:`quantiles`.
        request_rate_rpm: (R,) each run's model's request rate, NaN where not stored; None unless asked for.
    """

    model_ids: list[str]
    issued_at_s: np.ndarray
    first_target_s: np.ndarray
    step_seconds: np.ndarray
    model_version_ids: list[str | None]
    offsets: np.ndarray
    point: np.ndarray
    p_any: np.ndarray
    levels: list[tuple[float, ...]]
    quantile_offsets: np.ndarray
    quantile_values: np.ndarray
    request_rate_rpm: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.model_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def target_minutes_s(self) -> np.ndarray:
        """Unix seconds of every element's target minute, aligned with ``point``."""
        run = np.repeat(np.arange(len(self)), self.lengths)
        return self.first_target_s[run] + self.step_seconds[run] * (np.arange(int(self.offsets[-1]))
                                                                     - self.offsets[:-1][run])

    def quantiles(self, i: int) -> np.ndarray:
        """Run ``i``'s quantiles as ``(T, L)``: one row per target minute, columns in the order of its levels."""
        steps = int(self.offsets[i + 1] - self.offsets[i])
        flat = self.quantile_values[self.quantile_offsets[i]:self.quantile_offsets[i + 1]]
        return flat.reshape(len(self.levels[i]), steps).T


_ELEMENT = np.dtype([("len", ">i4"), ("value", ">f4")])
_HEADER = struct.Struct(">iii")  # ndim, has_null, element type
_FIXED = struct.Struct(">iqiqii")  # issued_at, first_target, step_seconds, each with its length


def _real_array(buf: bytes, pos: int) -> tuple[np.ndarray, int]:
    """The binary ``real[]`` whose data starts at ``pos`` -> (float32 values in storage order, elements)."""
    ndim, has_null, _ = _HEADER.unpack_from(buf, pos)
    if ndim == 0:
        return np.empty(0, dtype=np.float32), 0
    n = 1
    for d in range(ndim):
        n *= struct.unpack_from(">i", buf, pos + 12 + 8 * d)[0]
    start = pos + 12 + 8 * ndim
    if not has_null:
        return np.frombuffer(buf, dtype=_ELEMENT, count=n, offset=start)["value"], n
    values = np.full(n, np.nan, dtype=np.float32)
    for k in range(n):  # rare: only runs converted from the row layout with gaps hold NULL elements
        (length,) = struct.unpack_from(">i", buf, start)
        start += 4
        if length >= 0:
            (values[k],) = struct.unpack_from(">f", buf, start)
            start += length
    return values, n


def _parse_runs(buf: bytes, *, with_p_any: bool, with_request_rate: bool = False) -> ForecastRuns:
    """Rows of the binary COPY of :func:`read_newest_runs`: one light walk, values gathered by numpy."""
    unpack_i, unpack_h = struct.Struct(">i").unpack_from, struct.Struct(">h").unpack_from
    unpack_f = struct.Struct(">f").unpack_from
    pos = len(COPY_SIGNATURE)
    pos += unpack_i(buf, pos - 4)[0]  # header extension, none so far
    ids, versions, fixed, levels, points, p_anys, quantiles, rates = [], [], [], [], [], [], [], []
    level_cache: dict[bytes, tuple[float, ...]] = {}
    while pos < len(buf):
        if unpack_h(buf, pos)[0] == -1:
            break
        (n,) = unpack_i(buf, pos + 2)
        ids.append(buf[pos + 6:pos + 6 + n].decode())
        pos += 6 + n
        fixed.append(_FIXED.unpack_from(buf, pos))
        pos += 32
        (n,) = unpack_i(buf, pos)
        versions.append(buf[pos + 4:pos + 4 + n].decode() if n >= 0 else None)
        pos += 4 + max(n, 0)
        (n,) = unpack_i(buf, pos)
        values, steps = _real_array(buf, pos + 4)
        points.append(values)
        pos += 4 + n
        if with_p_any:
            (n,) = unpack_i(buf, pos)
            p_anys.append(_real_array(buf, pos + 4)[0] if n >= 0 else np.full(steps, np.nan, dtype=np.float32))
            pos += 4 + max(n, 0)
        (n,) = unpack_i(buf, pos)
        key = buf[pos + 4:pos + 4 + n]
        if key not in level_cache:
            level_cache[key] = tuple(stored_level(v) for v in _real_array(buf, pos + 4)[0])
        levels.append(level_cache[key])
        pos += 4 + n
        (n,) = unpack_i(buf, pos)
        quantiles.append(_real_array(buf, pos + 4)[0])
        pos += 4 + n
        if with_request_rate:
            (n,) = unpack_i(buf, pos)
            rates.append(unpack_f(buf, pos + 4)[0] if n >= 0 else np.nan)
            pos += 4 + max(n, 0)
    lengths = np.fromiter((len(p) for p in points), dtype=np.int64, count=len(points))
    q_lengths = np.fromiter((len(q) for q in quantiles), dtype=np.int64, count=len(quantiles))
    fixed_array = np.array(fixed, dtype=np.int64).reshape(-1, 6)

    def flat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts, dtype=np.float64, casting="safe") if parts else np.empty(0)

    return ForecastRuns(
        model_ids=ids,
        issued_at_s=(fixed_array[:, 1] + PG_EPOCH_US) / 1e6,
        first_target_s=(fixed_array[:, 3] + PG_EPOCH_US) // 1_000_000,
        step_seconds=fixed_array[:, 5],
        model_version_ids=versions,
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        point=flat(points),
        p_any=flat(p_anys) if with_p_any else np.full(int(lengths.sum()), np.nan),
        levels=levels,
        quantile_offsets=np.concatenate([[0], np.cumsum(q_lengths)]).astype(np.int64),
        quantile_values=flat(quantiles),
        request_rate_rpm=np.array(rates, dtype="float64") if with_request_rate else None,
    )


def read_newest_runs(conn: Connection, *, issued_after: datetime | None = None,
                     issued_at_most: datetime | None = None, targets_from: datetime | None = None,
                     targets_before: datetime | None = None, with_p_any: bool = False,
                     with_request_rate: bool = False) -> ForecastRuns:
    """Each model's newest run (optionally only runs issued in ``(issued_after, issued_at_most]``), as arrays.

    Without ``issued_after``, every registered model's newest run is one probe
    of the primary key (model_id, issued_at) per model; with it, the runs
    issued since are found through the ``issued_at`` index (a model with
    several keeps its newest). With
    ``targets_from``/``targets_before``, each run is cut to its elements for
    target minutes in ``[targets_from, targets_before)`` in SQL, so that only
    those travel. Streamed with binary COPY and parsed without a Python loop
    per value. ``with_request_rate``: each run's ``request_rate_rpm`` too.
    """
    params: dict = {}
    bounds = []
    if issued_at_most is not None:
        bounds.append("issued_at <= %(until)s")
        params["until"] = issued_at_most
    if issued_after is not None:
        # Runs issued since, less those a newer run in the window supersedes (one primary-key probe each);
        # cheaper than DISTINCT ON, which sorts the whole wide rows.
        bounds.append("issued_at > %(since)s")
        params["since"] = issued_after
        newer = " AND ".join(f"g.{b}" for b in bounds)
        source = (f"SELECT * FROM forecasts f WHERE {' AND '.join(f'f.{b}' for b in bounds)} AND NOT EXISTS ("
                  f"SELECT 1 FROM forecasts g WHERE g.model_id = f.model_id AND g.issued_at > f.issued_at "
                  f"AND {newer})")
    else:
        where = "".join(f" AND f.{b}" for b in bounds)
        source = ("SELECT f.* FROM (SELECT id FROM serving_models ORDER BY id) m CROSS JOIN LATERAL ("
                  "SELECT * FROM forecasts f "
                  f"WHERE f.model_id = m.id{where} ORDER BY f.issued_at DESC LIMIT 1) f")
    if targets_from is not None or targets_before is not None:
        # elements k (1-based) with target first_target + (k - 1) * step in [from, before)
        lo = ("1" if targets_from is None else
              "greatest(1, CAST(ceil((EXTRACT(EPOCH FROM %(t_from)s::timestamptz) - EXTRACT(EPOCH FROM first_target))"
              " / step_seconds) AS integer) + 1)")
        hi = ("cardinality(point)" if targets_before is None else
              "CAST(ceil((EXTRACT(EPOCH FROM %(t_before)s::timestamptz) - EXTRACT(EPOCH FROM first_target)) "
              "/ step_seconds) AS integer)")
        params.update({"t_from": targets_from, "t_before": targets_before})
        source = (f"SELECT model_id, issued_at, first_target + (k_lo - 1) * step_seconds * interval '1 second' "
                  "AS first_target, step_seconds, model_version_id, point[k_lo:k_hi] AS point, "
                  "p_any[k_lo:k_hi] AS p_any, quantile_levels, quantiles[:][k_lo:k_hi] AS quantiles, "
                  "request_rate_rpm "
                  f"FROM (SELECT *, {lo} AS k_lo, {hi} AS k_hi FROM ({source}) AS newest) AS cut "
                  "WHERE k_hi >= k_lo AND k_lo <= cardinality(point)")
    columns = "model_id, issued_at, first_target, step_seconds, model_version_id, point, " + \
        ("p_any, " if with_p_any else "") + "quantile_levels, quantiles" + \
        (", request_rate_rpm" if with_request_rate else "")
    # No ORDER BY: sorting 1.3 KB rows would spill to disk; callers index by model id.
    query = f"COPY (SELECT {columns} FROM ({source}) AS runs) TO STDOUT (FORMAT binary)"
    chunks = []
    raw = conn.connection.driver_connection
    with driver_errors(conn, query), raw.cursor() as cur, cur.copy(query, params or None) as copy:
        for block in copy:
            chunks.append(bytes(block))
    return _parse_runs(b"".join(chunks), with_p_any=with_p_any, with_request_rate=with_request_rate)
