"""Readers for public workload trace files.

Each reader turns one trace file into a :class:`RawTrace`: a *raw* long frame
(``unique_id, ds, y, row, field``) plus the step width, the coverage windows
and a source name. Nothing here judges the counts: the raw frame goes to
:func:`forecaster.ingest.validate.build_count_batch`, which rejects NaN,
negative, fractional or duplicate counts and names the source row and column.
Readers only raise :class:`~forecaster.contracts.batches.IngestError` for problems
that the raw frame cannot express (an unreadable timestamp, a broken JSON line,
a missing column), so every cell of a wide file reaches validation, zeros
included.

Formats (see ``/work/shared/traces/README.md`` and ``forecaster/data/README.md``):

``azure2019``
    Azure Functions 2019 per-minute wide CSV: ``HashFunction, HashOwner,
    HashApp, minute_1 .. minute_N``; one row per function, one column per minute.
``huawei5min``
    Huawei Cloud 5-minute wide CSV: ``date, <channel>, ...``; one column per
    request channel, one row per 5-minute bin.
``azure_llm2023``
    Azure LLM inference 2023 per-request CSV: ``TIMESTAMP, ContextTokens,
    GeneratedTokens``; one service per file.
``mooncake``
    Mooncake (Kimi) FAST'25 JSONL: one request per line, ``timestamp`` in ms
    from the start of the trace; one service per file.
``azure2021``
    Azure Functions 2021 per-invocation CSV: ``app, func, end_timestamp,
    duration`` (both in seconds from the start of the trace).
``long``
    Generic long format, CSV or Parquet: ``unique_id, ds, y``, one row per
    model per step.

Per-request formats (``azure_llm2023``, ``mooncake``, ``azure2021``) are binned
here to one-minute counts, because validation treats two raw rows with the same
``(unique_id, ds)`` as a duplicate. Their ``row`` is the first source row that
fell into the minute.

All files may be gzip-compressed; compression is recognised by its magic bytes,
not the file name.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd

from forecaster.contracts.batches import COUNT_COLUMNS, IngestError
from forecaster.contracts.bursts import burst_factors
from forecaster.ingest.validate import MAX_COUNT, parse_counts
from forecaster.store.fields import ISO_8601, safe_repr, safe_value

TRACE_FORMATS = ("azure2019", "huawei5min", "azure_llm2023", "mooncake", "azure2021", "long")

#: Default origin for the Azure Functions 2019 day. The invitro sample does not
#: say which of the trace's 14 days (2019-07-15 .. 07-28) it was cut from, so
#: the first day is used; pass ``start=`` to place it elsewhere.
AZURE2019_DEFAULT_START = datetime(2019, 7, 15, tzinfo=timezone.utc)
#: Default origin for Mooncake: the trace only has ms offsets from its start.
MOONCAKE_DEFAULT_START = datetime(2024, 1, 1, tzinfo=timezone.utc)
#: Default origin for Azure Functions 2021: the trace covers two weeks from
#: 2021-01-31; which part the excerpt comes from is not documented.
AZURE2021_DEFAULT_START = datetime(2021, 1, 31, tzinfo=timezone.utc)

_MINUTE = pd.Timedelta(minutes=1)
_MINUTE_NS = 60_000_000_000
_MINUTE_COLUMN = re.compile(r"minute_(\d+)")
_GZIP_MAGIC = b"\x1f\x8b"
_PARQUET_MAGIC = b"PAR1"
_RELATIVE_TIME_FORMATS = ("azure2019", "mooncake", "azure2021")
_SINGLE_SERVICE_FORMATS = ("azure_llm2023", "mooncake")


@dataclass(frozen=True)
class RawTrace:
    """One trace file, read but not yet validated.

    Attributes:
        raw: columns ``unique_id`` (str), ``ds`` (UTC timestamps, start of the
            step), ``y`` (counts as read: int or float, possibly NaN, negative
            or text: validation judges them), ``row`` (1-based source data row:
            file line minus header, or the JSONL line number) and ``field``
            (the source column or field that holds ``y``).
        step_seconds: width of one step in seconds (60, or 300 for Huawei).
        windows: ``unique_id, start, end`` (UTC, half-open ``[start, end)``)
            coverage per model; inside it a step without a count is a true
            zero. ``None`` means "first to last step of each model".
        source: coverage source name, ``trace:<format>``.
        burst_factors: per model, how its requests arrive inside the minute
            (:func:`forecaster.contracts.bursts.burst_factors`), for the
            per-request formats, whose timestamps show it; ``None`` for counts.
    """

    raw: pd.DataFrame
    step_seconds: int
    windows: pd.DataFrame | None
    source: str
    burst_factors: dict[str, float] | None = None


# --------------------------------------------------------------------------- helpers


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == _GZIP_MAGIC


def _compression(path: Path) -> str | None:
    """``"gzip"`` when the file starts with the gzip magic, else ``None``."""
    return "gzip" if _is_gzip(path) else None


def _open_text(path: Path) -> io.TextIOBase:
    """Open a plain or gzip-compressed text file for reading (UTF-8, BOM tolerated)."""
    if _is_gzip(path):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def _header(path: Path) -> list[str]:
    """The CSV header's column names, stripped of spaces and quotes as :func:`detect_format` reads them."""
    first = _first_line(path)
    if not first:
        return []
    return [name.strip() for name in next(csv.reader([first]))]


