"""Validation of raw per-model counts, in one place (cf. mlforecast's data_validation).

Every ingest path (trace files, Prometheus, pushed batches) turns its input into
a *raw* long frame and hands it to :func:`build_count_batch`, which either
returns a :class:`~forecaster.contracts.batches.CountBatch` or raises
:class:`~forecaster.contracts.batches.IngestError` naming the first bad row and field.
Nothing is dropped silently: the only rows removed are zero counts, which the
batch's coverage window still speaks for.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import numpy as np
import pandas as pd

from forecaster.contracts.batches import COUNT_COLUMNS, CountBatch, IngestError
from forecaster.store.fields import ISO_8601, MAX_ID_LENGTH, MIN_TIMESTAMP, safe_repr, safe_value, text_problem


#: Largest count per step accepted: exact in float64 and far above any real service.
MAX_COUNT = 2**53
#: Longest span (first window start to last window end) one batch may cover by default, days.
#: Each day is a partition the write locks; 20 years of days exhausted ``max_locks_per_transaction``.
DEFAULT_MAX_SPAN_DAYS = 62


def _row_of(raw: pd.DataFrame, position: int) -> int:
    """1-based source row of the frame's ``position``-th row."""
    if "row" in raw.columns:
        return int(raw["row"].iloc[position])
    return position + 1


def _field_of(raw: pd.DataFrame, position: int, default: str) -> str:
    if "field" in raw.columns:
        return str(raw["field"].iloc[position])
    return default


