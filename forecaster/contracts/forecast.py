"""The forecast frame every forecast source yields and the planner reads: one quantile naming, one validator.

Contract (what the ensemble of issue 3 must offer to plug in)::

    class ForecastSource(Protocol):
        def quantiles(self, now: datetime, horizon_min: int) -> pd.DataFrame: ...

``quantiles(now, H)`` returns one row per model and target minute, long format:

* ``unique_id`` (str): the serving model;
* ``ds`` (UTC timestamp): start of the target minute; ``now`` is a minute
  boundary and horizon ``h = 1..H`` targets the minute starting at
  ``now + (h - 1) min`` (EVALUATION.md section 1: origin ``o`` = the first
  forecast step, only data before ``now`` may be used);
* one column per quantile level of the per-minute invocation count, named
  ``q<level>`` with the level written as Python's ``repr`` of the float
  (``q0.5``, ``q0.9``, ``q0.99``); at least one level, non-decreasing in the
  level, clipped at 0;
* optional ``p_any``: probability of at least one invocation in that minute.
  Without it the planner derives a coarse one from the quantiles
  (:func:`p_any_from_quantiles`);
* optional ``request_rate_rpm`` (:data:`REQUEST_RATE_COLUMN`): the model's
  requests per minute over the history the forecast was made from
  (:func:`history_request_rate_rpm`), the same on each of its rows; the plan
  step's ``model`` weighting of cold costs reads it.

Models missing from the frame are treated as "no forecast": the planner plans
nothing ahead for them (the reactive path still serves them).
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Protocol, runtime_checkable

import numpy as np
import pandas as pd

QUANTILE_COLUMN = re.compile(r"q(0(?:\.\d+)?|1(?:\.0+)?)$")
DEFAULT_LEVELS = (0.1, 0.5, 0.9, 0.99)
#: The levels every forecast source yields, the forecast job stores and the API serves: the planner sizes
#: replicas with the upper ones (0.9 to 0.99), the dashboard draws the 0.1-0.9 band.
FORECAST_LEVELS = (0.1, 0.5, 0.9, 0.95, 0.99)


@runtime_checkable
class ForecastSource(Protocol):
    """Anything that yields per-minute quantile forecasts of invocation counts."""

    def quantiles(self, now: datetime, horizon_min: int) -> pd.DataFrame:  # pragma: no cover - protocol
        ...


#: Optional forecast column: a model's requests per minute over the history its forecast was made from.
REQUEST_RATE_COLUMN = "request_rate_rpm"


def history_request_rate_rpm(counts: np.ndarray) -> np.ndarray:
    """Requests per minute of each row of ``counts`` (models x minutes, NaN = a minute not known), smoothed.

    ``(requests + 1) / (known minutes + 1)``: a model seen for a short while or never called stays above 0
    (its rate falls as quiet minutes accumulate), so the weight the plan step derives from it stays finite.
    The forecast job computes it over its look-back (``PREWARM_FORECAST_LOOKBACK_MIN``) and stores it with the
    run; the replays compute it over the same trailing window of the minutes they have served.
    """
    counts = np.asarray(counts, dtype="float64")
    if counts.ndim != 2:
        raise ValueError(f"counts must be (models, minutes), got shape {counts.shape}")
    rates = np.empty(len(counts))
    for lo in range(0, len(counts), 4096):  # bounded temporaries: the forecast job's panel is 100,000 x 1,440
        block = counts[lo:lo + 4096]
        known = ~np.isnan(block)
        rates[lo:lo + 4096] = (np.where(known, block, 0.0).sum(axis=1) + 1.0) / (known.sum(axis=1) + 1.0)
    return rates


class TrailingRequestRates:
    """:func:`history_request_rate_rpm` of the ``lookback_min`` minutes before any minute of complete counts, from
    running sums: what a replay gives each minute's forecast without summing the window again.

    Args:
        counts: ``(models, minutes)``, no unknown minutes.
        lookback_min: the forecast job's look-back (``PREWARM_FORECAST_LOOKBACK_MIN``).
    """

    def __init__(self, counts: np.ndarray, lookback_min: int) -> None:
        self.counts = counts
        self.lookback_min = lookback_min
        self._before = np.concatenate([np.zeros((len(counts), 1)), np.cumsum(counts, axis=1)], axis=1)

    def at(self, minute: int) -> np.ndarray:
        """(models,) rates over minutes ``[minute - lookback_min, minute)``."""
        first = max(0, minute - self.lookback_min)
        return (self._before[:, minute] - self._before[:, first] + 1.0) / (minute - first + 1.0)


def with_request_rates(forecast: pd.DataFrame, model_ids, rates: np.ndarray) -> pd.DataFrame:
    """``forecast`` with :data:`REQUEST_RATE_COLUMN` on each row from ``rates`` (aligned with ``model_ids``)."""
    by_model = pd.Series(np.asarray(rates, dtype="float64"), index=pd.Index(model_ids).astype(str))
    return forecast.assign(**{REQUEST_RATE_COLUMN: by_model.reindex(
        forecast["unique_id"].astype(str)).to_numpy(dtype="float64")})


def quantile_column(level: float) -> str:
    """Column name of a quantile level: ``0.9 -> "q0.9"``."""
    return f"q{float(level)!r}"


def quantile_levels(frame: pd.DataFrame) -> list[tuple[float, str]]:
    """``(level, column)`` pairs of the quantile columns of ``frame``, sorted by level."""
    found = []
    for column in frame.columns:
        match = QUANTILE_COLUMN.fullmatch(str(column))
        if match:
            found.append((float(match.group(1)), str(column)))
    return sorted(found)


def p_any_from_quantiles(levels: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Coarse P(count > 0) from quantiles: one minus the highest level whose quantile is 0.

    Args:
        levels: (Q,) quantile levels, increasing.
        values: (..., Q) quantile values.

    Returns:
        (...) probabilities; 1 - max{level : q_level <= 0}, or 1 - levels[0] / 2
        when even the lowest quantile is positive (nothing says it can be 0).
    """
    zero = values <= 0
    highest_zero = np.where(zero, levels, 0.0).max(axis=-1)
    p = 1.0 - highest_zero
    return np.where(zero.any(axis=-1), p, 1.0 - levels[0] / 2.0)


