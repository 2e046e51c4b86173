"""Long frames in, one regular wide grid inside: the data shape every member works on.

Members take and return the long table ``unique_id, ds, y`` (one row per model
and step, ``y`` = invocations in the step, ``NaN`` = unknown, as
:func:`forecaster.store.invocations.read_counts` returns it). Inside, a
:class:`Panel` holds the same numbers as a ``(series, steps)`` float matrix on
one regular time grid, so that features, origins and horizons are plain column
indices: an origin ``o`` means columns ``0..o-1`` are known and horizon ``h``
(1-based) targets column ``o+h-1`` (``../shared/EVALUATION.md`` section 1).

Input validation lives here, in one place, with messages that name the bad value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

LONG_COLUMNS = ("unique_id", "ds", "y")


class ForecastDataError(ValueError):
    """The long frame handed to a forecaster cannot be read as regular series."""


@dataclass(frozen=True)
class Panel:
    """Series on one regular grid.

    Attributes:
        ids: series names, shape ``(N,)``, sorted.
        start: time of column 0 (start of the step).
        step: width of one step.
        values: ``(N, T)`` float64 invocation counts; ``NaN`` = unknown.
    """

    ids: np.ndarray
    start: pd.Timestamp
    step: pd.Timedelta
    values: np.ndarray

    @property
    def n_series(self) -> int:
        return int(self.values.shape[0])

    @property
    def n_steps(self) -> int:
        return int(self.values.shape[1])

    @property
    def step_minutes(self) -> float:
        return self.step.total_seconds() / 60.0

    def ds(self, first: int = 0, count: int | None = None) -> pd.DatetimeIndex:
        """Timestamps of columns ``first .. first+count-1`` (may run past the end)."""
        count = self.n_steps - first if count is None else count
        return pd.date_range(self.start + first * self.step, periods=count, freq=self.step)

    def step_index(self, first: int, count: int) -> np.ndarray:
        """Absolute step numbers since the Unix epoch for columns ``first..first+count-1``.

        Calendar features use them (minute of hour, hour of day, day of week)
        so that they do not depend on where a panel happens to start.
        """
        start_steps = self.start.value // self.step.value
        return start_steps + first + np.arange(count, dtype=np.int64)

    def head(self, n_steps: int) -> Panel:
        """The first ``n_steps`` columns (the fit window of a backtest)."""
        return Panel(self.ids, self.start, self.step, self.values[:, :n_steps])

    def select(self, ids: np.ndarray | list[str]) -> Panel:
        """The rows for ``ids``, in that order (ids must exist)."""
        position = pd.Index(self.ids).get_indexer(np.asarray(ids, dtype=object))
        if (position < 0).any():
            raise KeyError(f"unknown series {np.asarray(ids)[position < 0][0]!r}")
        return Panel(np.asarray(ids, dtype=object), self.start, self.step, self.values[position])

    def to_long(self) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "unique_id": np.repeat(self.ids, self.n_steps),
                "ds": np.tile(self.ds(), self.n_series),
                "y": self.values.ravel(),
            }
        )

    @classmethod
    def from_wide(
        cls, ids: list[str] | np.ndarray, values: np.ndarray, *, start: pd.Timestamp | str, step: pd.Timedelta | str
    ) -> Panel:
        """A panel from a matrix (rows = series), sorted by id."""
        ids = np.asarray(ids, dtype=object)
        values = np.asarray(values, dtype=np.float64)
        if values.ndim != 2 or values.shape[0] != len(ids):
            raise ForecastDataError(f"values must be (len(ids), T), got {values.shape} for {len(ids)} ids")
        order = np.argsort(ids.astype(str), kind="stable")
        return cls(ids[order], pd.Timestamp(start), pd.Timedelta(step), values[order])

    @classmethod
    def from_long(cls, df: pd.DataFrame, *, step: pd.Timedelta | None = None) -> Panel:
        """Read a long frame ``unique_id, ds, y`` into a panel.

        Steps missing from the frame (a series that starts late, or rows not
        given) become ``NaN`` (unknown), exactly like a ``NaN`` ``y``.

        Args:
            df: long frame; extra columns are ignored.
            step: the grid step; ``None`` infers it as the smallest gap between
                distinct ``ds`` values.

        Raises:
            ForecastDataError: missing columns, no rows, a non-numeric or
                negative ``y``, a duplicate ``(unique_id, ds)``, a ``ds`` off the
                grid, or a single timestamp with no ``step`` given.
        """
        missing = [c for c in LONG_COLUMNS if c not in df.columns]
        if missing:
            raise ForecastDataError(f"missing column(s) {missing}; expected long frame {list(LONG_COLUMNS)}")
        if df.empty:
            raise ForecastDataError("no rows: a forecaster needs at least one observed step")
        ds = pd.to_datetime(df["ds"])
        if ds.isna().any():
            raise ForecastDataError(f"ds has a missing timestamp at row {int(np.flatnonzero(ds.isna())[0])}")
        y = pd.to_numeric(df["y"], errors="coerce").to_numpy(dtype=np.float64)
        bad = np.flatnonzero(np.isnan(y) & df["y"].notna().to_numpy())
        if len(bad):
            raise ForecastDataError(f"y is not numeric at row {int(bad[0])}: {df['y'].iloc[bad[0]]!r}")
        negative = np.flatnonzero(y < 0)
        if len(negative):
            raise ForecastDataError(f"y is negative at row {int(negative[0])}: {y[negative[0]]}")

        ds_ns = ds.dt.as_unit("ns").astype("int64").to_numpy() if hasattr(ds, "dt") else ds.asi8
        unique_ns = np.unique(ds_ns)
        if step is None:
            if len(unique_ns) < 2:
                raise ForecastDataError("cannot infer the step from a single timestamp; pass step=")
            step_ns = int(np.diff(unique_ns).min())
        else:
            step_ns = int(pd.Timedelta(step).value)
            if step_ns <= 0:
                raise ForecastDataError(f"step must be positive, got {step}")
        start_ns = int(unique_ns[0])
        offset = ds_ns - start_ns
        off_grid = np.flatnonzero(offset % step_ns)
        if len(off_grid):
            raise ForecastDataError(
                f"ds {ds.iloc[off_grid[0]]} is not on the {pd.Timedelta(step_ns, unit='ns')} grid starting {ds.iloc[0]}"
            )
        column = (offset // step_ns).astype(np.int64)
        codes, ids = pd.factorize(df["unique_id"].astype(str), sort=True)
        n_steps = int(column.max()) + 1
        flat = codes.astype(np.int64) * n_steps + column
        if len(np.unique(flat)) != len(flat):
            dup = pd.Series(flat).duplicated().to_numpy().nonzero()[0][0]
            raise ForecastDataError(
                f"duplicate row for unique_id={df['unique_id'].iloc[dup]!r}, ds={ds.iloc[dup]}"
            )
        values = np.full(len(ids) * n_steps, np.nan)
        values[flat] = y
        start = pd.Timestamp(start_ns, unit="ns", tz=getattr(ds.dt, "tz", None))
        return cls(np.asarray(ids, dtype=object), start, pd.Timedelta(step_ns, unit="ns"), values.reshape(len(ids), n_steps))


def forecast_frame(panel: Panel, origin: int, columns: dict[str, np.ndarray]) -> pd.DataFrame:
    """Long forecast table for one origin: ``unique_id, ds`` plus one column per array.

    Args:
        panel: the panel whose grid and ids the forecasts use.
        origin: column index of the first forecast step.
        columns: name -> ``(N, h)`` array; rows that are all ``NaN`` in every
            column are dropped (a member that does not cover a series).
    """
    arrays = list(columns.values())
    n, h = arrays[0].shape
    frame = pd.DataFrame(
        {"unique_id": np.repeat(panel.ids, h), "ds": np.tile(panel.ds(origin, h), n)}
        | {name: values.ravel() for name, values in columns.items()}
    )
    covered = np.zeros(n * h, dtype=bool)
    for values in arrays:
        covered |= ~np.isnan(values.ravel())
    return frame.loc[covered].reset_index(drop=True)