def _read_csv(path: Path, text_columns: tuple[str, ...] = ()) -> pd.DataFrame:
    """Read a CSV keeping blank lines as rows, so ``row`` matches the file.

    ``text_columns`` are read as strings (hash ids must never become numbers). Column names are stripped of
    spaces, as :func:`detect_format` reads them (``minute_2 `` is ``minute_2``). A name that appears twice is an
    IngestError (``duplicate_column``): pandas renamed the second copy ``name.1``, which a reader then ignored
    (its counts lost) or, in a wide file of channels, ingested as another model.
    """
    names = _header(path)
    seen: dict[str, int] = {}
    for position, name in enumerate(names, start=1):
        if name in seen:
            raise IngestError("duplicate_column", f"column {safe_repr(name)} appears twice in the header (columns "
                              f"{seen[name]} and {position}); nothing was ingested", field=name)
        seen[name] = position
    # pandas keeps the spaces around a name: ask for the text columns under the names as written too
    written = next(csv.reader([_first_line(path, strip=False)]), []) if names else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", pd.errors.ParserWarning)
        # index_col=False: when every row has one field more than the header, pandas would otherwise take the first
        # column as an index and shift every name one column right (ids read as counts, the last column dropped)
        frame = pd.read_csv(
            path,
            compression=_compression(path),
            dtype={c: str for c in list(text_columns) + [w for w in written if w.strip() in text_columns]},
            skip_blank_lines=False,
            low_memory=False,
            index_col=False,
        )
    if any(issubclass(w.category, pd.errors.ParserWarning) for w in caught):
        raise IngestError("extra_field", f"rows have more fields than the header's {len(names)} columns; "
                          "nothing was ingested")
    if len(frame.columns) == len(names):
        frame.columns = names
    return frame


def _require_columns(frame: pd.DataFrame, required: tuple[str, ...], fmt: str) -> None:
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise IngestError(
            "missing_column",
            f"{fmt} input lacks columns {missing}; found {list(frame.columns)[:8]}",
            field=missing[0],
        )


def _utc(moment: datetime) -> pd.Timestamp:
    """A ``datetime`` as a UTC ``Timestamp``; naive values are taken as UTC."""
    ts = pd.Timestamp(moment)
    return ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")


def _origin(start: datetime | None, default: datetime) -> pd.Timestamp:
    """The trace origin (time 0) in UTC; it must fall on a whole minute."""
    origin = _utc(start if start is not None else default)
    if origin.floor(_MINUTE) != origin:
        raise ValueError(f"start must be on a whole minute, got {origin.isoformat()}")
    return origin.as_unit("ns")


def _utc_from_ns(values: np.ndarray) -> pd.DatetimeIndex:
    """int64 nanoseconds since the epoch -> tz-aware UTC timestamps (no parsing)."""
    return pd.DatetimeIndex(values.astype("int64").view("M8[ns]")).tz_localize("UTC")


def _windows(ids: object, start: pd.Timestamp, end: pd.Timestamp) -> pd.DataFrame:
    """The same ``[start, end)`` window for every distinct, non-missing id."""
    unique = pd.unique(pd.Series(ids, dtype=object).dropna())
    return pd.DataFrame(
        {
            "unique_id": pd.Series(unique, dtype=object).astype(str),
            "start": pd.Series([start] * len(unique), dtype="datetime64[ns, UTC]"),
            "end": pd.Series([end] * len(unique), dtype="datetime64[ns, UTC]"),
        }
    )


