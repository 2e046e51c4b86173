"""Lag, rolling-window and calendar features shared by the global tree members.

All features are computed on *scaled* series (counts divided by the series'
fit-window mean), so one global model serves busy and quiet serving models.
One feature row describes one forecast: series ``row``, origin ``o`` (columns
``0..o-1`` known) and horizon ``h``, targeting column ``o+h-1``. Only columns
before ``o`` are ever read, which the leakage test in
``tests/test_forecast_members.py`` checks.

Features (steps are the panel's steps; minute figures assume per-minute data):

* ``lag_k``: the value ``k`` steps before the origin (1..15, 30, 60 by default);
* ``s<p>_1``, ``s<p>_2``, ``s<p>_mean3``: for each season ``p`` (15, 30, 60
  minutes, one day with two days of history), the latest, second-latest and mean
  of the three latest known values in the *target's* phase; this is how a direct
  model sees a timer that fires every 15 minutes at any horizon;
* ``mean_<w>``, ``std_60``, ``nonzero_60``: rolling mean over the last ``w``
  steps (15, 60, 240), standard deviation and share of non-zero steps over 60;
* ``since_nonzero``: steps since the last non-zero count (capped);
* ``minute_of_hour``, ``hour_of_day``, ``day_of_week`` of the target step, the
  last two only when the fit window holds two full days / two full weeks;
* ``h`` (direct strategy only) and ``log_level`` = ``log1p(fit-window mean)``;
* with ``local_level`` (default), every level-carrying feature above (lags,
  seasonal lags, rolling means, std) is divided by the recent level (mean of
  the longest window, floored at :data:`LEVEL_FLOOR`), whose log is one more
  feature, ``log_local_level``; the member divides the target by it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd


#: Floor of the local level, in units of the series' fit-window mean.
LEVEL_FLOOR = 0.1


@dataclass(frozen=True)
class FeatureSpec:
    """Which features to build, in steps of the panel.

    Attributes:
        lags: plain lags before the origin.
        seasons: season lengths for target-phase lags.
        windows: rolling-mean windows.
        step_minutes: minutes per step (for the calendar).
        hour_of_day: include the target's hour of day.
        day_of_week: include the target's day of week.
        with_horizon: include ``h`` (direct strategy).
    """

    lags: tuple[int, ...]
    seasons: tuple[int, ...]
    windows: tuple[int, ...]
    step_minutes: float
    hour_of_day: bool
    day_of_week: bool
    with_horizon: bool
    local_level: bool = True
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        names = [f"lag_{k}" for k in self.lags]
        for p in self.seasons:
            names += [f"s{p}_1", f"s{p}_2", f"s{p}_mean3"]
        names += [f"mean_{w}" for w in self.windows]
        names += ["std_60", "nonzero_60", "since_nonzero"]
        if self.step_minutes < 60:
            names.append("minute_of_hour")
        if self.hour_of_day:
            names.append("hour_of_day")
        if self.day_of_week:
            names.append("day_of_week")
        if self.with_horizon:
            names.append("h")
        names.append("log_level")
        if self.local_level:
            names.append("log_local_level")
        object.__setattr__(self, "names", tuple(names))

    @property
    def lookback(self) -> int:
        """Steps before the origin that any feature may read."""
        return int(max([*self.lags, *[3 * p for p in self.seasons], *self.windows, 60, self.since_cap]))

    @property
    def since_cap(self) -> int:
        return int(round(240 / self.step_minutes)) or 1

    @classmethod
    def for_panel(
        cls, step: pd.Timedelta, n_steps: int, *, with_horizon: bool, local_level: bool = True
    ) -> FeatureSpec:
        """Defaults for a fit window of ``n_steps`` steps of width ``step``."""
        from forecaster.forecast.members import default_seasons

        step_minutes = step.total_seconds() / 60.0
        per_hour = max(1, int(round(60 / step_minutes)))
        lags = tuple(sorted({*range(1, min(15, 2 * per_hour) + 1), max(1, per_hour // 2), per_hour}))
        windows = tuple(sorted({max(2, int(round(15 / step_minutes))), per_hour, 4 * per_hour}))
        day = 1440 / step_minutes
        return cls(
            lags=lags,
            seasons=default_seasons(step, n_steps),
            windows=windows,
            step_minutes=step_minutes,
            hour_of_day=n_steps >= 2 * day,
            day_of_week=n_steps >= 14 * day,
            with_horizon=with_horizon,
            local_level=local_level,
        )


class SeriesWindows:
    """Running sums over a scaled matrix ``(M, L)``, for O(1) rolling features."""

    def __init__(self, scaled: np.ndarray):
        self.values = scaled
        n, t = scaled.shape
        known = ~np.isnan(scaled)
        filled = np.where(known, scaled, 0.0)
        positive = filled > 0
        # running sums after a leading column of zeros, accumulated in place (no concatenated copies); the
        # counts are int32, which holds them exactly
        self.csum = np.zeros((n, t + 1))
        np.cumsum(filled, axis=1, out=self.csum[:, 1:])
        self.csq = np.zeros((n, t + 1))
        np.cumsum(np.square(filled, out=filled), axis=1, out=self.csq[:, 1:])
        self.ccount = np.zeros((n, t + 1), dtype=np.int32)
        np.cumsum(known, axis=1, out=self.ccount[:, 1:])
        self.cnonzero = np.zeros((n, t + 1), dtype=np.int32)
        np.cumsum(positive, axis=1, out=self.cnonzero[:, 1:])
        index = np.where(positive, np.arange(t, dtype=np.int32), np.int32(-(10**9)))
        self.last_nonzero = np.maximum.accumulate(index, axis=1)

    def at(self, rows: np.ndarray, columns: np.ndarray) -> np.ndarray:
        """``values[rows, columns]``, NaN where the column is before the start."""
        out = self.values[rows, np.clip(columns, 0, None)]
        return np.where(columns < 0, np.nan, out)

    def window_stats(self, rows: np.ndarray, origin: np.ndarray, width: int) -> tuple[np.ndarray, ...]:
        """Mean, std and non-zero share over columns ``origin-width .. origin-1`` (NaN if none known)."""
        lo = np.clip(origin - width, 0, None)
        count = self.ccount[rows, origin] - self.ccount[rows, lo]
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = (self.csum[rows, origin] - self.csum[rows, lo]) / count
            second = (self.csq[rows, origin] - self.csq[rows, lo]) / count
            std = np.sqrt(np.clip(second - mean * mean, 0.0, None))
            nonzero = (self.cnonzero[rows, origin] - self.cnonzero[rows, lo]) / count
        return mean, std, nonzero


def build_features(
    spec: FeatureSpec,
    windows: SeriesWindows,
    rows: np.ndarray,
    origin: np.ndarray,
    h: np.ndarray,
    target_step: np.ndarray,
    log_level: np.ndarray,
    horizon_cap: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Feature matrix ``(R, len(spec.names))`` float32, one row per forecast.

    Args:
        spec: which features.
        windows: running sums over the scaled series.
        rows: ``(R,)`` row of ``windows.values`` each forecast is for.
        origin: ``(R,)`` first unknown column (only columns before it are read).
        h: ``(R,)`` horizon, >= 1.
        target_step: ``(R,)`` absolute step number of the target (for the calendar).
        log_level: ``(R,)`` ``log1p`` of the series' fit-window mean count.
        horizon_cap: largest ``h`` the model was trained on; the ``h`` feature is
            capped there (seasonal lags still follow the true target phase).
    """
    rows = np.asarray(rows)
    origin = np.asarray(origin, dtype=np.int64)
    h = np.asarray(h, dtype=np.int64)
    columns: list[np.ndarray] = [windows.at(rows, origin - k) for k in spec.lags]
    target = origin + h - 1
    for p in spec.seasons:
        latest = target - p * -(-h // p)  # the latest same-phase column before the origin
        phase = [windows.at(rows, latest - j * p) for j in range(3)]
        stacked = np.stack(phase, axis=1)
        with np.errstate(invalid="ignore"):
            count = (~np.isnan(stacked)).sum(axis=1)
            mean3 = np.where(count > 0, np.nansum(stacked, axis=1) / np.maximum(count, 1), np.nan)
        columns += [phase[0], phase[1], mean3]
    for w in spec.windows:
        columns.append(windows.window_stats(rows, origin, w)[0])
    per_hour = max(1, int(round(60 / spec.step_minutes)))
    _, std, nonzero = windows.window_stats(rows, origin, per_hour)
    since = (origin - 1 - windows.last_nonzero[rows, np.clip(origin - 1, 0, None)]).astype(np.float64)
    columns += [std, nonzero, np.minimum(since, spec.since_cap)]
    minutes = target_step.astype(np.float64) * spec.step_minutes
    if spec.step_minutes < 60:
        columns.append(np.floor(minutes % 60))
    if spec.hour_of_day:
        columns.append(np.floor(minutes / 60) % 24)
    if spec.day_of_week:
        columns.append(np.floor(minutes / 1440 + 3) % 7)  # 1970-01-01 was a Thursday (3)
    if spec.with_horizon:
        columns.append(np.minimum(h, horizon_cap or h.max(initial=1)).astype(np.float64))
    columns.append(np.asarray(log_level, dtype=np.float64))
    # each column is computed in float64 and rounded to float32 once, straight into the matrix (no float64
    # matrix and no divided copies in between: the same numbers, fewer large temporary arrays)
    features = np.empty((len(rows), len(columns) + spec.local_level), dtype=np.float32)
    level = np.ones(len(rows))
    n_level = 0
    if spec.local_level:
        # divide every level-carrying feature (and, in the member, the target) by the
        # recent level, floored at a tenth of the series' fit mean (= 0.1 after scaling)
        recent = windows.window_stats(rows, origin, spec.windows[-1])[0]
        level = np.maximum(np.nan_to_num(recent, nan=0.0), LEVEL_FLOOR)
        n_level = len(spec.lags) + 3 * len(spec.seasons) + len(spec.windows) + 1  # + std
        features[:, -1] = np.log(level)
    for k, column in enumerate(columns):
        if k < n_level:
            np.divide(column, level, out=features[:, k])
        else:
            features[:, k] = column
    return features, level
