"""Rolling-origin, no-refit backtest: ``../shared/EVALUATION.md`` section 1.

A :class:`Protocol` fixes the fit window, the origins and the horizons of a
dataset; :func:`run_backtest` fits a forecaster once on the fit window and
forecasts every origin conditioning on the data before it (parameters never
see test data); :func:`evaluate` turns forecasts into the per-series,
per-horizon table and the aggregate rows:

* ``MAE_i``: mean |actual - point| over all (origin, h) of series ``i``;
* ``MASE_i = MAE_i / scale_i``, ``scale_i`` = mean |y_t - y_{t-1}| over the fit
  window; series with ``scale_i = 0`` are skipped and counted; median and mean
  over series, and per horizon (median over series of ``MAE_{i,h} / scale_i``);
* ``wQL_q = 2 * sum pinball_q / sum |actual|`` pooled over the subset, for
  q0.1, q0.5 (= the point) and q0.9; ``wql`` = their mean;
* ``coverage_q90``: share of test points with actual <= q0.9;
* spike recall: a spike is a test step ``t`` with actual > 2 x the mean of the
  60 minutes before ``t`` and actual >= 5; forecasts made at least 5 minutes
  ahead count; recall = share of them with q0.9 >= 0.8 x actual.

Protocol v2 additions (the v1 keys above stay):

* ``mase_median_active``: median MASE over the *active* series only (at least
  one invocation in the test window; ``active_series`` counts them, and
  ``mase_active_skipped`` those among them with ``scale_i = 0``); also per
  horizon (``mase_active_h<k>``) next to the pooled ``wql_h<k>``;
* ``coverage_q90_strict``: share of test points with actual < q0.9, so that
  [``coverage_q90_strict``, ``coverage_q90``] brackets the true coverage of a
  count quantile; ``coverage_q99``: share with actual <= q0.99 (NaN for a
  method without q0.99);
* ``brier_any``: pooled mean of ``(p_any - 1{actual > 0})^2``. A method without
  its own ``p_any`` takes the planner's
  :func:`~forecaster.contracts.forecast.p_any_from_quantiles` of the levels it
  has (q0.1, q0.5 = point, q0.9, q0.99): 1 - the highest level whose quantile is
  0 (and 1 - 0.1 / 2 when even the lowest is positive, as the planner does).
  Baselines scored on the same points: ``brier_any_climatology`` (each series'
  share of non-zero steps in the fit window) and ``brier_any_recent`` (its
  share of non-zero steps in the hour before the origin: 60 steps per-minute,
  12 on 5-minute data; the climatology where that hour holds no known step);
* ``spike_recall_q99``: spike recall with q0.99 in place of q0.9 (same spikes,
  same h >= 5 minutes rule).

Subsets: ``all`` and ``busy`` (fit-window mean >= 1 per minute, i.e. >= 5 per
5-minute step), chosen from fit data only.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from forecaster.contracts.forecast import p_any_from_quantiles
from forecaster.forecast.members import actuals
from forecaster.forecast.panel import Panel

QUANTILES = (0.1, 0.5, 0.9)


@dataclass(frozen=True)
class Protocol:
    """Fit window, origins and horizons of one dataset (all in steps).

    Attributes:
        name: dataset name, for tables.
        fit_steps: steps ``0..fit_steps-1`` are the fit window.
        origins: first forecast step of each window.
        horizon: horizons ``1..horizon`` are forecast at every origin.
        step_minutes: minutes per step.
        season: season length in steps (for the seasonal-naive peer), or ``None``.
        report_horizons: horizons with their own MASE column.
    """

    name: str
    fit_steps: int
    origins: tuple[int, ...]
    horizon: int
    step_minutes: float
    season: int | None
    report_horizons: tuple[int, ...]

    @property
    def busy_threshold(self) -> float:
        """Fit-window mean count per step at or above which a series is busy (1 per minute)."""
        return self.step_minutes

    @property
    def spike_min_h(self) -> int:
        """Smallest horizon whose forecasts count for spike recall (5 minutes ahead)."""
        return max(1, math.ceil(5 / self.step_minutes))

    @property
    def spike_window(self) -> int:
        """Steps in the trailing 60 minutes of the spike definition."""
        return max(1, int(round(60 / self.step_minutes)))

    @property
    def n_steps(self) -> int:
        return self.origins[-1] + self.horizon


def azure_protocol(n_steps: int = 1440) -> Protocol:
    """Azure Functions 2019 day: fit on 0..1079, origins 1080, 1095, ..., 1425, horizons 1..15, no season."""
    horizon = 15
    origins = tuple(range(1080, n_steps - horizon + 1, 15))
    return Protocol("azure", 1080, origins, horizon, 1.0, None, (1, 5, 15))


def huawei_protocol(n_steps: int) -> Protocol:
    """Huawei 5-minute: fit on the first 23 days, origins every 12 steps from 6624, horizons 1..12, season 288."""
    horizon, fit = 12, 23 * 288
    origins = tuple(range(fit, n_steps - horizon + 1, 12))
    return Protocol("huawei", fit, origins, horizon, 5.0, 288, (1, 3, 12))


def generic_protocol(n_steps: int, step_minutes: float, name: str = "trace") -> Protocol:
    """Any other trace: fit on ``0..o1-1`` with ``o1 = T - ceil(0.2 T)``, then an origin every 60 minutes.

    Horizons 1..15 on per-minute data, 1..12 on 5-minute data (one hour
    otherwise); a one-day season when the fit window holds two full days.
    """
    first = n_steps - math.ceil(0.2 * n_steps)
    per_hour = max(1, int(round(60 / step_minutes)))
    horizon = 15 if step_minutes <= 1 else per_hour
    origins = tuple(range(first, n_steps - horizon + 1, per_hour))
    if not origins:
        raise ValueError(f"{n_steps} steps leave no origin with a {horizon}-step horizon")
    day = 1440 / step_minutes
    season = int(day) if day.is_integer() and first >= 2 * day else None
    report = (1, 5, 15) if horizon == 15 else (1, max(1, horizon // 4), horizon)
    return Protocol(name, first, origins, horizon, step_minutes, season, report)


# ---------------------------------------------------------------------------- running


@dataclass
class MethodForecasts:
    """One method's backtest forecasts, arrays ``(N, O, H)`` on the protocol's origins."""

    point: np.ndarray
    q10: np.ndarray | None = None
    q90: np.ndarray | None = None
    seconds: float = float("nan")
    extra: dict[str, Any] = field(default_factory=dict)
    #: q0.99 where the method has one (coverage_q99, spike_recall_q99)
    q99: np.ndarray | None = None
    #: P(count > 0) where the method gives one; otherwise derived from the quantiles (see ``brier_any``)
    p_any: np.ndarray | None = None

    def derived_p_any(self) -> np.ndarray:
        """``p_any``, or the planner's coarse one from the quantile levels the method has."""
        if self.p_any is not None:
            return self.p_any
        pairs = [(0.1, self.q10), (0.5, self.point), (0.9, self.q90), (0.99, self.q99)]
        levels = np.array([level for level, values in pairs if values is not None])
        stacked = np.stack([np.nan_to_num(values, nan=0.0) for _, values in pairs if values is not None], axis=-1)
        # the planner makes the levels non-decreasing first (np.maximum.accumulate); so does this
        return p_any_from_quantiles(levels, np.maximum.accumulate(stacked, axis=-1))


