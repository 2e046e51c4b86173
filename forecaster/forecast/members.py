"""The member contract and the always-available baseline members.

Every ensemble member follows one contract (``../shared/STYLE.md``):

* ``__init__`` only stores settings;
* ``fit(df)`` takes the long frame ``unique_id, ds, y`` (per-step invocation
  counts, ``NaN`` = unknown), estimates parameters once and returns ``self``;
  fitted state ends in ``_``;
* ``predict(h, history=None)`` returns ``unique_id, ds, <name>``: ``h`` steps
  after the end of ``history`` (or of the fit window). ``history`` lets a fitted
  member *condition* on data newer than its fit window (latest lags, latest
  level) without re-estimating anything: the "no refit" protocol of
  ``../shared/EVALUATION.md`` section 1.
* ``forecast(panel, origins, h)`` is the array form used by the ensemble and the
  backtest: one ``(N, len(origins), h)`` array, where origin ``o`` may only use
  columns ``0..o-1`` of ``panel``. ``predict`` is a thin wrapper around it.

Forecasts are clipped at 0. ``NaN`` in a forecast means "this member does not
cover this series" (ARIMA fits only the busiest series); the ensemble then uses
the other members.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Sequence

import numpy as np
import pandas as pd

from forecaster.forecast.panel import Panel, forecast_frame


class NotFittedError(RuntimeError):
    """``predict``/``forecast`` called before ``fit``."""


class Member(abc.ABC):
    """Base class: the long-frame contract on top of :meth:`_fit` and :meth:`_forecast`.

    Subclasses implement ``_fit(panel)`` and ``_forecast(panel, origins, h)``.
    """

    name = "member"

    def fit(self, df: pd.DataFrame) -> Member:
        """Estimate parameters on the long frame ``df`` (the fit window)."""
        return self.fit_panel(Panel.from_long(df))

    def fit_panel(self, panel: Panel) -> Member:
        """Estimate parameters on a panel (the fit window); returns ``self``."""
        self.panel_ = panel
        self.step_ = panel.step
        self._fit(panel)
        return self

    def predict(self, h: int, history: pd.DataFrame | None = None) -> pd.DataFrame:
        """Forecast ``h`` steps after the end of ``history`` (default: the fit window).

        Args:
            h: number of steps (1-based horizons ``1..h``).
            history: long frame ``unique_id, ds, y`` with the data to condition
                on, on the fit grid; it must reach far enough back for the
                member's lags (a few hours for the per-minute members).
                Parameters are not re-estimated.

        Returns:
            ``unique_id, ds, <name>``, one row per covered series and step.
        """
        panel = self._panel(history)
        values = self.forecast(panel, [panel.n_steps], h)[:, 0, :]
        return forecast_frame(panel, panel.n_steps, {self.name: values})

    def forecast(self, panel: Panel, origins: Sequence[int], h: int) -> np.ndarray:
        """Point forecasts, shape ``(panel.n_series, len(origins), h)``, clipped at 0."""
        origins = [int(o) for o in origins]
        self._check_request(panel, origins, h)
        values = np.asarray(self._forecast(panel, origins, h), dtype=np.float64)
        expected = (panel.n_series, len(origins), h)
        if values.shape != expected:
            raise RuntimeError(f"{self.name} returned shape {values.shape}, expected {expected}")
        return np.clip(values, 0.0, None)

    # ------------------------------------------------------------------ subclass hooks
    @abc.abstractmethod
    def _fit(self, panel: Panel) -> None:
        """Estimate the member's parameters on ``panel`` (the fit window)."""

    @abc.abstractmethod
    def _forecast(self, panel: Panel, origins: list[int], h: int) -> np.ndarray:
        """Point forecasts ``(N, len(origins), h)`` conditioning on data before each origin."""

    # ------------------------------------------------------------------ helpers
    def _check_request(self, panel: Panel, origins: list[int], h: int) -> None:
        """Raise unless the member is fitted, ``h >= 1`` and every origin lies in ``1..panel.n_steps``."""
        self._check_fitted()
        if h < 1:
            raise ValueError(f"h must be >= 1, got {h}")
        if any(o < 1 or o > panel.n_steps for o in origins):
            raise ValueError(f"origins must lie in 1..{panel.n_steps}, got {origins}")

    def _check_fitted(self) -> None:
        if not hasattr(self, "panel_"):
            raise NotFittedError(f"{type(self).__name__} is not fitted; call fit() first")

    def _panel(self, history: pd.DataFrame | None) -> Panel:
        self._check_fitted()
        if history is None:
            return self.panel_
        return Panel.from_long(history, step=self.step_)

    def _per_series(self, panel: Panel, fitted: np.ndarray, default: float | np.ndarray) -> np.ndarray:
        """Fitted per-series values (rows of ``self.panel_.ids``) mapped onto ``panel``'s rows.

        Series not seen in the fit window get ``default`` (scalar or one value per
        row of ``panel``).
        """
        position = pd.Index(self.panel_.ids).get_indexer(panel.ids)
        out = np.broadcast_to(np.asarray(default, dtype=np.float64), (panel.n_series,)).copy()
        known = position >= 0
        out[known] = np.asarray(fitted, dtype=np.float64)[position[known]]
        return out