def _wide_counts(values: np.ndarray, column_names: list[str]) -> np.ndarray:
    """The cells of a (rows x columns) matrix as int64 counts, checked as validation checks a count
    (:func:`~forecaster.ingest.validate.parse_counts`), or an IngestError naming the first bad cell (in file
    order) by its data row and column."""
    n_rows, n_cols = values.shape
    if values.dtype.kind in "iu":  # whole numbers already (the Azure day): only their range to check
        bad = _first_bad_cell((values < 0) | (values > MAX_COUNT))
        if bad is None:
            return values.astype("int64", copy=False)
        values = values.reshape(-1)[bad:bad + 1].reshape(1, 1)  # parse_counts names what is wrong with it
        row, col = divmod(bad, n_cols)
        try:
            parse_counts(pd.DataFrame({"y": values.reshape(-1)}))
        except IngestError as exc:
            raise IngestError(exc.reason, str(exc).split(": ", 1)[-1], row=row + 1, field=column_names[col],
                              value=exc.value) from None
    try:
        counts = parse_counts(pd.DataFrame({"y": values.reshape(-1)}))
    except IngestError as exc:
        row, col = divmod(int(exc.row) - 1, n_cols)
        message = str(exc).split(": ", 1)[-1]
        raise IngestError(exc.reason, message, row=row + 1, field=column_names[col], value=exc.value) from None
    return counts.reshape(n_rows, n_cols)


def _first_bad_cell(bad: np.ndarray) -> int | None:
    """Flat (C order) position of the first true cell, or None."""
    if not bad.any():
        return None
    return int(np.argmax(bad.reshape(-1)))


def _expand_cells(
    counts: np.ndarray,
    *,
    keep_zeros: bool,
    row_ds_ns: np.ndarray,
    column_ds_ns: np.ndarray,
    column_names: list[str],
    row_ids: np.ndarray | None = None,
    column_ids: np.ndarray | None = None,
) -> pd.DataFrame:
    """The raw long frame of a checked (rows x columns) count matrix: every cell, or with ``keep_zeros=False``
    the non-zero ones.

    Ingest leaves zeros out: the trace's coverage windows speak for them (validation leaves zeros out of a
    batch's counts anyway), and a long frame of every cell took about 90 times the CSV's size in memory (83% of
    the Azure 2019 day is zeros). Cells come out row by row (C order), as in the file. ``ds`` of a cell is
    ``row_ds_ns[r] + column_ds_ns[c]`` (ns since the epoch); the model id comes from the rows (``row_ids``,
    Azure: one function per row) or from the columns (``column_ids``, Huawei: one channel per column); pass
    exactly one.
    """
    n_cols = counts.shape[1]
    cells = np.arange(counts.size) if keep_zeros else np.flatnonzero(counts.reshape(-1))
    rows, cols = np.divmod(cells, n_cols)
    if row_ids is not None:
        id_codes, id_names = pd.factorize(np.asarray(row_ids, dtype=object))
        id_codes = id_codes[rows]
    else:
        id_codes, id_names = pd.factorize(np.asarray(column_ids, dtype=object))
        id_codes = id_codes[cols]
    field_codes, field_names = pd.factorize(np.asarray(column_names, dtype=object))
    return pd.DataFrame(
        {
            # Categoricals: a day of 1,350 functions repeats each 64-character id hundreds of times.
            "unique_id": pd.Categorical.from_codes(id_codes, categories=id_names),
            "ds": _utc_from_ns(row_ds_ns[rows] + column_ds_ns[cols]),
            "y": counts.reshape(-1)[cells],
            "row": (rows + 1).astype("int64"),
            "field": pd.Categorical.from_codes(field_codes[cols], categories=field_names),
        }
    )


def _bin_requests(
    ids: np.ndarray, minute_ns: np.ndarray, rows: np.ndarray, field: str
) -> pd.DataFrame:
    """Count requests per (model, minute); ``row`` is the first source row of the minute.

    ``minute_ns`` is each request's minute start in ns since the epoch.
    """
    frame = pd.DataFrame({"unique_id": ids, "ds": minute_ns, "row": rows})
    binned = (
        frame.groupby(["unique_id", "ds"], sort=True)
        .agg(y=("row", "size"), row=("row", "min"))
        .reset_index()
    )
    return pd.DataFrame(
        {
            "unique_id": binned["unique_id"].astype(object).to_numpy(),
            "ds": _utc_from_ns(binned["ds"].to_numpy()),
            "y": binned["y"].to_numpy(dtype="int64"),
            "row": binned["row"].to_numpy(dtype="int64"),
            "field": field,
        }
    )


def _refuse_first(bad: np.ndarray, text: pd.Series, reason: str, message: str, field: str | None = None) -> None:
    """IngestError ``reason`` naming the first row where ``bad`` holds (``message`` formatted with that row's value
    of ``text``; field: ``text``'s name unless given), or nothing when no row is bad."""
    rows = np.flatnonzero(bad)
    if len(rows):
        first = int(rows[0])
        value = text.iloc[first]
        raise IngestError(reason, message.format(value), row=first + 1,
                          field=str(text.name) if field is None else field, value=value)


def _numeric_column(frame: pd.DataFrame, column: str) -> np.ndarray:
    """A column as finite float64, or IngestError naming the first bad row."""
    text = frame[column]
    numeric = pd.to_numeric(text, errors="coerce").to_numpy(dtype="float64", na_value=np.nan)
    _refuse_first(~np.isfinite(numeric), text, "not_a_number", column + " is not a finite number: {!r}")
    return numeric


