"""Count quantiles made to agree with the forecast's own ``p_any``, for the demand given a request.

The planner reads three things from a forecast row: ``p_any`` (the warm-or-not decision); the demand given a
request (the queued-wait part of a cold start's cost); and the count quantiles themselves (the replica count at the
newsvendor level, the chance that a replica beyond the warm ones is needed, which drives pre-loads, and the GPU
budget's ranking). The demand given a request is read from the distribution whose mass above zero is ``p_any``:
a level ``tau <= 1 - p_any`` has quantile 0, a higher one a positive count, and the demand given a request is the
mean of the quantile function over ``[1 - p_any, 1]`` (:meth:`ForecastArrays.demand_given_any
<forecaster.planning.planner.ForecastArrays.demand_given_any>`). The third group asks coverage questions
(P(count <= x) at a level), which the forecast's own quantiles answer: the ensemble calibrates each level
(conformal offsets), so the planner reads them as forecast. Rescaling them too, as the planner did from d3b56cd to
this change, sized replicas below the forecast's own coverage wherever ``p_any`` fell below the quantiles' mass
above zero: on the demo sample (the 100 busiest functions, 6 replayed hours) that made 3,447 cold-start requests
and 2,573 replica starts for 3.77 M GPU-seconds, against 1,601, 1,152 and 3.48 M reading the quantiles as
forecast; on the Azure fleet day at cold cost 4 the p75 cold % read 15.0 % against 15.4 % at the same waste
(148.7 and 148.6 %), a few models either way.

The causal empirical source builds its quantiles that way (a point mass at zero of ``1 - p_any`` mixed with the
non-zero counts), so the two agree. The ensemble's do not: its quantiles are the point forecast plus
conformal residual quantiles, fitted separately from its ``p_any`` (a stacked, hazard-based estimate). Seen on
the Azure day (1,350 functions; the ensemble fitted at minute 600 on minutes 0..599, its forecasts every 10
minutes from 600 to 950, 10 minutes ahead; a diagnosis, nothing here is chosen from it): in the 0.1-0.3
activity segment the ensemble's q0.9 is positive on 60 % of
the idle minutes where its own ``p_any`` is below 0.1 (the empirical source's: 0 %), and the quantile the
planner took for the demand given a request (then its median) is 3 times the empirical source's (4.6 vs 1.5
requests per minute), so a cold start's queued wait (``lambda D^2 / 2``), and with it the value of holding or pre-loading the
model, is inflated for exactly the sparse models whose cold starts the p75 counts.

:func:`coherent_quantiles` keeps a row whose zero/positive pattern already agrees with its ``p_any`` as it is
(every empirical and oracle row), and rescales the others to ``p_any``'s mass above zero, keeping the shape of
their positive part: with ``p_q`` = the row's own P(count > 1/2) read from its quantiles,

    Q'(tau) = 0                                       for tau <= 1 - p_any
    Q'(tau) = max(1, Q(1 - (1 - tau) * p_q / p_any))  above (a positive count is at least one request)

i.e. P'(count > x) = p_any * P(count > x) / p_q for x >= 1/2.
"""

from __future__ import annotations

import numpy as np

#: Tolerance on ``1 - p_any`` when telling the levels at zero from the positive ones (float rounding).
LEVEL_TOL = 1e-9


def incoherent_rows(levels: np.ndarray, values: np.ndarray, p_any: np.ndarray) -> np.ndarray:
    """(N, H) True where a row's quantiles disagree with its ``p_any``: a level at or below ``1 - p_any`` with a
    positive quantile, or a level above it with a quantile of 0."""
    cut = (1.0 - p_any)[..., None]
    at_zero = levels <= cut - LEVEL_TOL
    positive = levels > cut + LEVEL_TOL
    return ((at_zero & (values > 0)) | (positive & (values <= 0))).any(axis=-1)


def _interp_rows(levels: np.ndarray, values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Each row's piecewise-linear quantile function ``values`` (R, L) at levels ``at`` (R, L), clamped at the ends."""
    pos = np.interp(at, levels, np.arange(len(levels)))
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, len(levels) - 1)
    frac = pos - lo
    v_lo = np.take_along_axis(values, lo, axis=1)
    v_hi = np.take_along_axis(values, hi, axis=1)
    return v_lo * (1 - frac) + v_hi * frac


def _mass_above_half(levels: np.ndarray, values: np.ndarray) -> np.ndarray:
    """(R,) P(count > 1/2) from each row's quantiles (linear between levels; the tails beyond the ends are
    ``levels[0]`` below and ``1 - levels[-1]`` above, as the planner reads them)."""
    x = 0.5
    below = values[:, 0] > x
    above = values[:, -1] <= x
    k = np.clip((values <= x).sum(axis=1) - 1, 0, len(levels) - 2)
    rows = np.arange(len(values))
    v0, v1 = values[rows, k], values[rows, k + 1]
    frac = np.where(v1 > v0, (x - v0) / np.where(v1 > v0, v1 - v0, 1.0), 1.0)
    cdf = levels[k] + np.clip(frac, 0.0, 1.0) * (levels[k + 1] - levels[k])
    cdf = np.where(below, levels[0] * x / np.maximum(values[:, 0], 1e-12), cdf)
    cdf = np.where(above, levels[-1], cdf)
    return 1.0 - cdf


def coherent_quantiles(levels: np.ndarray, values: np.ndarray, p_any: np.ndarray) -> tuple[np.ndarray, int]:
    """``values`` (N, H, L; non-decreasing along L) with the rows that disagree with ``p_any`` (N, H) rescaled
    to it (see the module docstring); returns the new array and how many rows were rescaled."""
    levels = np.asarray(levels, dtype="float64")
    if len(levels) < 2 or not values.size:
        return values, 0
    bad = incoherent_rows(levels, values, p_any)
    count = int(bad.sum())
    if not count:
        return values, 0
    rows = values[bad]  # (R, L)
    p = np.clip(p_any[bad], 0.0, 1.0)
    p_q = np.maximum(_mass_above_half(levels, rows), 1e-12)
    with np.errstate(divide="ignore", invalid="ignore"):
        at = 1.0 - (1.0 - levels[None, :]) * (p_q / np.maximum(p, 1e-12))[:, None]
    positive = levels[None, :] > (1.0 - p)[:, None] + LEVEL_TOL
    fixed = np.where(positive, np.maximum(_interp_rows(levels, rows, np.clip(at, 0.0, 1.0)), 1.0), 0.0)
    out = values.copy()
    out[bad] = np.maximum.accumulate(fixed, axis=1)
    return out, count