def last_observed(values: np.ndarray) -> np.ndarray:
    """Forward fill along time: column ``t`` holds the last non-NaN value at or before ``t`` (NaN if none)."""
    index = np.where(np.isnan(values), -1, np.arange(values.shape[1]))
    index = np.maximum.accumulate(index, axis=1)
    filled = np.take_along_axis(values, np.clip(index, 0, None), axis=1)
    filled[index < 0] = np.nan
    return filled


def _naive_level(values: np.ndarray, origins: list[int]) -> np.ndarray:
    """Last observed value before each origin, ``(N, O)``; 0 where nothing was ever observed.

    For a few origins (the forecast job asks for one) the value is read at ``origin - 1`` and only the series
    unknown there are searched further back, instead of forward-filling every column (0.09 of the fallback's
    0.12 s in a 5,000-series shard); many origins (a fit's validation tail) forward-fill once. Both pick the same
    element.
    """
    if len(origins) > 4:
        return np.nan_to_num(last_observed(values)[:, np.asarray(origins) - 1], nan=0.0)
    level = np.empty((values.shape[0], len(origins)))
    for k, origin in enumerate(origins):
        level[:, k] = values[:, origin - 1]
        unknown = np.flatnonzero(np.isnan(level[:, k]))
        if len(unknown):
            known = ~np.isnan(values[unknown, :origin])
            back = origin - 1 - np.argmax(known[:, ::-1], axis=1)  # the latest known column (0 if none)
            level[unknown, k] = np.where(known.any(axis=1), values[unknown, back], np.nan)
    return np.nan_to_num(level, nan=0.0)


def default_seasons(step: pd.Timedelta, n_steps: int) -> tuple[int, ...]:
    """Candidate season lengths in steps: 15, 30, 60 minutes and one day, where the window holds two of them.

    Timer-triggered functions fire every 5, 15, 30 or 60 minutes; a daily cycle
    only counts when two full days are in the window.
    """
    step_minutes = step.total_seconds() / 60.0
    seasons = []
    for minutes in (15, 30, 60, 1440):
        length = minutes / step_minutes
        if length >= 2 and float(length).is_integer() and 2 * length <= n_steps:
            seasons.append(int(length))
    return tuple(seasons)


class Naive(Member):
    """Last observed value, for every horizon."""

    name = "naive"

    def _fit(self, panel: Panel) -> None:
        pass

    def _forecast(self, panel: Panel, origins: list[int], h: int) -> np.ndarray:
        level = _naive_level(panel.values, origins)
        return np.repeat(level[:, :, None], h, axis=2)


class SeasonalNaive(Member):
    """Value one season before the target step (the latest same-phase step before the origin).

    Where that step is unknown or before the start, the last observed value is used.

    Args:
        season_length: season in steps (60 = one hour of per-minute data).
    """

    def __init__(self, season_length: int = 60):
        self.season_length = season_length

    @property
    def name(self) -> str:
        return f"seasonal_naive_{self.season_length}"

    def _fit(self, panel: Panel) -> None:
        if self.season_length < 1:
            raise ValueError(f"season_length must be >= 1, got {self.season_length}")

    def _forecast(self, panel: Panel, origins: list[int], h: int) -> np.ndarray:
        s = self.season_length
        o = np.asarray(origins)[:, None]
        steps = np.arange(1, h + 1)[None, :]
        source = o + steps - 1 - s * np.ceil(steps / s).astype(int)  # (O, h)
        seasonal = panel.values[:, np.clip(source, 0, None)]  # (N, O, h)
        seasonal = np.where((source < 0)[None], np.nan, seasonal)
        naive = _naive_level(panel.values, origins)[:, :, None]
        return np.where(np.isnan(seasonal), naive, seasonal)


