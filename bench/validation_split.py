"""The ensemble's validation split of a fit window, and a member's score on it (shared by the member benchmarks).

``Ensemble.fit_panel`` fits every member on the first ``T - V`` steps of a fit window of ``T`` steps and scores
it on rolling origins every ``stride`` steps of the tail ``V = min(max(4 * horizon, T // 5), T // 2)``, horizons
``1..horizon``. The member-default benchmarks (``bench/rf_trees.py``, ``bench/member_defaults.py``) score a
member alone on exactly that split, so that a default is chosen on data the ensemble itself would see; no test
origin of ``bench/accuracy.py``'s protocol is read. With the product's 60 horizons the stride is 12 steps.

Scores, per series, then aggregated: the MAE over every (origin, horizon) of the tail; the MAE relative to the
:class:`~forecaster.forecast.members.Fallback` member's on the same split (series where the fallback's MAE is
> 0), which puts quiet and busy series on one scale; and the MASE (MAE over the mean absolute one-step change in
the ``T - V`` training steps), whose median is taken over *active* series (at least one invocation in the tail),
as protocol v2's headline is.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from forecaster.forecast.members import Fallback, actuals
from forecaster.forecast.panel import Panel

#: the product's horizons (steps); ``Ensemble``'s and the tree members' default
HORIZON = 60
#: the Azure day's fit window in ``bench/accuracy.py``'s protocol (minutes 0..1079)
AZURE_FIT_STEPS = 1080
#: Huawei DC4's fit window in that protocol (the first 23 days of 5-minute steps)
HUAWEI_FIT_STEPS = 23 * 288
#: the member benchmarks keep at most the last 3 days of a longer fit window (cost; Huawei's 23 days -> 864 steps)
MAX_FIT_DAYS = 3


def validation_tail_steps(n_steps: int, horizon: int = HORIZON) -> int:
    """``Ensemble``'s default validation tail ``V`` (steps) for a fit window of ``n_steps``."""
    return min(max(4 * horizon, n_steps // 5), n_steps // 2)


def validation_stride(horizon: int = HORIZON) -> int:
    """``Ensemble``'s default steps between validation origins."""
    return max(1, horizon // 5)


@dataclass(frozen=True)
class ValidationSplit:
    """One fit window cut as the ensemble cuts it, with the fallback's errors to compare against.

    Attributes:
        panel: the whole fit window (``T`` steps); origin ``o`` reads only its columns ``0..o-1``.
        train: its first ``T - V`` steps, what members are fitted on.
        origins: validation origins (steps), every :func:`validation_stride` steps of the tail.
        horizon: horizons ``1..horizon`` scored at each origin.
        actual: ``(N, O, horizon)`` actual counts.
        fallback_mae: ``(N,)`` the fallback member's MAE per series on this split.
        mase_scale: ``(N,)`` mean absolute one-step change over ``train`` (NaN where nothing is known).
        active: ``(N,)`` the series has at least one invocation in the tail.
    """

    panel: Panel
    train: Panel
    origins: list[int]
    horizon: int
    actual: np.ndarray
    fallback_mae: np.ndarray
    mase_scale: np.ndarray
    active: np.ndarray


def make_split(panel: Panel, horizon: int = HORIZON) -> ValidationSplit:
    """The ensemble's split of ``panel`` (a fit window), with the fallback fitted and scored on it."""
    first = panel.n_steps - validation_tail_steps(panel.n_steps, horizon)
    origins = list(range(first, panel.n_steps - horizon + 1, validation_stride(horizon))) or [first]
    train = panel.head(first)
    actual = actuals(panel.values, origins, horizon)
    fallback = Fallback(horizon=horizon).fit_panel(train).forecast(panel, origins, horizon)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # series with nothing known
        scale = np.nanmean(np.abs(np.diff(train.values, axis=1)), axis=1)
        active = np.nansum(panel.values[:, first:], axis=1) > 0
    return ValidationSplit(panel, train, origins, horizon, actual, series_mae(actual, fallback), scale, active)


def series_mae(actual: np.ndarray, forecast: np.ndarray) -> np.ndarray:
    """``(N,)`` mean absolute error over every origin and horizon; NaN for a series the forecast leaves NaN."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(np.abs(forecast - actual), axis=(1, 2))


def member_mae(split: ValidationSplit, member) -> np.ndarray:
    """A fitted member's per-series MAE on the split's origins."""
    return series_mae(split.actual, member.forecast(split.panel, split.origins, split.horizon))


def summary(split: ValidationSplit, mae: np.ndarray, rows: np.ndarray | None = None) -> dict:
    """Aggregates of per-series ``mae`` over ``rows`` (bool ``(N,)``; default: every series with a finite MAE).

    Returns ``mae_mean`` (mean per-series MAE), ``mae_rel_fallback`` (mean of MAE / the fallback's MAE over the
    rows where the latter is > 0), ``mase_median_active`` (median MASE over the active rows with a scale > 0) and
    the number of series behind each.
    """
    rows = np.isfinite(mae) if rows is None else rows & np.isfinite(mae)
    relative = rows & (split.fallback_mae > 0)
    scaled = rows & split.active & (np.nan_to_num(split.mase_scale) > 0)
    return {
        "series": int(rows.sum()),
        "mae_mean": float(np.mean(mae[rows])) if rows.any() else None,
        "mae_rel_fallback": float(np.mean(mae[relative] / split.fallback_mae[relative])) if relative.any() else None,
        "rel_series": int(relative.sum()),
        "mase_median_active": float(np.median(mae[scaled] / split.mase_scale[scaled])) if scaled.any() else None,
        "active_series": int(scaled.sum()),
    }


def load_fit_window(name: str, traces: Path) -> Panel:
    """A dataset's fit window in ``bench/accuracy.py``'s protocol, cut to its last :data:`MAX_FIT_DAYS` days.

    ``"azure"``: the Azure Functions 2019 day, minutes 0..1079 (1,350 series). ``"huawei_dc4"``: Huawei Cloud DC4,
    steps 0..6623 (23 days of 5-minute steps, 8 series), of which the last 3 days (steps 5760..6623, 864 steps)
    are kept.
    """
    from bench.accuracy import DATASETS, load_panel

    path, fmt = DATASETS[name]
    panel = load_panel(traces / path, fmt)
    fit_steps = AZURE_FIT_STEPS if name == "azure" else HUAWEI_FIT_STEPS if name.startswith("huawei") else None
    if fit_steps is None:
        raise ValueError(f"no fit window known for {name!r}")
    keep = min(fit_steps, round(MAX_FIT_DAYS * 1440 / panel.step_minutes))
    first = fit_steps - keep
    return Panel(panel.ids, panel.start + first * panel.step, panel.step, panel.values[:, first:fit_steps])