def fit_window(panel: Panel, protocol: Protocol, max_fit_steps: int | None = None) -> Panel:
    """The fit window ``0..fit_steps-1``, or only its last ``max_fit_steps`` steps (start moved accordingly).

    The bound is an approximation EVALUATION.md allows for long traces (labelled
    in the benchmark's output): parameters are estimated on the recent part of
    the fit window only; forecasts still condition on all data before each origin.
    """
    if max_fit_steps is None or max_fit_steps >= protocol.fit_steps:
        return panel.head(protocol.fit_steps)
    first = protocol.fit_steps - int(max_fit_steps)
    return Panel(panel.ids, panel.start + first * panel.step, panel.step, panel.values[:, first : protocol.fit_steps])


def run_backtest(
    model: Any, panel: Panel, protocol: Protocol, *, members: bool = False, max_fit_steps: int | None = None
) -> dict[str, MethodForecasts]:
    """Fit ``model`` once on the fit window and forecast every origin (no refit).

    Args:
        model: an :class:`~forecaster.forecast.ensemble.Ensemble` (quantiles) or a
            member (point forecasts only).
        panel: the whole series, fit window and test period.
        protocol: fit window, origins, horizon.
        members: for an ensemble, also return every member's forecasts with its
            own conformal q0.1 / q0.9.
        max_fit_steps: fit on the last ``max_fit_steps`` steps of the fit
            window only (:func:`fit_window`; ``None`` = all of it).

    Returns:
        method name -> forecasts; ``seconds`` = fit plus all origins' forecasts.
    """
    started = time.perf_counter()
    model.fit_panel(fit_window(panel, protocol, max_fit_steps))
    fitted = time.perf_counter()
    if hasattr(model, "members_") or hasattr(model, "shard_of_"):  # an ensemble, sharded or not
        arrays = model.forecast(panel, protocol.origins, protocol.horizon, members=members)
        seconds = time.perf_counter() - started
        out = {model.name: MethodForecasts(arrays[model.name], arrays.get("q0.1"), arrays.get("q0.9"), seconds,
                                           q99=arrays.get("q0.99"), p_any=arrays.get("p_any"))}
        out[model.name].extra["p_any"] = arrays.get("p_any")
        if members:
            for name, fit_seconds in model.fit_seconds_.items():
                if name in arrays:
                    # fit (on the validation split, its validation forecasts, and any refit) + test forecasts
                    seconds = fit_seconds + model.forecast_seconds_.get(name, 0.0)
                    # members have q0.1 / q0.9 of their own (q0.99 and p_any where the ensemble gives them)
                    out[name] = MethodForecasts(arrays[name], arrays[f"{name}-q0.1"], arrays[f"{name}-q0.9"], seconds,
                                                q99=arrays.get(f"{name}-q0.99"), p_any=arrays.get(f"{name}-p_any"))
        out[model.name].extra["fit_seconds"] = fitted - started
        return out
    point = model.forecast(panel, protocol.origins, protocol.horizon)
    return {model.name: MethodForecasts(point, seconds=time.perf_counter() - started)}