def _timestamp_column(text: pd.Series, field: str, fmt: str) -> pd.Series:
    """Times as UTC (a zone-less time is UTC), or IngestError naming the first row that is not a time.

    Text must be ISO 8601 (as in validation, :mod:`forecaster.ingest.validate`): under ``format="mixed"`` pandas
    guesses each value's own format, so ``01/02/2024`` and ``13/02/2024`` became January 2 and February 13, and
    ``today`` the moment of the ingest. Checked on the distinct values."""
    if text.dtype == object or pd.api.types.is_string_dtype(text):
        distinct = [v for v in pd.unique(text.dropna()) if isinstance(v, str)]
        wrong = {v for v in distinct if not ISO_8601.fullmatch(v.strip())}
        if wrong:
            _refuse_first(text.isin(wrong).to_numpy(dtype=bool), text, "bad_timestamp",
                          "{!r} is not an ISO 8601 time (such as 2024-01-02T00:00:00Z)", field)
    stamps = pd.to_datetime(text, utc=True, errors="coerce", format=fmt)
    _refuse_first(stamps.isna().to_numpy(), text, "bad_timestamp", "cannot read {!r} as a timestamp", field)
    # pandas may parse to seconds; a time nanoseconds cannot hold (2300-01-01) failed later with a message that
    # named neither row nor column
    _refuse_first(((stamps < _EARLIEST_NS) | (stamps > _LATEST_NS)).to_numpy(), text, "bad_timestamp",
                  "{!r} is outside the times a trace can hold (1678 to 2261)", field)
    return stamps.dt.as_unit("ns")


_EARLIEST_NS = pd.Timestamp("1678-01-01", tz="UTC")
_LATEST_NS = pd.Timestamp("2261-12-31", tz="UTC")


#: Offsets from a trace's origin beyond this many minutes (a century) are refused: past about 1.5e11 minutes the
#: cast to nanoseconds wrapped around int64, and a request at 1e308 ms was counted at the origin.
MAX_OFFSET_MINUTES = 100 * 366 * 1440


def _offset_minutes(minutes: np.ndarray, text: pd.Series) -> np.ndarray:
    """Whole minutes after the origin (floored), or IngestError naming the first row ``MAX_OFFSET_MINUTES`` or
    more away (``text``: the rows' values, indexed by row position)."""
    far = ~(np.abs(minutes) < MAX_OFFSET_MINUTES)
    if far.any():
        first = int(np.flatnonzero(far)[0])
        raise IngestError("bad_timestamp", f"{text.iloc[first]!r} is more than a century from the trace's origin",
                          row=int(text.index[first]) + 1, field=str(text.name), value=safe_value(text.iloc[first]))
    return np.floor(minutes).astype("int64")


def _check_ids(frame: pd.DataFrame, column: str) -> np.ndarray:
    """Model ids as strings; an empty id is an IngestError (groupby would drop it)."""
    ids = frame[column]
    _refuse_first((ids.isna() | (ids.astype("string").str.strip() == "")).to_numpy(), ids, "missing_model",
                  "model id is empty")
    return ids.astype(str).to_numpy(dtype=object)


# --------------------------------------------------------------------------- readers


#: The columns of an Azure Functions 2019 file besides ``minute_<k>``.
AZURE2019_ID_COLUMNS = ("HashOwner", "HashApp", "HashFunction", "Trigger")


def _unknown_column(name: str, position: int, fmt: str, expected: str) -> IngestError:
    what = f"column {position} has no name" if not name else f"unknown column {safe_repr(name)} (column {position})"
    return IngestError("unknown_column", f"{fmt}: {what}; expected {expected}; nothing was ingested",
                       field=name or f"column {position}")


