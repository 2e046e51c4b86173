"""Forecast sources for the planner: an oracle and a simple causal source (the contract is in
:mod:`forecaster.contracts.forecast`; the ensemble's source is :mod:`forecaster.planning.ensemble_source`).

Both read a :class:`CountPanel`; each call at ``now`` looks only at columns
before ``now`` (the oracle, by design, also at the ones after).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
import pandas as pd

from forecaster.contracts.forecast import DEFAULT_LEVELS, quantile_column
from forecaster.forecast.hazard import activity_bin, age_bin, empty_pool, hazard, renewal_p_any


# --------------------------------------------------------------------------- the panel the sources read


@dataclass(frozen=True)
class CountPanel:
    """Per-minute invocation counts of many models on one time axis.

    Attributes:
        ids: (N,) model ids.
        start: UTC time of column 0 (a minute boundary).
        counts: (N, T) non-negative counts per minute.
    """

    ids: np.ndarray
    start: pd.Timestamp
    counts: np.ndarray

    @classmethod
    def from_long(cls, frame: pd.DataFrame) -> "CountPanel":
        """From a long ``unique_id, ds, y`` frame at a one-minute step; gaps are zeros."""
        ds = pd.to_datetime(frame["ds"], utc=True)
        start = ds.min()
        col = ((ds - start) // pd.Timedelta(minutes=1)).to_numpy(dtype="int64")
        ids, row = np.unique(frame["unique_id"].astype(str).to_numpy(), return_inverse=True)
        counts = np.zeros((len(ids), int(col.max()) + 1 if len(col) else 0))
        np.add.at(counts, (row, col), frame["y"].to_numpy(dtype="float64"))
        return cls(ids=ids.astype(object), start=start, counts=counts)

    @property
    def n_minutes(self) -> int:
        return int(self.counts.shape[1])

    def minute_index(self, moment: datetime) -> int:
        """Column of the minute starting at ``moment`` (may lie outside the panel)."""
        return int((pd.Timestamp(moment) - self.start) // pd.Timedelta(minutes=1))

    def frame(self, first_col: int, values: dict[str, np.ndarray]) -> pd.DataFrame:
        """Long forecast frame from (N, H) arrays, target minutes ``first_col .. first_col + H - 1``."""
        n, h = next(iter(values.values())).shape
        ds = self.start + pd.to_timedelta(np.arange(first_col, first_col + h), unit="min")
        # ``take`` keeps the tz-aware datetimes as one array; ``np.tile`` made 1,000 Timestamp objects per minute
        out = {"unique_id": np.repeat(self.ids, h), "ds": ds.take(np.tile(np.arange(h), n))}
        out.update({name: np.asarray(v, dtype="float64").reshape(-1) for name, v in values.items()})
        return pd.DataFrame(out)


def _future(counts: np.ndarray, first: int, h: int) -> np.ndarray:
    """Columns ``first .. first + h - 1`` of ``counts``; zeros beyond the panel."""
    n, t = counts.shape
    out = np.zeros((n, h))
    lo, hi = max(first, 0), min(first + h, t)
    if hi > lo:
        out[:, lo - first:hi - first] = counts[:, lo:hi]
    return out


class OracleForecast:
    """Perfect knowledge of the future: every quantile equals the actual count, ``p_any`` is 0 or 1."""

    def __init__(self, panel: CountPanel, levels: tuple[float, ...] = DEFAULT_LEVELS):
        self.panel = panel
        self.levels = tuple(levels)

    def quantiles(self, now: datetime, horizon_min: int) -> pd.DataFrame:
        return self.frame_at(self.panel.minute_index(now), horizon_min)

    def frame_at(self, col: int, horizon_min: int) -> pd.DataFrame:
        actual = _future(self.panel.counts, col, horizon_min)
        values = {quantile_column(q): actual for q in self.levels}
        values["p_any"] = (actual > 0).astype("float64")
        return self.panel.frame(col, values)


# --------------------------------------------------------------------------- the causal source


class EmpiricalForecast:
    """Causal forecasts from each model's own history, with a pooled prior for short histories.

    * ``p_any`` for minute ``t + k``: an idle-time (renewal) model. The hazard at
      age ``a`` (minutes since the last invocation minute) is the model's own
      empirical one, ``#{IT = a} / #{IT >= a}`` over its idle times ``IT``
      (1-minute bins up to ``max_age``), shrunk towards a pooled hazard of all
      models in the same (activity, age) bin with weight ``prior_weight``
      pseudo-observations. Periodic timers get a sharp hazard at their period,
      bursty models a decreasing one, models never seen the pooled rate of
      never-seen models. Minutes beyond ``t`` chain the hazard through the
      renewal equation.
    * quantiles: ``p_any`` mixed with the empirical distribution of the
      non-zero counts of the last ``window`` minutes (all history when fewer
      than ``min_nonzero`` non-zero minutes fall in the window).

    Calls must come with non-decreasing ``now`` for the incremental state; an
    earlier ``now`` rebuilds it from the start (still causal).
    """

    def __init__(
        self,
        panel: CountPanel,
        *,
        levels: tuple[float, ...] = DEFAULT_LEVELS,
        window: int = 60,
        min_nonzero: int = 5,
        max_age: int = 240,
        prior_weight: float = 3.0,
    ):
        self.panel = panel
        self.levels = tuple(levels)
        self.window = window
        self.min_nonzero = min_nonzero
        self.max_age = max_age
        self.prior_weight = prior_weight
        self._reset()

    # ------------------------------------------------------------------ state
    def _reset(self) -> None:
        n = len(self.panel.ids)
        self.t_ = 0  # columns 0..t_-1 have been absorbed
        self.hist_ = np.zeros((n, self.max_age + 2))  # idle times 1..max_age, overflow at max_age + 1
        self.excess_ = np.zeros(n)  # sum over overflow idle times of (IT - max_age)
        self.last_ = np.full(n, -1, dtype=np.int64)
        self.active_ = np.zeros(n)
        self.pool_events_, self.pool_exposure_ = empty_pool()

    def _ages(self, t: int) -> np.ndarray:
        """Minutes from the last invocation minute to ``t``; never seen = older than the range."""
        return np.where(self.last_ >= 0, t - self.last_, t + 1 + self.max_age)

    def _advance(self, until: int) -> None:
        """Absorb columns ``t_ .. until - 1``: idle-time histograms and pooled hazards."""
        if until < self.t_:
            self._reset()
        counts = self.panel.counts
        rows = np.arange(len(self.panel.ids))
        for t in range(self.t_, min(until, counts.shape[1])):
            invoked = counts[:, t] > 0
            age = self._ages(t)
            cell = (activity_bin(self.active_), age_bin(age))
            np.add.at(self.pool_exposure_, cell, 1.0)
            np.add.at(self.pool_events_, cell, invoked.astype("float64"))
            seen = invoked & (self.last_ >= 0)
            self.hist_[rows[seen], np.minimum(age[seen], self.max_age + 1)] += 1
            over = seen & (age > self.max_age)
            self.excess_[over] += age[over] - self.max_age
            self.last_ = np.where(invoked, t, self.last_)
            self.active_ += invoked
        self.t_ = max(self.t_, until)

    # ------------------------------------------------------------------ forecasts
    def hazard(self, ages: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        """P(invocation at age ``a`` | none since the last one), per model; ``ages`` is (N,) or (N, K)."""
        return hazard(self.hist_, self.excess_, self.active_ if active is None else active, ages,
                      self.pool_events_ / self.pool_exposure_, max_age=self.max_age, prior_weight=self.prior_weight)

    def p_any_at(self, col: int, horizon_min: int) -> np.ndarray:
        """(N, H) P(at least one invocation) in minutes ``col .. col + H - 1``, from data before ``col``."""
        self._advance(col)
        return renewal_p_any(self.hazard, self._ages(col), self.active_, horizon_min)

    def quantiles(self, now: datetime, horizon_min: int) -> pd.DataFrame:
        col = self.panel.minute_index(now)
        return self.frame_at(col, horizon_min)

    def frame_at(self, col: int, horizon_min: int) -> pd.DataFrame:
        p_any = self.p_any_at(col, horizon_min)
        top = max(self.levels)
        rows = np.flatnonzero((p_any > 1.0 - top).any(axis=1))  # only these can have a positive quantile
        positive = self._positive_quantiles(col, rows)
        values: dict[str, np.ndarray] = {}
        for level in self.levels:
            # P(count <= x) = (1 - p) + p * F+(x): the level falls in the positive part when level > 1 - p
            q = np.zeros_like(p_any)
            if len(rows):
                p = p_any[rows]
                inner = (level - (1.0 - p)) / np.maximum(p, 1e-12)
                q[rows] = np.where(inner > 0, self._interp_positive(positive, inner), 0.0)
            values[quantile_column(level)] = q
        values["p_any"] = p_any
        return self.panel.frame(col, values)

    # ------------------------------------------------------------------ helpers
    _GRID = np.linspace(0.0, 1.0, 21)

    def _positive_quantiles(self, col: int, rows: np.ndarray) -> np.ndarray:
        """(len(rows), 21) quantiles of the non-zero counts of the last ``window`` minutes.

        Rows with fewer than ``min_nonzero`` non-zero minutes there use the last
        ``4 * window`` minutes; rows with none at all get 1 (a lone request).
        """
        out = np.ones((len(rows), len(self._GRID)))
        if not len(rows) or col <= 0:
            return out
        long = self.panel.counts[rows, max(col - 4 * self.window, 0):col]
        short = long[:, -self.window:]
        q_short, n_short = self._nonzero_quantiles(short)
        q_long, n_long = self._nonzero_quantiles(long)
        use_short = n_short >= self.min_nonzero
        out = np.where(use_short[:, None], q_short, q_long)
        return np.where(((n_short > 0) | (n_long > 0))[:, None], out, 1.0)

    def _nonzero_quantiles(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row, quantiles on :attr:`_GRID` of the non-zero entries, and how many there are."""
        ordered = np.sort(values, axis=1)
        width = ordered.shape[1]
        n = (ordered > 0).sum(axis=1)
        pos = (width - n)[:, None] + self._GRID[None, :] * np.maximum(n - 1, 0)[:, None]
        lo = np.clip(np.floor(pos).astype(np.int64), 0, width - 1)
        hi = np.clip(lo + 1, 0, width - 1)
        frac = pos - np.floor(pos)
        q = np.take_along_axis(ordered, lo, 1) * (1 - frac) + np.take_along_axis(ordered, hi, 1) * frac
        return q, n

    def _interp_positive(self, table: np.ndarray, level: np.ndarray) -> np.ndarray:
        """Interpolate each row's quantile table (R, 21) at levels (R, H)."""
        pos = np.clip(level, 0.0, 1.0) * (len(self._GRID) - 1)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, len(self._GRID) - 1)
        frac = pos - lo
        return np.take_along_axis(table, lo, 1) * (1 - frac) + np.take_along_axis(table, hi, 1) * frac


def horizon_minutes(now: datetime, horizon_min: int) -> list[datetime]:
    """Starts of the target minutes of a forecast made at ``now`` (a minute boundary)."""
    return [now + timedelta(minutes=k) for k in range(horizon_min)]