def float_columns(frame: pd.DataFrame, columns: list[str]) -> np.ndarray:
    """``frame[columns].to_numpy(dtype="float64")``, column by column (a frame subset costs a copy and an index
    lookup; the plan step reads these every replayed minute)."""
    if not columns or not frame.columns.is_unique:
        return frame[list(columns)].to_numpy(dtype="float64")
    out = np.empty((len(frame), len(columns)))
    for k, column in enumerate(columns):
        out[:, k] = frame[column].to_numpy(dtype="float64")
    return out


def validate_forecast(frame: pd.DataFrame) -> list[tuple[float, str]]:
    """Check a forecast frame against the contract; returns its quantile columns.

    Raises:
        ValueError: naming the first problem (missing column, no quantile, a
            negative value, p_any outside [0, 1]).
    """
    for column in ("unique_id", "ds"):
        if column not in frame.columns:
            raise ValueError(f"forecast lacks column {column!r}; has {list(frame.columns)}")
    levels = quantile_levels(frame)
    if not levels:
        raise ValueError(f"forecast has no quantile column (q0.5, q0.9, ...); has {list(frame.columns)}")
    values = float_columns(frame, [c for _, c in levels])
    if np.isnan(values).any() or (values < 0).any():
        raise ValueError("forecast quantiles must be finite and >= 0")
    if "p_any" in frame.columns:
        p = frame["p_any"].to_numpy(dtype="float64")
        if np.isnan(p).any() or (p < 0).any() or (p > 1).any():
            raise ValueError("p_any must lie in [0, 1]")
    return levels