def _azure2019_minutes(columns: list[str]) -> tuple[list[str], np.ndarray]:
    """The ``minute_<k>`` columns and their offsets (k - 1) from the origin, or an IngestError: a column that is
    neither an id column nor ``minute_<k>`` (``unknown_column``: it was skipped and its minute stored as a known
    zero), ``minute_0``, a minute a century or more away (``bad_column``), or a minute missing between
    ``minute_1`` and the last (``missing_step``: it was stored as a known zero). Real files hold every minute."""
    minute_columns, offsets = [], []
    for position, name in enumerate(columns, start=1):
        if name in AZURE2019_ID_COLUMNS:
            continue
        match = _MINUTE_COLUMN.fullmatch(name)
        if not match:
            raise _unknown_column(name, position, "azure2019", f"{list(AZURE2019_ID_COLUMNS)} and minute_1 .. minute_N")
        minute_columns.append(name)
        offsets.append(int(match.group(1)) - 1)
    if not minute_columns:
        raise IngestError("missing_column", "azure2019 input has no minute_<k> columns", field="minute_1")
    offsets_array = np.asarray(offsets, dtype="int64")
    for name, offset in zip(minute_columns, offsets):
        if offset < 0:
            raise IngestError("bad_column", "minute columns are numbered from minute_1", field=name)
        if offset >= MAX_OFFSET_MINUTES:
            raise IngestError("bad_column", f"column {safe_repr(name)} is more than a century after the trace's "
                              f"origin (at most minute_{MAX_OFFSET_MINUTES})", field=name)
    if len(set(offsets)) != len(offsets):  # minute_2 and minute_02
        twice = offsets_array[pd.Series(offsets_array).duplicated().to_numpy()][0]
        names = [n for n, o in zip(minute_columns, offsets) if o == twice]
        raise IngestError("duplicate_column", f"columns {names[0]!r} and {names[1]!r} are the same minute",
                          field=names[1])
    present = np.zeros(int(offsets_array.max()) + 1, dtype=bool)
    present[offsets_array] = True
    if not present.all():
        first = int(np.flatnonzero(~present)[0]) + 1
        raise IngestError("missing_step", f"column minute_{first} is missing (the file has minute_1 .. "
                          f"minute_{len(present)} but {int((~present).sum())} of them are missing); a missing "
                          "minute is not a zero: write its zeros, or cut the file where the gap starts",
                          field=f"minute_{first}")
    return minute_columns, offsets_array


def _read_azure2019(path: Path, start: pd.Timestamp, keep_zeros: bool = True) -> RawTrace:
    """Azure Functions 2019 wide file: ``minute_k`` -> ``start + (k-1)`` minutes.

    Every cell is checked here (a bad one is named by data row and ``minute_k``); the raw frame holds every
    cell, or the non-zero ones (``keep_zeros=False``: the window, the whole span ``[start, start + N min)`` for
    every function, makes the others known zeros). A function that appears twice is an IngestError (``duplicate``) rather than two rows
    merged. The columns must be the id columns and ``minute_1 .. minute_N``, none missing
    (:func:`_azure2019_minutes`).
    """
    frame = _read_csv(path, text_columns=("HashFunction", "HashOwner", "HashApp"))
    _require_columns(frame, ("HashFunction",), "azure2019")
    minute_columns, offsets = _azure2019_minutes([str(c) for c in frame.columns])
    function_ids = _check_ids(frame, "HashFunction")
    stripped = pd.Series(function_ids).str.strip()
    again = stripped.duplicated(keep=False).to_numpy()
    if again.any():
        first = int(np.flatnonzero(again)[0])
        rows = np.flatnonzero(again & (stripped == stripped.iloc[first]).to_numpy())[:2] + 1
        raise IngestError("duplicate", f"function {safe_repr(stripped.iloc[first])} appears more than once "
                          f"(rows {rows[0]} and {rows[1]})", row=int(rows[1]), field="HashFunction",
                          value=safe_value(stripped.iloc[first]))
    counts = _wide_counts(frame[minute_columns].to_numpy(), minute_columns)
    del frame
    raw = _expand_cells(
        counts,
        keep_zeros=keep_zeros,
        row_ds_ns=np.zeros(counts.shape[0], dtype="int64"),
        column_ds_ns=start.value + offsets * _MINUTE_NS,
        column_names=minute_columns,
        row_ids=function_ids,
    )
    end = start + _MINUTE * int(offsets.max() + 1)
    return RawTrace(raw, 60, _windows(function_ids, start, end), "trace:azure2019")


_HUAWEI_STEP_NS = 300 * 1_000_000_000