# ---------------------------------------------------------------------------- metrics


def pinball(actual: np.ndarray, forecast: np.ndarray, q: float) -> np.ndarray:
    """Pinball (quantile) loss per point: ``max(q (y - f), (q - 1)(y - f))``."""
    diff = actual - forecast
    return np.maximum(q * diff, (q - 1) * diff)


def fit_scale(panel: Panel, protocol: Protocol) -> np.ndarray:
    """MASE scale per series: mean |y_t - y_{t-1}| over the fit window (NaN steps skipped)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(np.abs(np.diff(panel.values[:, : protocol.fit_steps], axis=1)), axis=1)


def busy_mask(panel: Panel, protocol: Protocol) -> np.ndarray:
    """Series whose fit-window mean is at least one invocation per minute."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(panel.values[:, : protocol.fit_steps], axis=1)
    return np.nan_to_num(mean, nan=0.0) >= protocol.busy_threshold


def spike_mask(panel: Panel, protocol: Protocol) -> np.ndarray:
    """``(N, O, H)``: the target is a spike and the forecast was made far enough ahead."""
    actual = actuals(panel.values, protocol.origins, protocol.horizon)
    window = protocol.spike_window
    filled = np.nan_to_num(panel.values)
    known = ~np.isnan(panel.values)
    csum = np.concatenate([np.zeros((panel.n_series, 1)), np.cumsum(filled, axis=1)], axis=1)
    ccount = np.concatenate([np.zeros((panel.n_series, 1)), np.cumsum(known, axis=1)], axis=1)
    target = np.asarray(protocol.origins)[:, None] + np.arange(protocol.horizon)[None, :]  # (O, H)
    lo = np.clip(target - window, 0, None)
    with np.errstate(invalid="ignore", divide="ignore"):
        trailing = (csum[:, target] - csum[:, lo]) / (ccount[:, target] - ccount[:, lo])
    spike = (actual > 2 * trailing) & (actual >= 5)
    spike &= (np.arange(1, protocol.horizon + 1) >= protocol.spike_min_h)[None, None, :]
    return spike