def _first_bad(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None


def _parse_model_ids(raw: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Integer code per row and the sorted, stripped distinct ids.

    Works on the distinct ids only: a wide trace repeats each id thousands of times.
    """
    ids = raw["unique_id"]
    codes, uniques = pd.factorize(ids, use_na_sentinel=True)
    stripped = pd.Index(uniques).astype(str).str.strip()
    empty = np.append(np.asarray(stripped == ""), True)  # last slot: the NA sentinel (-1)
    bad = _first_bad(empty[codes])
    if bad is not None:
        raise IngestError("missing_model", "model id is empty", row=_row_of(raw, bad), field="unique_id",
                          value=_plain(ids.iloc[bad]))
    too_long = np.append(np.asarray(stripped.str.len() > MAX_ID_LENGTH), False)
    bad = _first_bad(too_long[codes])
    if bad is not None:
        raise IngestError("id_too_long", f"model id is longer than {MAX_ID_LENGTH} characters",
                          row=_row_of(raw, bad), field="unique_id", value=str(ids.iloc[bad])[:40] + "...")
    for position_in_uniques, candidate in enumerate(stripped):
        problem = text_problem(candidate, max_length=MAX_ID_LENGTH)
        if problem:
            bad = int(np.flatnonzero(codes == position_in_uniques)[0])
            raise IngestError("bad_model_id", f"model id {problem}", row=_row_of(raw, bad), field="unique_id",
                              value=safe_value(candidate))
    # Two raw spellings (" a", "a") are one model once stripped.
    final_codes, final_uniques = pd.factorize(stripped, sort=True)
    return final_codes[codes], np.asarray(final_uniques, dtype=object)


def _numeric_mask(values: pd.Series) -> np.ndarray:
    if pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values):
        return np.ones(len(values), dtype=bool)
    if values.dtype == object:
        return values.map(lambda v: isinstance(v, (int, float, np.integer, np.floating))
                          and not isinstance(v, bool)).to_numpy(dtype=bool)
    return np.zeros(len(values), dtype=bool)


def parse_timestamps(raw: pd.DataFrame) -> pd.Series:
    """``raw["ds"]`` as UTC timestamps (ISO 8601 text or datetimes; no zone = UTC), or an IngestError naming the
    first bad row (``raw["row"]`` when present)."""
    ds = raw["ds"]
    bad = _first_bad(_numeric_mask(ds))
    if bad is not None:
        raise IngestError(
            "bad_timestamp",
            f"numeric timestamp {_plain(ds.iloc[bad])!r} is ambiguous (seconds? milliseconds?); send ISO 8601 text",
            row=_row_of(raw, bad),
            field="ds",
            value=_plain(ds.iloc[bad]),
        )
    if pd.api.types.is_datetime64_any_dtype(ds):
        parsed = ds if getattr(ds.dt, "tz", None) is not None else ds.dt.tz_localize("UTC")
        parsed = parsed.dt.tz_convert("UTC")
    else:
        _check_timestamp_text(raw, ds)
        parsed = pd.to_datetime(ds, utc=True, errors="coerce", format="mixed")
    bad = _first_bad(parsed.isna().to_numpy())
    if bad is not None:
        raise IngestError(
            "bad_timestamp",
            f"cannot read {safe_repr(ds.iloc[bad])} as a timestamp",
            row=_row_of(raw, bad),
            field="ds",
            value=safe_value(ds.iloc[bad]),
        )
    bad = _first_bad((parsed < pd.Timestamp(MIN_TIMESTAMP)).to_numpy())
    if bad is not None:
        raise IngestError(
            "timestamp_too_early",
            f"timestamp {parsed.iloc[bad].isoformat()} is before {MIN_TIMESTAMP.date().isoformat()}, the earliest "
            "accepted",
            row=_row_of(raw, bad),
            field="ds",
            value=parsed.iloc[bad].isoformat(),
        )
    return parsed


def _check_timestamp_text(raw: pd.DataFrame, ds: pd.Series) -> None:
    """Text timestamps must be ISO 8601: pandas would read ``now``, ``today`` or ``yesterday`` as times.

    Checked on the distinct values only (a long trace repeats each minute once per model).
    """
    if ds.dtype != object and not pd.api.types.is_string_dtype(ds):
        return
    distinct = pd.unique(ds.dropna())
    texts = [v for v in distinct if isinstance(v, str)]
    wrong = [v for v in texts if not ISO_8601.fullmatch(v.strip())]
    wrong += [v for v in distinct if not isinstance(v, (str, datetime, pd.Timestamp, np.datetime64))]
    if wrong:
        bad = int(np.flatnonzero(ds.map(lambda v: v is wrong[0] or v == wrong[0]).to_numpy(dtype=bool))[0])
        raise IngestError(
            "bad_timestamp",
            f"expected ISO 8601 text such as 2026-11-29T12:00:00Z, got {safe_repr(wrong[0])}",
            row=_row_of(raw, bad),
            field="ds",
            value=safe_value(wrong[0]),
        )


def _utc_ns(stamps: pd.Series) -> np.ndarray:
    """UTC timestamps as int64 nanoseconds (tz-aware values would become slow Python objects)."""
    return stamps.dt.tz_convert(None).to_numpy().astype("datetime64[ns]").view("int64")


def _plain(value: object) -> object:
    """numpy scalars as plain Python values, so messages read ``-2``, not ``np.int64(-2)``."""
    return value.item() if isinstance(value, np.generic) else value


def parse_counts(raw: pd.DataFrame) -> np.ndarray:
    """``raw["y"]`` as int64 counts, or an IngestError naming the first bad row and field (``raw["row"]`` and
    ``raw["field"]`` when present): not a number, NaN, infinite, negative, fractional or too large."""
    y = raw["y"]
    if pd.api.types.is_bool_dtype(y):
        is_bool = np.ones(len(y), dtype=bool)
    elif y.dtype == object:
        is_bool = y.map(lambda v: isinstance(v, (bool, np.bool_))).to_numpy(dtype=bool)
    else:
        is_bool = np.zeros(len(y), dtype=bool)
    source = y
    if y.dtype == object:
        # A JSON integer of 310 digits or more is a Python int that no float holds: converting it raised
        # OverflowError (a 500). Past the limit its size does not matter: twice the limit, with its sign, fails
        # the same checks below (the message shows the original).
        source = y.map(lambda v: (2 * MAX_COUNT if v > 0 else -2 * MAX_COUNT)
                       if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_COUNT else v)
    numeric = (pd.to_numeric(source.where(~is_bool), errors="coerce") if is_bool.any()
               else pd.to_numeric(source, errors="coerce"))
    values = numeric.to_numpy(dtype="float64", na_value=np.nan)
    if y.dtype == object:
        # Python ints beyond 2^53 round on their way to float64 (2^53 + 1 became 2^53 and was stored off by one):
        # look at the originals of the values that reached 2^53, exactly.
        with np.errstate(invalid="ignore"):
            near = np.flatnonzero(values >= MAX_COUNT)
        for position in near:
            original = y.iloc[int(position)]
            if isinstance(original, (int, np.integer)) and not isinstance(original, bool) and original > MAX_COUNT:
                raise IngestError("count_too_large", f"count exceeds {MAX_COUNT:,} per step",
                                  row=_row_of(raw, int(position)), field=_field_of(raw, int(position), "y"),
                                  value=safe_value(original))
    with np.errstate(invalid="ignore"):
        too_large = np.isfinite(values) & (values > MAX_COUNT)
    if pd.api.types.is_integer_dtype(y) and len(y):
        # int64 (a CSV column of whole numbers) is cast to float64 above, where 2^53 + 1 is 2^53 and passed: compare
        # the integers themselves (below the limit float64 holds them exactly)
        too_large = (y > MAX_COUNT).to_numpy(dtype=bool, na_value=False)
    not_numeric = (numeric.isna().to_numpy() & ~pd.isna(y).to_numpy()) | is_bool
    with np.errstate(invalid="ignore"):
        checks = (
            (not_numeric, "not_a_number", "count is not a number"),
            (np.isnan(values) & ~not_numeric, "nan", "count is missing or NaN"),
            (np.isinf(values), "infinite", "count is infinite"),
            (values < 0, "negative_count", "count is negative"),
            (np.isfinite(values) & (values != np.floor(values)), "non_integer_count", "count is not a whole number"),
            (too_large, "count_too_large", f"count exceeds {MAX_COUNT:,} per step"),
        )
    # Report the first bad row, whatever is wrong with it.
    firsts = [(_first_bad(mask), order) for order, (mask, _, _) in enumerate(checks)]
    found = [(position, order) for position, order in firsts if position is not None]
    if found:
        position, order = min(found)
        _, reason, text = checks[order]
        plain = _plain(y.iloc[position])
        raise IngestError(reason, f"{text}: {safe_repr(plain)}", row=_row_of(raw, position),
                          field=_field_of(raw, position, "y"), value=plain if isinstance(plain, float) or (
                              isinstance(plain, int) and abs(plain) <= MAX_COUNT)
                          else safe_value(plain))
    return values.astype("int64")


def _check_step_totals(bucketed: pd.DataFrame, uniques: np.ndarray) -> None:
    """Each step's summed count within :data:`MAX_COUNT`, and the batch's total within int64.

    Rows are checked one by one, then summed per step in int64: rows of one step adding up past 2^63 wrapped
    negative, the step was then dropped as zero while its window still covered it (the stored count deleted,
    the batch answered 200). Sums in float64 are close enough to tell: only a batch whose whole sum reaches the
    limit is grouped again."""
    values = bucketed["y"].to_numpy(dtype="float64")
    if not len(values) or values.sum() <= MAX_COUNT:
        return
    totals = bucketed.assign(y=values).groupby(["model", "ds"], sort=True)["y"].sum()
    over = np.flatnonzero(totals.to_numpy() > MAX_COUNT)
    if len(over):
        model, step_ns = totals.index[int(over[0])]
        raise IngestError("count_too_large", f"the rows of step {pd.Timestamp(step_ns, tz='UTC').isoformat()} of "
                          f"model {safe_repr(uniques[model])} add up to more than {MAX_COUNT:,}",
                          field="y", value=float(totals.iloc[int(over[0])]))
    if values.sum() >= 2.0**63:
        raise IngestError("count_too_large", "the batch's counts add up to more than 2^63", field="y")


def _check_duplicates(raw: pd.DataFrame, codes: np.ndarray, ds_ns: np.ndarray, uniques: np.ndarray,
                      ds: pd.Series) -> None:
    keys = pd.DataFrame({"model": codes, "ds": ds_ns})
    dup = keys.duplicated(keep=False).to_numpy()
    bad = _first_bad(dup)
    if bad is None:
        return
    same = np.flatnonzero(dup & (codes == codes[bad]) & (ds_ns == ds_ns[bad]))
    rows = [_row_of(raw, int(p)) for p in same[:2]]
    raise IngestError(
        "duplicate",
        f"model {uniques[codes[bad]]!r} at {ds.iloc[bad].isoformat()} appears more than once "
        f"(rows {rows[0]} and {rows[1]})",
        row=rows[1],
        field="ds",
        value=ds.iloc[bad].isoformat(),
    )


def _utc(moment: datetime) -> pd.Timestamp:
    stamp = pd.Timestamp(moment)
    return stamp.tz_localize("UTC") if stamp.tzinfo is None else stamp.tz_convert("UTC")


def _check_future(raw: pd.DataFrame, ds: pd.Series, now: datetime, max_future_skew_s: float) -> None:
    limit = _utc(now) + timedelta(seconds=max_future_skew_s)
    bad = _first_bad((ds > limit).to_numpy())
    if bad is not None:
        raise IngestError(
            "future_timestamp",
            f"timestamp {ds.iloc[bad].isoformat()} is more than {max_future_skew_s:g} s "
            f"ahead of now ({_utc(now).isoformat()}); check the sender's clock",
            row=_row_of(raw, bad),
            field="ds",
            value=ds.iloc[bad].isoformat(),
        )


def _check_known_models(raw: pd.DataFrame, codes: np.ndarray, uniques: np.ndarray,
                        known_models: set[str] | None) -> None:
    if known_models is None:
        return
    unknown_unique = np.fromiter((u not in known_models for u in uniques), dtype=bool, count=len(uniques))
    bad = _first_bad(unknown_unique[codes]) if unknown_unique.any() else None
    if bad is not None:
        missing = uniques[unknown_unique]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise IngestError(
            "unknown_model",
            f"model {uniques[codes[bad]]!r} is not registered{more}; register it first "
            "or enable PREWARM_AUTO_REGISTER_MODELS",
            row=_row_of(raw, bad),
            field="unique_id",
            value=uniques[codes[bad]],
        )


def _default_windows(uniques: np.ndarray, steps: pd.DataFrame, step_ns: int) -> pd.DataFrame:
    """Each model from its first to its last step (``steps``: int columns ``model``, ``ds``)."""
    grouped = steps.groupby("model", sort=True)["ds"]
    first, last = grouped.min(), grouped.max()
    return pd.DataFrame(
        {
            "unique_id": uniques[first.index.to_numpy()],
            "start": pd.to_datetime(first.to_numpy(), utc=True),
            "end": pd.to_datetime(last.to_numpy() + step_ns, utc=True),
        }
    )


def _check_windows(
    windows: pd.DataFrame,
    uniques: np.ndarray,
    steps: pd.DataFrame,
    step_seconds: int,
    *,
    now: datetime,
    max_future_skew_s: float,
    known_models: set[str] | None,
) -> pd.DataFrame:
    missing = {"unique_id", "start", "end"} - set(windows.columns)
    if missing:
        raise IngestError("bad_window", f"windows lack columns {sorted(missing)}")
    windows = windows[["unique_id", "start", "end"]].copy()
    for col in ("unique_id", "start", "end"):
        if windows[col].isna().any():
            raise IngestError("bad_window", f"a window has no {col}", field=col)
    windows["unique_id"] = windows["unique_id"].astype(str).str.strip()
    # a model with no count in the batch (an all-zero row of a wide trace) is checked here, not with the counts
    for uid in pd.unique(windows["unique_id"]):
        problem = "is empty" if not uid else text_problem(uid, max_length=MAX_ID_LENGTH)
        if problem:
            raise IngestError("missing_model" if not uid else "bad_model_id", f"model id {problem}",
                              field="unique_id", value=safe_value(uid))
    if known_models is not None and not windows["unique_id"].isin(known_models).all():
        uid = windows.loc[~windows["unique_id"].isin(known_models), "unique_id"].iloc[0]
        raise IngestError("unknown_model", f"model {uid!r} is not registered", field="unique_id", value=uid)
    for col in ("start", "end"):
        windows[col] = pd.to_datetime(windows[col], utc=True)
        misaligned = windows[col].dt.floor(f"{step_seconds}s") != windows[col]
        if misaligned.any():
            uid = windows.loc[misaligned, "unique_id"].iloc[0]
            raise IngestError("bad_window", f"window {col} for model {uid!r} is not aligned to {step_seconds} s",
                              field=col)
    too_late = windows["end"] > _utc(now) + timedelta(seconds=max_future_skew_s + step_seconds)
    if too_late.any():
        uid = windows.loc[too_late, "unique_id"].iloc[0]
        raise IngestError("future_timestamp", f"window for model {uid!r} reaches past now ({_utc(now).isoformat()})",
                          field="end")
    if windows["unique_id"].duplicated().any():
        uid = windows.loc[windows["unique_id"].duplicated(), "unique_id"].iloc[0]
        raise IngestError("bad_window", f"model {uid!r} has more than one window", field="unique_id")
    if (windows["end"] <= windows["start"]).any():
        uid = windows.loc[windows["end"] <= windows["start"], "unique_id"].iloc[0]
        raise IngestError("bad_window", f"window for model {uid!r} ends before it starts", field="end")
    # Look each step's window up by position rather than merging 2M rows.
    where = pd.Index(windows["unique_id"]).get_indexer(uniques)[steps["model"].to_numpy()]
    ds_ns = steps["ds"].to_numpy()
    start_ns = np.append(_utc_ns(windows["start"]), 0)
    end_ns = np.append(_utc_ns(windows["end"]), 0)
    outside = (where < 0) | (ds_ns < start_ns[where]) | (ds_ns >= end_ns[where])
    bad = _first_bad(outside)
    if bad is not None:
        model = uniques[steps["model"].iloc[bad]]
        at = pd.Timestamp(int(ds_ns[bad]), tz="UTC").isoformat()
        raise IngestError("outside_window", f"count for model {model!r} at {at} lies outside the window the "
                          "batch declares", field="ds", value=at)
    return windows


def _check_span(windows: pd.DataFrame, max_span_days: float) -> None:
    if windows.empty:
        return
    first, last = windows["start"].min(), windows["end"].max()
    span = last - first
    if span > pd.Timedelta(days=max_span_days):
        raise IngestError(
            "span_too_long",
            f"the batch spans {span.total_seconds() / 86400:.1f} days ({first.isoformat()} to {last.isoformat()}), "
            f"more than PREWARM_MAX_BATCH_SPAN_DAYS={max_span_days:g}; send it in shorter batches",
            field="ds",
            value=first.isoformat(),
        )


def build_count_batch(
    raw: pd.DataFrame,
    *,
    source: str,
    step_seconds: int,
    now: datetime,
    max_future_skew_s: float = 300.0,
    known_models: set[str] | None = None,
    windows: pd.DataFrame | None = None,
    max_span_days: float = DEFAULT_MAX_SPAN_DAYS,
) -> CountBatch:
    """Validate raw counts and bucket them into steps.

    Args:
        raw: long frame with ``unique_id``, ``ds``, ``y``; optional ``row``
            (1-based source row for messages) and ``field`` (source column of
            ``y``, for wide formats). Timestamps without a zone are UTC.
        source: the coverage source name recorded with the batch.
        step_seconds: step width; timestamps inside a step are bucketed (their
            counts summed) to the step's start.
        now: the current time, for the clock-skew check.
        max_future_skew_s: how far ahead of ``now`` a timestamp may lie.
        known_models: registered model ids; ``None`` accepts any id (the caller
            auto-registers).
        windows: explicit coverage per model (``unique_id, start, end``);
            default: from each model's first to its last step.
        max_span_days: longest span from the earliest window start to the
            latest window end, days (``PREWARM_MAX_BATCH_SPAN_DAYS``); a
            longer batch is refused (``span_too_long``) before anything,
            partitions included, is created.

    Returns:
        The validated batch; zero-count steps are left out of ``counts``.

    An exact repeat of ``(unique_id, ds)`` is rejected as a resent row;
    distinct timestamps inside one step are sub-step events and are summed.
    Numeric timestamps are rejected (seconds and nanoseconds look alike).

    Raises:
        IngestError: on the first bad row, naming row, field and value.
    """
    if step_seconds <= 0:
        raise IngestError("bad_step", f"step_seconds must be positive, got {step_seconds}")
    missing = [c for c in COUNT_COLUMNS if c not in raw.columns]
    if missing:
        raise IngestError("missing_column", f"input lacks columns {missing}; expected {list(COUNT_COLUMNS)}")
    raw = raw.reset_index(drop=True)
    codes, uniques = _parse_model_ids(raw)
    ds = parse_timestamps(raw)
    y = parse_counts(raw)
    # Work on integer codes and int64 nanoseconds: tz-aware objects are slow at 2M rows.
    ds_ns = _utc_ns(ds)
    _check_duplicates(raw, codes, ds_ns, uniques, ds)
    _check_future(raw, ds, now, max_future_skew_s)
    _check_known_models(raw, codes, uniques, known_models)

    step = pd.Timedelta(seconds=step_seconds)
    step_ns = step.value
    bucketed = pd.DataFrame({"model": codes, "ds": (ds_ns // step_ns) * step_ns, "y": y})
    summed = bucketed.groupby(["model", "ds"], sort=True, as_index=False)["y"].sum()
    _check_step_totals(bucketed, uniques)
    if windows is None:
        windows = _default_windows(uniques, summed, step_ns)
    else:
        windows = _check_windows(windows, uniques, summed, step_seconds, now=now,
                                 max_future_skew_s=max_future_skew_s, known_models=known_models)
    _check_span(windows, max_span_days)
    nonzero = summed[summed["y"] > 0]  # zeros stay implied by the windows
    counts = pd.DataFrame(
        {
            "unique_id": uniques[nonzero["model"].to_numpy()],
            "ds": pd.to_datetime(nonzero["ds"].to_numpy(), utc=True),
            "y": nonzero["y"].to_numpy().astype("int64"),
        }
    )
    return CountBatch(source=source, step_seconds=step_seconds, counts=counts, windows=windows.reset_index(drop=True))