def _read_huawei5min(path: Path, keep_zeros: bool = True) -> RawTrace:
    """Huawei Cloud 5-minute wide file: one series per channel column, step 300 s.

    ``date`` is read as UTC (the upstream dates are a relative axis, "a randomly
    selected 30 days in 2016"). The dates must be 5-minute steps, each once, none missing between the first and
    the last (a missing row is not a zero: ``missing_step`` names it); every column but ``date`` is a channel,
    and must have a name. The window is ``[first date, last date + 5 min)`` for every channel; each cell is
    checked here (whole, non-negative); the raw frame holds every cell, or the non-zero ones (``keep_zeros``).
    """
    frame = _read_csv(path, text_columns=("date",))
    _require_columns(frame, ("date",), "huawei5min")
    channels = [str(c) for c in frame.columns if c != "date"]
    if not channels:
        raise IngestError("missing_column", "huawei5min input has no channel columns")
    for position, name in enumerate(map(str, frame.columns), start=1):
        if not name or name.startswith("Unnamed: "):
            raise _unknown_column("", position, "huawei5min", "date and one named column per channel")
    dates = _timestamp_column(frame["date"], "date", "mixed")
    dates_ns = dates.dt.as_unit("ns").astype("int64").to_numpy()
    _refuse_first(dates_ns % _HUAWEI_STEP_NS != 0, frame["date"], "bad_timestamp",
                  "{!r} is not on a 5-minute step", "date")
    seen = pd.Series(dates_ns).duplicated().to_numpy()
    if seen.any():
        second = int(np.flatnonzero(seen)[0])
        first = int(np.flatnonzero(dates_ns == dates_ns[second])[0])
        raise IngestError("duplicate", f"date {frame['date'].iloc[second]!r} appears more than once (rows "
                          f"{first + 1} and {second + 1})", row=second + 1, field="date",
                          value=safe_value(frame["date"].iloc[second]))
    if len(dates_ns):
        steps = (np.sort(dates_ns) - dates_ns.min()) // _HUAWEI_STEP_NS
        gap = np.flatnonzero(steps != np.arange(len(steps)))
        if len(gap):
            missing = pd.Timestamp(int(dates_ns.min() + int(gap[0]) * _HUAWEI_STEP_NS), tz="UTC")
            raise IngestError("missing_step", f"no row for {missing.isoformat()} (5-minute steps from the first "
                              "date to the last); a missing row is not a zero: write its zeros, or cut the file "
                              "where the gap starts", field="date", value=missing.isoformat())
    counts = _wide_counts(frame[channels].to_numpy(), channels)
    raw = _expand_cells(
        counts,
        keep_zeros=keep_zeros,
        row_ds_ns=dates_ns,
        column_ds_ns=np.zeros(len(channels), dtype="int64"),
        column_names=channels,
        column_ids=np.asarray(channels, dtype=object),
    )
    step = pd.Timedelta(seconds=300)
    windows = _windows(channels, dates.min(), dates.max() + step)
    return RawTrace(raw, 300, windows, "trace:huawei5min")


def _default_llm_model_id(path: Path) -> str:
    """``AzureLLMInferenceTrace_code.csv`` -> ``azure-llm-code`` (also ``azure_llm2023_code_head.csv``)."""
    stem = path.name.split(".")[0]
    match = re.search(r"(?:AzureLLMInferenceTrace|azure_llm2023)_([A-Za-z0-9]+)", stem, re.IGNORECASE)
    kind = match.group(1) if match else stem
    return "azure-llm-" + re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")


def _read_azure_llm2023(path: Path, model_id: str | None) -> RawTrace:
    """Azure LLM inference 2023: each request counts 1 in the minute of its ``TIMESTAMP``.

    Timestamps carry no zone and are read as UTC. The window is
    ``[floor(first request), floor(last request) + 1 min)``.
    """
    frame = _read_csv(path, text_columns=("TIMESTAMP",))
    _require_columns(frame, ("TIMESTAMP",), "azure_llm2023")
    stamps = _timestamp_column(frame["TIMESTAMP"], "TIMESTAMP", "ISO8601")
    uid = model_id or _default_llm_model_id(path)
    stamps_ns = stamps.dt.as_unit("ns").astype("int64").to_numpy()
    minute_ns = stamps.dt.floor("60s").dt.as_unit("ns").astype("int64").to_numpy()
    rows = np.arange(1, len(frame) + 1, dtype="int64")
    raw = _bin_requests(np.full(len(frame), uid, dtype=object), minute_ns, rows, "TIMESTAMP")
    windows = None
    if len(raw):
        windows = _windows([uid], raw["ds"].min(), raw["ds"].max() + _MINUTE)
    bursts = burst_factors(np.full(len(stamps_ns), uid, dtype=object), stamps_ns / 1e9)
    return RawTrace(raw, 60, windows, "trace:azure_llm2023", bursts)


def _default_mooncake_model_id(path: Path) -> str:
    """``mooncake-<kind>`` for the FAST'25 trace names, else ``mooncake-conversation``."""
    match = re.search(r"(conversation|toolagent|synthetic)", path.name, re.IGNORECASE)
    return "mooncake-" + (match.group(1).lower() if match else "conversation")