@dataclass
class BacktestResult:
    """Per-series, per-horizon table plus the aggregate rows.

    Attributes:
        table: one row per method, series and horizon: ``method, unique_id, h,
            busy, points, mae, mase, wql, coverage_q90, coverage_q90_strict,
            coverage_q99, brier_any, spikes, spike_recall, spike_recall_q99``
            and the sums behind them (``abs_actual``, ``pinball_q0.1`` ...,
            ``covered``, ``covered_strict``, ``covered_q99``, ``spikes_hit``,
            ``spikes_hit_q99``, ``positives``, ``brier_sum``,
            ``brier_climatology_sum``, ``brier_recent_sum``), so that any
            aggregate can be recomputed.
        summary: one row per method and subset (the aggregate rows):
            ``method, subset, series, mase_skipped, mase_median, mase,
            active_series, mase_active_skipped, mase_median_active, mase_h<k>,
            mase_active_h<k>, wql_h<k>, mae, wql, wql_q0.1, wql_q0.5, wql_q0.9,
            coverage_q90, coverage_q90_strict, coverage_q99, brier_any,
            brier_any_climatology, brier_any_recent, spikes, spike_recall,
            spike_recall_q99, seconds_per_1000_series``.
    """

    table: pd.DataFrame
    summary: pd.DataFrame

    def to_csv(self, table_path: str, summary_path: str | None = None) -> None:
        self.table.to_csv(table_path, index=False)
        if summary_path:
            self.summary.to_csv(summary_path, index=False)


def evaluate(panel: Panel, protocol: Protocol, forecasts: dict[str, MethodForecasts]) -> BacktestResult:
    """Score every method's forecasts on the protocol (see the module docstring)."""
    actual = actuals(panel.values, protocol.origins, protocol.horizon)  # (N, O, H)
    known = ~np.isnan(actual)
    scale = fit_scale(panel, protocol)
    busy = busy_mask(panel, protocol)
    spikes = spike_mask(panel, protocol)
    baselines = p_any_baselines(panel, protocol)
    n, _, h = actual.shape
    tables, rows = [], []
    for method, fc in forecasts.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            sums = _series_horizon_sums(actual, known, spikes, fc, baselines)
        frame = pd.DataFrame(
            {
                "method": method,
                "unique_id": np.repeat(panel.ids, h),
                "h": np.tile(np.arange(1, h + 1), n),
                "busy": np.repeat(busy, h),
            }
            | {k: v.ravel() for k, v in sums.items()}
        )
        with np.errstate(invalid="ignore", divide="ignore"):
            frame["mae"] = frame["abs_error"] / frame["points"]
            frame["mase"] = frame["mae"] / np.where(np.repeat(scale, h) > 0, np.repeat(scale, h), np.nan)
            frame["wql"] = (
                frame[[f"pinball_q{q:g}" for q in QUANTILES]].mean(axis=1, skipna=False) * 2 / frame["abs_actual"]
            )
            frame["coverage_q90"] = frame["covered"] / frame["points"]
            frame["coverage_q90_strict"] = frame["covered_strict"] / frame["points"]
            frame["coverage_q99"] = frame["covered_q99"] / frame["points"]
            frame["brier_any"] = frame["brier_sum"] / frame["points"]
            frame["spike_recall"] = frame["spikes_hit"] / frame["spikes"]
            frame["spike_recall_q99"] = frame["spikes_hit_q99"] / frame["spikes"]
        tables.append(frame)
        for subset, mask in (("all", np.ones(n, dtype=bool)), ("busy", busy)):
            rows.append(_aggregate(method, subset, mask, sums, scale, protocol, fc.seconds, n))
    return BacktestResult(pd.concat(tables, ignore_index=True), pd.DataFrame(rows))