class MovingAverage(Member):
    """Mean (or median) of the last ``window`` observed steps, for every horizon; 0 with no data.

    Args:
        window: steps to average over (60 = one hour of per-minute data).
        statistic: ``"mean"`` or ``"median"`` (the median minimises absolute
            error, which suits intermittent series that are mostly zero).
    """

    def __init__(self, window: int = 60, statistic: str = "mean"):
        self.window = window
        self.statistic = statistic

    @property
    def name(self) -> str:
        return f"moving_{'average' if self.statistic == 'mean' else 'median'}_{self.window}"

    def _fit(self, panel: Panel) -> None:
        if self.statistic not in ("mean", "median"):
            raise ValueError(f"statistic must be 'mean' or 'median', got {self.statistic!r}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def _forecast(self, panel: Panel, origins: list[int], h: int) -> np.ndarray:
        level = np.zeros((panel.n_series, len(origins)))
        reduce = np.nanmean if self.statistic == "mean" else np.nanmedian
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows give NaN, then 0
            for k, o in enumerate(origins):
                level[:, k] = reduce(panel.values[:, max(0, o - self.window) : o], axis=1)
        level = np.nan_to_num(level, nan=0.0)
        return np.repeat(level[:, :, None], h, axis=2)


class Fallback(Member):
    """Per series, the best of the baselines on the tail of the fit window; always available.

    Candidates: seasonal naive for each default season (15, 30, 60 minutes; one
    day with two days of history), naive, and the 60-minute moving median and
    mean. Each series keeps the candidate with the lowest mean absolute error
    over rolling origins in the last ``tail`` steps of the fit window
    (horizons ``1..horizon``). Every candidate produces a finite forecast for
    every series, so this member never leaves a series uncovered; the ensemble
    keeps it even when every other member fails.

    Args:
        horizon: horizons (steps) the selection scores.
        tail: steps at the end of the fit window used for the selection.
    """

    name = "fallback"

    def __init__(self, horizon: int = 15, tail: int = 240):
        self.horizon = horizon
        self.tail = tail

    def _candidates(self, panel: Panel) -> list[Member]:
        window = max(1, int(round(60 / panel.step_minutes)))
        seasons = [SeasonalNaive(s) for s in default_seasons(panel.step, panel.n_steps)]
        return [*seasons, Naive(), MovingAverage(window, "median"), MovingAverage(window, "mean")]

    def _fit(self, panel: Panel) -> None:
        self.candidates_ = [c.fit_panel(panel) for c in self._candidates(panel)]
        h = self.horizon
        first = max(1, panel.n_steps - self.tail)
        origins = list(range(first, panel.n_steps - h + 1))
        choice = np.full(panel.n_series, self._default_choice())
        if origins:
            actual = actuals(panel.values, origins, h)
            errors = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # series with no known tail step
                for candidate in self.candidates_:
                    forecast = candidate.forecast(panel, origins, h)
                    errors.append(np.nanmean(np.abs(forecast - actual), axis=(1, 2)))
            errors = np.nan_to_num(np.stack(errors, axis=1), nan=np.inf)
            has_error = np.isfinite(errors).any(axis=1)
            choice[has_error] = np.argmin(errors[has_error], axis=1)
        self.choice_ = choice
        self.chosen_names_ = [self.candidates_[k].name for k in choice]

    def _default_choice(self) -> int:
        """Moving median: the candidate for series with nothing to score yet."""
        return len(self.candidates_) - 2

    def _forecast(self, panel: Panel, origins: list[int], h: int) -> np.ndarray:
        choice = self._per_series(panel, self.choice_, self._default_choice()).astype(int)
        out = np.empty((panel.n_series, len(origins), h))
        for k, candidate in enumerate(self.candidates_):
            rows = choice == k
            if rows.any():
                sub = Panel(panel.ids[rows], panel.start, panel.step, panel.values[rows])
                out[rows] = candidate.forecast(sub, origins, h)
        return out


def actuals(values: np.ndarray, origins: Sequence[int], h: int) -> np.ndarray:
    """Actuals ``(N, O, h)`` for each origin and horizon; NaN past the end."""
    columns = np.asarray(origins)[:, None] + np.arange(h)[None, :]
    padded = np.concatenate([values, np.full((values.shape[0], h), np.nan)], axis=1)
    return padded[:, columns]