def _read_mooncake(path: Path, start: pd.Timestamp, model_id: str | None) -> RawTrace:
    """Mooncake JSONL: request at ``start + timestamp`` ms, counted per minute.

    ``row`` is the file line number. The window runs from the minute of the
    file's first request to the end of the minute of its last. Blank lines are
    skipped; a line that is not a JSON object with a non-negative numeric
    ``timestamp`` is an IngestError naming that line.
    """
    offsets_ms: list[float] = []
    lines: list[int] = []
    with _open_text(path) as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise IngestError(
                    "bad_json", f"line is not valid JSON ({exc.msg})", row=number, value=line.strip()[:80]
                ) from None
            if not isinstance(record, dict):
                raise IngestError("bad_json", "line is not a JSON object", row=number, value=line.strip()[:80])
            if "timestamp" not in record:
                raise IngestError("missing_field", "request has no timestamp", row=number, field="timestamp")
            ms = record["timestamp"]
            if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
                raise IngestError(
                    "bad_timestamp",
                    f"timestamp must be a non-negative number of ms, got {ms!r}",
                    row=number,
                    field="timestamp",
                    value=ms,
                )
            offsets_ms.append(ms)
            lines.append(number)
    uid = model_id or _default_mooncake_model_id(path)
    minutes = _offset_minutes(np.asarray(offsets_ms, dtype="float64") / 60_000,
                              pd.Series(offsets_ms, index=np.asarray(lines) - 1, name="timestamp"))
    minute_ns = start.value + minutes * _MINUTE_NS
    raw = _bin_requests(np.full(len(lines), uid, dtype=object), minute_ns, np.asarray(lines, dtype="int64"), "timestamp")
    windows = None
    if len(raw):  # the minutes the file holds: a file that continues another must not cover (and zero) its minutes
        windows = _windows([uid], raw["ds"].min(), raw["ds"].max() + _MINUTE)
    bursts = burst_factors(np.full(len(lines), uid, dtype=object),
                           start.value / 1e9 + np.asarray(offsets_ms, dtype="float64") / 1000.0)
    return RawTrace(raw, 60, windows, "trace:mooncake", bursts)


def _read_azure2021(path: Path, start: pd.Timestamp) -> RawTrace:
    """Azure Functions 2021: an invocation counts 1 in the minute it *started*.

    The start is ``end_timestamp - duration`` (both seconds from the trace
    start). Every function gets the same window: from the minute of the file's
    first invocation start to the end of the minute of its last (a file that
    continues another covers only its own minutes). A missing id, a non-numeric
    time or a negative duration is an IngestError naming the row.
    """
    frame = _read_csv(path, text_columns=("app", "func"))
    _require_columns(frame, ("func", "end_timestamp", "duration"), "azure2021")
    ids = _check_ids(frame, "func")
    end_s = _numeric_column(frame, "end_timestamp")
    duration_s = _numeric_column(frame, "duration")
    _refuse_first(duration_s < 0, frame["duration"], "negative_duration", "duration is negative: {!r}")
    minutes = _offset_minutes((end_s - duration_s) / 60, frame["end_timestamp"])
    minute_ns = start.value + minutes * _MINUTE_NS
    rows = np.arange(1, len(frame) + 1, dtype="int64")
    raw = _bin_requests(ids, minute_ns, rows, "end_timestamp")
    windows = None
    if len(raw):  # the minutes the file holds: a file that continues another must not cover (and zero) its minutes
        windows = _windows(ids, raw["ds"].min(), raw["ds"].max() + _MINUTE)
    bursts = burst_factors(ids, start.value / 1e9 + end_s - duration_s)
    return RawTrace(raw, 60, windows, "trace:azure2021", bursts)


def _read_long(path: Path, step_seconds: int) -> RawTrace:
    """Generic ``unique_id, ds, y`` rows (CSV or Parquet), passed through one to one.

    ``ds`` is parsed to UTC (a zone-less time is UTC); numbers are refused
    because an epoch would silently be read as nanoseconds. ``y`` is left as
    read for validation. No windows: coverage is each model's first to last step.
    """
    with open(path, "rb") as fh:
        is_parquet = fh.read(4) == _PARQUET_MAGIC
    frame = pd.read_parquet(path) if is_parquet else _read_csv(path, text_columns=("unique_id", "ds"))
    _require_columns(frame, COUNT_COLUMNS, "long")
    ds = frame["ds"]
    if pd.api.types.is_datetime64_any_dtype(ds):
        parsed = ds.dt.tz_localize("UTC") if ds.dt.tz is None else ds.dt.tz_convert("UTC")
    elif pd.api.types.is_numeric_dtype(ds) and len(ds):
        raise IngestError(
            "bad_timestamp",
            "ds holds numbers; write ISO-8601 times such as 2024-01-01T00:00:00Z",
            row=1,
            field="ds",
            value=ds.iloc[0],
        )
    else:
        parsed = _timestamp_column(ds, "ds", "mixed")
    raw = pd.DataFrame(
        {
            "unique_id": frame["unique_id"].to_numpy(dtype=object),
            "ds": parsed.reset_index(drop=True),
            "y": frame["y"].reset_index(drop=True),
            "row": np.arange(1, len(frame) + 1, dtype="int64"),
            "field": "y",
        }
    )
    return RawTrace(raw, step_seconds, None, "trace:long")