def p_any_baselines(panel: Panel, protocol: Protocol) -> dict[str, np.ndarray]:
    """The two reference forecasts of ``brier_any``, each ``(N, O, H)``.

    ``climatology``: each series' share of non-zero steps among the known steps
    of the fit window (0 where none is known). ``recent``: its share of non-zero
    steps among the known steps of the hour before the origin (60 steps
    per-minute, 12 on 5-minute data; :attr:`Protocol.spike_window`), the
    climatology where that hour holds no known step; the same for every horizon
    of an origin.
    """
    fit = panel.values[:, : protocol.fit_steps]
    known_fit = ~np.isnan(fit)
    with np.errstate(invalid="ignore", divide="ignore"):
        clim = np.nan_to_num((known_fit & (np.nan_to_num(fit) > 0)).sum(axis=1) / known_fit.sum(axis=1), nan=0.0)
    known = ~np.isnan(panel.values)
    nonzero = known & (np.nan_to_num(panel.values) > 0)
    cz = np.concatenate([np.zeros((panel.n_series, 1)), np.cumsum(nonzero, axis=1)], axis=1)
    ck = np.concatenate([np.zeros((panel.n_series, 1)), np.cumsum(known, axis=1)], axis=1)
    origins = np.asarray(protocol.origins)
    lo = np.clip(origins - protocol.spike_window, 0, None)
    count = ck[:, origins] - ck[:, lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        recent = np.where(count > 0, (cz[:, origins] - cz[:, lo]) / np.where(count > 0, count, 1), clim[:, None])
    shape = (panel.n_series, len(origins), protocol.horizon)
    return {
        "climatology": np.broadcast_to(clim[:, None, None], shape),
        "recent": np.broadcast_to(recent[:, :, None], shape),
    }


def _series_horizon_sums(actual, known, spikes, fc: MethodForecasts, baselines=None) -> dict[str, np.ndarray]:
    """Sums over origins, per series and horizon ``(N, H)``.

    Points where the method has no forecast (a member covering some series
    only, such as ARIMA) are left out, like unknown actuals.
    """
    known = known & ~np.isnan(fc.point)
    spikes = spikes & known
    a = np.where(known, actual, 0.0)
    point = np.where(known, fc.point, 0.0)
    out = {
        "points": known.sum(axis=1).astype(float),
        "abs_error": np.abs(a - point).sum(axis=1),
        "abs_actual": np.abs(a).sum(axis=1),
    }
    bounds = {0.1: fc.q10, 0.5: fc.point, 0.9: fc.q90}
    for q, bound in bounds.items():
        if bound is None:
            out[f"pinball_q{q:g}"] = np.full((a.shape[0], a.shape[2]), np.nan)
        else:
            out[f"pinball_q{q:g}"] = np.where(known, pinball(a, np.where(known, bound, 0.0), q), 0.0).sum(axis=1)
    missing = np.full((a.shape[0], a.shape[2]), np.nan)
    if fc.q90 is None:
        out["covered"] = out["covered_strict"] = out["spikes_hit"] = missing
    else:
        out["covered"] = (known & (actual <= fc.q90)).sum(axis=1).astype(float)
        out["covered_strict"] = (known & (actual < fc.q90)).sum(axis=1).astype(float)
        out["spikes_hit"] = (spikes & (fc.q90 >= 0.8 * actual)).sum(axis=1).astype(float)
    if fc.q99 is None:
        out["covered_q99"] = out["spikes_hit_q99"] = missing.copy()
    else:
        out["covered_q99"] = (known & (actual <= fc.q99)).sum(axis=1).astype(float)
        out["spikes_hit_q99"] = (spikes & (fc.q99 >= 0.8 * actual)).sum(axis=1).astype(float)
    out["spikes"] = spikes.sum(axis=1).astype(float)
    out["positives"] = (known & (a > 0)).sum(axis=1).astype(float)
    event = (a > 0).astype(float)
    out["brier_sum"] = np.where(known, (np.nan_to_num(fc.derived_p_any()) - event) ** 2, 0.0).sum(axis=1)
    for name, p in (baselines or {}).items():
        out[f"brier_{name}_sum"] = np.where(known, (p - event) ** 2, 0.0).sum(axis=1)
    return out


def _aggregate(method, subset, mask, sums, scale, protocol: Protocol, seconds: float, n_total: int) -> dict:
    """One summary row for ``method`` on the series in ``mask``."""
    covered = sums["points"].sum(axis=1) > 0  # the method forecast this series
    mask = mask & covered
    s = {k: v[mask] for k, v in sums.items()}
    usable = scale[mask] > 0
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mae_i = s["abs_error"].sum(axis=1) / s["points"].sum(axis=1)
        mase_i = mae_i[usable] / scale[mask][usable]
        row = {
            "method": method,
            "subset": subset,
            "series": int(mask.sum()),
            "mase_skipped": int((~usable).sum()),
            "mase_median": float(np.nanmedian(mase_i)) if len(mase_i) else np.nan,
            "mase": float(np.nanmean(mase_i)) if len(mase_i) else np.nan,
        }
        # v2 headline: active series only (at least one invocation in the test window)
        active = s["positives"].sum(axis=1) > 0
        active_usable = active & (scale[mask] > 0)
        mase_active = mae_i[active_usable] / scale[mask][active_usable]
        row["active_series"] = int(active.sum())
        row["mase_active_skipped"] = int((active & ~(scale[mask] > 0)).sum())
        row["mase_median_active"] = float(np.nanmedian(mase_active)) if len(mase_active) else np.nan
        for k in protocol.report_horizons:
            per_h = s["abs_error"][usable, k - 1] / s["points"][usable, k - 1] / scale[mask][usable]
            row[f"mase_h{k}"] = float(np.nanmedian(per_h)) if len(per_h) else np.nan
        for k in protocol.report_horizons:
            per_h = (s["abs_error"][active_usable, k - 1] / s["points"][active_usable, k - 1]
                     / scale[mask][active_usable])
            row[f"mase_active_h{k}"] = float(np.nanmedian(per_h)) if len(per_h) else np.nan
            actual_h = s["abs_actual"][:, k - 1].sum()
            row[f"wql_h{k}"] = float(np.mean([2 * s[f"pinball_q{q:g}"][:, k - 1].sum() / actual_h for q in QUANTILES]))
        total_actual = s["abs_actual"].sum()
        points = s["points"].sum()
        row["mae"] = float(s["abs_error"].sum() / points)
        wql = [2 * s[f"pinball_q{q:g}"].sum() / total_actual for q in QUANTILES]
        for q, value in zip(QUANTILES, wql, strict=True):
            row[f"wql_q{q:g}"] = float(value)
        row["wql"] = float(np.mean(wql))
        row["coverage_q90"] = float(s["covered"].sum() / points)
        row["coverage_q90_strict"] = float(s["covered_strict"].sum() / points)
        row["coverage_q99"] = float(s["covered_q99"].sum() / points)
        row["brier_any"] = float(s["brier_sum"].sum() / points)
        for name in ("climatology", "recent"):
            key = f"brier_{name}_sum"
            row[f"brier_any_{name}"] = float(s[key].sum() / points) if key in s else np.nan
        row["spikes"] = int(s["spikes"].sum())
        spikes = s["spikes"].sum()
        row["spike_recall"] = float(s["spikes_hit"].sum() / spikes) if spikes else np.nan
        row["spike_recall_q99"] = float(s["spikes_hit_q99"].sum() / spikes) if spikes else np.nan
        row["seconds_per_1000_series"] = float(seconds / n_total * 1000)
    return row