# --------------------------------------------------------------------------- public API


def _first_line(path: Path, *, strip: bool = True) -> str:
    with _open_text(path) as fh:
        for line in fh:
            if line.strip():
                return line.strip() if strip else line.rstrip("\r\n")
    return ""


def detect_format(path: str | Path) -> str:
    """Name the trace format of ``path`` (one of :data:`TRACE_FORMATS`).

    Parquet is recognised by its magic bytes (always ``long``), JSONL by a first
    line holding a JSON object, CSV by its header. Raises ValueError (an
    :class:`IngestError` with reason ``unknown_format``) naming what was seen.
    """
    path = Path(path)
    with open(path, "rb") as fh:
        if fh.read(4) == _PARQUET_MAGIC:
            return "long"
    try:
        first = _first_line(path)
    except UnicodeDecodeError:
        raise IngestError("unknown_format", f"{path.name}: not a text, gzip or Parquet file") from None
    if first.startswith("{"):
        try:
            record = json.loads(first)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and "timestamp" in record:
            return "mooncake"
    header = [h.strip().strip('"') for h in first.split(",")]
    columns = set(header)
    if "HashFunction" in columns and any(_MINUTE_COLUMN.fullmatch(h) for h in header):
        return "azure2019"
    if {"func", "end_timestamp", "duration"} <= columns:
        return "azure2021"
    if "TIMESTAMP" in columns and ({"ContextTokens", "GeneratedTokens"} & columns):
        return "azure_llm2023"
    if set(COUNT_COLUMNS) <= columns:
        return "long"
    if header[0] == "date" and len(header) > 1:
        return "huawei5min"
    raise IngestError(
        "unknown_format",
        f"{path.name}: cannot tell the trace format from its first line {first[:120]!r}; "
        f"pass fmt= one of {list(TRACE_FORMATS)}",
    )


def read_trace(
    path: str | Path,
    *,
    fmt: str | None = None,
    start: datetime | None = None,
    step_seconds: int = 60,
    model_id: str | None = None,
    keep_zeros: bool = True,
) -> RawTrace:
    """Read one trace file into a :class:`RawTrace` (unvalidated).

    Args:
        path: the file; plain or gzip (recognised by content).
        fmt: one of :data:`TRACE_FORMATS`; ``None`` detects it.
        start: time 0 for formats with relative times (``azure2019``,
            ``azure2021``, ``mooncake``); naive means UTC; must be on a whole
            minute. Refused for formats that carry real timestamps.
        step_seconds: step width for ``long`` only (the other formats fix it).
        model_id: service name for single-service formats (``azure_llm2023``,
            ``mooncake``); refused for the others, whose ids come from the file.
        keep_zeros: for the wide formats (``azure2019``, ``huawei5min``), a raw row per cell; ``False`` leaves
            the zero cells out (the windows cover them: what ingest writes is the same, in a fraction of the
            memory). Either way every cell is checked.

    Raises:
        IngestError: unreadable structure (missing column, bad timestamp, bad
            JSON line), naming row and field where one is to blame.
        ValueError: unknown ``fmt`` or an argument that does not apply.
    """
    path = Path(path)
    fmt = fmt or detect_format(path)
    if fmt not in _READERS:
        raise ValueError(f"unknown trace format {fmt!r}; expected one of {list(TRACE_FORMATS)}")
    if start is not None and fmt not in _RELATIVE_TIME_FORMATS:
        raise ValueError(f"start= applies only to {list(_RELATIVE_TIME_FORMATS)}; {fmt} has real timestamps")
    if model_id is not None and fmt not in _SINGLE_SERVICE_FORMATS:
        raise ValueError(f"model_id= applies only to {list(_SINGLE_SERVICE_FORMATS)}; {fmt} names its models")
    return _READERS[fmt](path, start=start, step_seconds=step_seconds, model_id=model_id, keep_zeros=keep_zeros)


_READERS: dict[str, Callable[..., RawTrace]] = {
    "azure2019": lambda p, start, keep_zeros, **_: _read_azure2019(p, _origin(start, AZURE2019_DEFAULT_START),
                                                                   keep_zeros),
    "huawei5min": lambda p, keep_zeros, **_: _read_huawei5min(p, keep_zeros),
    "azure_llm2023": lambda p, model_id, **_: _read_azure_llm2023(p, model_id),
    "mooncake": lambda p, start, model_id, **_: _read_mooncake(p, _origin(start, MOONCAKE_DEFAULT_START), model_id),
    "azure2021": lambda p, start, **_: _read_azure2021(p, _origin(start, AZURE2021_DEFAULT_START)),
    "long": lambda p, step_seconds, **_: _read_long(p, step_seconds),
}
