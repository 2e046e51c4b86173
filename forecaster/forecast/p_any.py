"""The ensemble's probability of any invocation per step (``p_any``), stacked and checked on the validation tail.

The planner's warm/cold decision for a sparse model rests on ``p_any``, and a
point forecast with residual quantiles describes a mostly-zero series badly:
measured on the Azure day's first 300 functions (``bench/p_any_check.py``,
before this module), 58% of the invoked minutes of sparse series got a
residual ``p_any`` below 0.01. Several cheap estimates each see a different
part of the picture:

* ``residuals``: the ensemble's point forecast plus its validation residual
  distribution (what ``p_any`` was before);
* ``hazard``: the idle-time hazard chained over the horizon
  (:class:`~forecaster.forecast.hazard.IdleTimeHazard`; timers and bursts);
* ``recent``: the share of invoked steps in the last hour before the origin;
* ``long``: the share over the last ``lookback`` steps (a causal climatology);
* ``poisson``: ``1 - exp(-point)``, the point forecast read as a Poisson mean.

``stacked`` is the hazard corrected, per activity segment, by a penalised
logistic regression on the other sources' logits (clipped to
``[1e-9, 1 - 1e-9]``), the log horizon, age and activity, and two interactions,
fitted on every (series, origin, horizon) of the validation tail (at most
:data:`MAX_POINTS` sampled; :class:`SegmentedStack`). Which estimate is used is
decided on the same tail, cross-fitted (the regression is fitted on one half of
the validation origins and scored on the other, :func:`p_any_folds`), **per
activity segment and horizon band** (:data:`SEGMENT_EDGES`,
:data:`HORIZON_BAND_EDGES`): in each cell the candidate with the lowest
cross-fitted Brier score wins (``segment_methods_``, ``segment_scores_``; the
whole tail's scores in ``scores_``), and a cell with fewer than
``SegmentedStack.min_events`` invoked points on the tail keeps the hazard, and so does a cell where the winner's
gain over the hazard is within :data:`CLEAR_MARGIN_SE` standard errors with the series as the unit
(:func:`clearly_lower`). When the cells' choices together score worse on the tail than the best single
candidate everywhere (cross-fitted Brier; the cells' own score is, if anything, optimistic, since they were chosen
on it), that candidate is used everywhere (``method_``): the combination is never worse than its best estimate on
the validation tail. On Huawei DC4 (8 series, 5-minute steps) the guard left two of its three activity segments on
the hazard, and the cells scored 0.1034 against the stack's 0.0921 everywhere (hazard 0.1229). A
single choice for the whole tail, as before, was decided by the horizons and
the busy series that dominate the score: on the Azure day's 1,350 functions
(fitted at minute 240, 60 horizons) it took the stack everywhere, and in the
0.02-0.1 activity segment the residuals, whose one-step ``p_any`` on sparse
series scored 0.029 against the hazard's 0.021 on minutes 240..599 (a
test-origin figure, seen after the fact; the cells were chosen by that
diagnosis, their contents are chosen on the validation tail). The planner
reads ``p_any`` a few steps ahead, where the hazard is sharpest. The residual estimate on the validation tail is itself cross-fitted by the
ensemble (residual quantiles of the other fold), so no estimate is scored on the
residuals it was built from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from forecaster.forecast.hazard import IdleTimeHazard

log = logging.getLogger(__name__)

#: Validation points the logistic regression is fitted on at most (sampled with a fixed seed).
MAX_POINTS = 400_000
#: Estimates the stack combines, in feature order.
SOURCES = ("residuals", "hazard", "recent", "long", "poisson")
_EPS = 1e-9


def p_any_folds(n_origins: int) -> np.ndarray:
    """Fold (0 or 1) of each validation origin: the first half of them, then the second.

    Contiguous halves, not alternating origins: neighbouring origins forecast
    the same target steps at different horizons, so alternating folds would
    score an estimate on invocations its other fold has already seen (on the
    Azure day that made the residual estimate look better than the hazard on
    sparse series, the reverse of what held later).
    """
    return (np.arange(n_origins) >= (n_origins + 1) // 2).astype(np.int64)


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(np.nan_to_num(p, nan=0.5), _EPS, 1 - _EPS)
    return np.log(p / (1 - p))


def _share(invoked: np.ndarray, known: np.ndarray) -> np.ndarray:
    """Smoothed share of invoked steps, ``(k + 0.5) / (n + 1)``."""
    return (invoked.sum(axis=-1) + 0.5) / (known.sum(axis=-1) + 1.0)


class PAnyModel:
    """``p_any`` per series, origin and horizon (see the module docstring).

    Args:
        method: ``"stacked"`` (choose on the validation tail) or ``"residuals"``.
        lookback: steps the hazard and the long-run share read before an origin.
        recent_steps: steps of the recent share (60 = one hour of minutes).
    """

    def __init__(self, *, method: str = "stacked", lookback: int = 1440, recent_steps: int = 60):
        if method not in ("stacked", "residuals"):
            raise ValueError(f"p_any must be 'stacked' or 'residuals', got {method!r}")
        self.method = method
        self.lookback = int(lookback)
        self.recent_steps = int(recent_steps)
        self.method_ = "residuals"
        self.scores_: dict[str, float] = {}
        self.segment_methods_: dict[tuple[int, int], str] = {}
        self.segment_scores_: dict[tuple[int, int], dict[str, float]] = {}

    # ------------------------------------------------------------------ features
    def estimates(self, values: np.ndarray, origins: Sequence[int], point: np.ndarray,
                  p_resid: np.ndarray) -> dict[str, np.ndarray]:
        """Each source's ``(N, O, h)`` estimate at the given origins (columns before each origin only), plus the
        hazard's state ``age`` and ``active`` ``(N, O)`` that :meth:`design` reads."""
        n, o, h = point.shape
        recent = np.zeros((n, o))
        long = np.zeros((n, o))
        for j, origin in enumerate(origins):
            window = values[:, max(0, int(origin) - self.lookback):int(origin)]
            known = ~np.isnan(window)
            invoked = window > 0  # NaN (unknown) > 0 is False
            long[:, j] = _share(invoked, known)
            recent[:, j] = _share(invoked[:, -self.recent_steps:], known[:, -self.recent_steps:])
        hazard, age, active = self.hazard_.p_any_state(values, origins, h)
        return {
            "age": age,  # (N, O): steps since the last invocation, and invoked steps in the lookback
            "active": active,
            "residuals": p_resid,
            "hazard": hazard,
            "recent": np.broadcast_to(recent[:, :, None], point.shape),
            "long": np.broadcast_to(long[:, :, None], point.shape),
            "poisson": 1.0 - np.exp(-np.clip(np.nan_to_num(point, nan=0.0), 0.0, None)),
        }

    def design(self, estimates: dict[str, np.ndarray], points: np.ndarray | None = None) -> np.ndarray:
        """``(N, O, h, F)`` regression inputs: the hazard's logit first (the offset of :class:`SegmentedStack`), the
        other sources' logits, log horizon, log age, log activity and two interactions.

        With ``points`` (bool ``(N, O, h)``), only those points' inputs, ``(P, F)`` in C order: every input is
        elementwise, so they are the same numbers as those points of the full design.
        """
        shape = estimates["residuals"].shape

        def pick(x: np.ndarray) -> np.ndarray:
            full = np.broadcast_to(x, shape)
            return full if points is None else full[points]

        log_h = pick(np.log(np.arange(1, shape[2] + 1, dtype=np.float64)))
        age, active = estimates["age"], estimates["active"]
        log_age = pick(np.log(np.minimum(age, self.lookback + 1))[:, :, None])
        log_active = pick(np.log1p(active)[:, :, None])
        z = {name: _logit(pick(estimates[name])) for name in SOURCES}
        hazard, recent = z["hazard"], z["recent"]
        others = [z[name] for name in SOURCES if name != "hazard"]
        return np.stack([hazard, *others, log_h, log_age, log_active, hazard * log_h, recent * log_h], axis=-1)

    # ------------------------------------------------------------------ fit / predict
    def fit(self, values: np.ndarray, first: int, origins: Sequence[int], point: np.ndarray, p_resid: np.ndarray,
            actual: np.ndarray, *, say: Callable[[str], None] | None = None) -> "PAnyModel":
        """Fit on the validation tail: ``point``/``p_resid``/``actual`` are ``(N, O, h)`` at ``origins``.

        The hazard's pooled table is estimated on ``values[:, :first]`` (the
        members' training part), the choice and the regression on the tail.
        """
        say = say or log.info
        self.hazard_ = IdleTimeHazard(lookback=self.lookback).fit(values[:, :first])
        if self.method == "residuals":
            return self
        estimates = self.estimates(values, origins, point, p_resid)
        known = ~np.isnan(actual)
        if not known.any():
            return self
        target = np.nan_to_num(actual, nan=0.0) > 0
        features = self.design(estimates)
        segment = segment_of(estimates["long"])
        fold = np.broadcast_to(p_any_folds(len(origins))[None, :, None], actual.shape)

        def loss(p: np.ndarray, mask: np.ndarray) -> np.ndarray:
            return (np.broadcast_to(p, actual.shape)[mask] - target[mask]) ** 2

        def brier(p: np.ndarray, mask: np.ndarray) -> float:
            return float(np.mean(loss(p, mask)))

        series = np.broadcast_to(np.arange(actual.shape[0])[:, None, None], actual.shape)

        stacked_cv = np.full(actual.shape, np.nan)
        for f in (0, 1):
            held = known & (fold == f)
            stack = SegmentedStack().fit(features, target, segment, known & (fold != f))
            stacked_cv[held] = stack.predict(features[held], segment[held])
        candidates = {name: estimates[name] for name in SOURCES}
        if np.isfinite(stacked_cv[known]).all():
            candidates["stacked"] = stacked_cv
        self.scores_ = {name: brier(p, known) for name, p in candidates.items()}
        # per activity segment and horizon band: the candidate with the lowest cross-fitted Brier score there; a
        # cell with too few events on the tail to tell the candidates apart keeps the hazard
        band = np.broadcast_to(horizon_band(actual.shape[2])[None, None, :], actual.shape)
        self.segment_methods_, self.segment_scores_ = {}, {}
        for seg in range(len(SEGMENT_EDGES) + 1):
            for b in range(len(HORIZON_BAND_EDGES) + 1):
                mine = known & (segment == seg) & (band == b)
                if not mine.any():
                    continue
                scores = {name: brier(p, mine) for name, p in candidates.items()}
                enough = int(target[mine].sum()) >= SegmentedStack.min_events
                self.segment_scores_[(seg, b)] = scores
                best = min(scores, key=scores.get) if enough else "hazard"
                if best != "hazard" and not clearly_lower(
                        loss(candidates[best], mine), loss(candidates["hazard"], mine), series[mine]):
                    best = "hazard"  # not better than the hazard beyond the spread between series
                self.segment_methods_[(seg, b)] = best
        chosen = self._choose(candidates, segment, band, np.full(actual.shape, np.nan))
        self.scores_["per_segment"] = brier(chosen, known)
        self.method_ = "per_segment"
        # never worse than the best single estimate on the tail: the cells that keep the hazard for want of a
        # clear win can add up to a worse score than one estimate everywhere (few series, a weak hazard)
        single = min(candidates, key=self.scores_.get)
        cells = "; per (activity segment, horizon band): " + ", ".join(
            f"{k}={v}" for k, v in self.segment_methods_.items())
        if self.scores_[single] < self.scores_["per_segment"]:
            self.method_, self.segment_methods_ = single, {}
            cells = f"; {single} everywhere (the per-cell choice scores worse on the tail)"
        if self.method_ == "stacked" or "stacked" in self.segment_methods_.values():
            self.stack_ = SegmentedStack().fit(features, target, segment, known)
        say("ensemble: p_any on the validation tail (Brier, cross-fitted): "
            + ", ".join(f"{k} {v:.4f}" for k, v in self.scores_.items()) + cells)
        return self

    def _choose(self, candidates: dict, segment: np.ndarray, band: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out`` with each (segment, horizon band) cell taken from its chosen candidate (``candidates[name]`` or
        a callable giving it for a mask)."""
        bands = len(HORIZON_BAND_EDGES) + 1
        cell = segment * bands + band
        for (seg, b), name in self.segment_methods_.items():
            mine = cell == seg * bands + b
            if mine.any():
                value = candidates[name]
                out[mine] = value(mine) if callable(value) else np.broadcast_to(value, out.shape)[mine]
        return out

    def predict(self, values: np.ndarray, origins: Sequence[int], point: np.ndarray,
                p_resid: np.ndarray) -> np.ndarray:
        """``(N, O, h)`` p_any by the method chosen for each point's activity segment and horizon band (the hazard
        in cells without a choice)."""
        if self.method_ == "residuals":
            return p_resid
        estimates = self.estimates(values, origins, point, p_resid)
        segment = segment_of(estimates["long"])
        band = np.broadcast_to(horizon_band(point.shape[2])[None, None, :], point.shape)
        out = np.array(estimates["hazard"], dtype=np.float64)
        if self.method_ != "per_segment" or not hasattr(self, "segment_methods_"):  # one method everywhere
            if self.method_ != "stacked":
                return np.array(np.broadcast_to(estimates[self.method_], out.shape), dtype=np.float64)
            features = self.design(estimates)
            return self.stack_.predict(features.reshape(-1, features.shape[-1]), segment.ravel()).reshape(out.shape)
        candidates: dict = {name: estimates[name] for name in SOURCES}
        stacked_cells = [cell for cell, name in self.segment_methods_.items() if name == "stacked"]
        if stacked_cells:
            # the regression's inputs only where a cell takes the stack (the rarely invoked segment, 53 % of the
            # series of a 5,000-series shard of the fleet, keeps the hazard)
            bands = len(HORIZON_BAND_EDGES) + 1
            stacked = np.isin(segment * bands + band, [seg * bands + b for seg, b in stacked_cells])
            features = self.design(estimates, stacked)
            candidates["stacked"] = lambda mine: self.stack_.predict(features[mine[stacked]], segment[mine])
        return self._choose(candidates, segment, band, out)


#: Standard errors by which a candidate's cross-fitted Brier score must beat the hazard's in a cell to replace it.
CLEAR_MARGIN_SE = 2.0


def clearly_lower(loss: np.ndarray, base: np.ndarray, series: np.ndarray, margin_se: float | None = None) -> bool:
    """Whether the per-point ``loss`` is lower than ``base`` by more than ``margin_se`` standard errors, with the
    series as the unit: the paired difference is averaged per series, and its mean over series compared with the
    standard error of that mean.

    Points of one series are not independent draws (neighbouring origins forecast the same target steps), so a
    per-point standard error would call a difference that a handful of series carry significant; a plain
    comparison of the two scores calls any difference a win. On the Azure day (1,350 functions, the fit at minute
    960 on minutes 0..959) the plain comparison replaced the hazard in the rarely invoked segment at horizons 4-10
    by the recent share, 0.008746 against 0.008826 (1 % lower; neither depends on the members), whose floor of
    0.5 / 61 puts ``p_any`` above 0.003 on 79 % of that segment's idle minutes (the hazard: 33 %); at the planner's rate-normalised cold costs that
    held and restarted hundreds of dormant models (the fleet replay of minutes 960..1320 fetched 86.7 TB of
    weights for 744 models; a diagnosis of the replay, not the basis of the margin, which is the usual two
    standard errors). With the series as the unit the recent share's gain there is within two standard errors,
    and the cell keeps the hazard.
    """
    diff = np.asarray(loss, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    if not len(diff):
        return False
    codes, index = np.unique(np.asarray(series), return_inverse=True)
    if len(codes) < 2:
        return False
    per_series = np.bincount(index, weights=diff) / np.bincount(index)
    mean = float(per_series.mean())
    se = float(per_series.std(ddof=1) / np.sqrt(len(per_series)))
    return mean < -(CLEAR_MARGIN_SE if margin_se is None else margin_se) * se


#: Edges of the activity segments (long-run share of invoked steps) that get a regression of their own.
SEGMENT_EDGES = (0.02, 0.1, 0.3, 0.7)


#: Horizon bands (steps ahead: 1, 2-3, 4-10, 11-30, beyond) that get a choice of their own: the hazard is sharp a
#: step or two ahead and loses its edge further out, where the point forecast's view may win.
HORIZON_BAND_EDGES = (1, 3, 10, 30)


def horizon_band(h: int) -> np.ndarray:
    """Band of each horizon ``1 .. h``."""
    return np.searchsorted(np.asarray(HORIZON_BAND_EDGES), np.arange(1, h + 1), side="left")


def segment_of(long_share: np.ndarray) -> np.ndarray:
    """Activity segment of each point (0 = rarely invoked .. 4 = nearly always)."""
    return np.searchsorted(np.asarray(SEGMENT_EDGES), np.asarray(long_share), side="right")


class SegmentedStack:
    """Per activity segment, the hazard corrected by a penalised logistic regression on the other sources.

    ``p = sigmoid(logit(hazard) + b + x . w)``: the idle-time hazard is the
    offset, and each segment learns an intercept and weights on the other
    sources (standardised) with an L2 penalty of ``penalty`` (in units of
    validation points). A rarely invoked segment, with a handful of events on
    the validation tail, thus stays close to the hazard, whose small
    probabilities for dormant series are what keeps a planner from holding
    them; a busy segment, with thousands of events, learns how much the
    point forecast's residuals and the recent share add. (A plain regression
    per segment, measured on the Azure day's first 300 functions fitted on
    minutes 0..239, gave the dormant segment a flat p_any of about 0.0025 on
    idle minutes where the hazard gives about 0: a planner weighing rare
    functions' cold starts heavily then held them all day.)
    """

    penalty = 200.0
    min_events = 500

    def fit(self, features: np.ndarray, target: np.ndarray, segment: np.ndarray, mask: np.ndarray
            ) -> "SegmentedStack":
        flat_x = features.reshape(-1, features.shape[-1])
        flat_y = target.ravel().astype(np.float64)
        flat_s = segment.ravel()
        rows = np.flatnonzero(mask.ravel())
        if len(rows) > MAX_POINTS:
            rows = np.sort(np.random.default_rng(0).choice(rows, MAX_POINTS, replace=False))
        self.mean_ = flat_x[rows, 1:].mean(axis=0)
        self.std_ = flat_x[rows, 1:].std(axis=0) + 1e-9
        self.by_segment_ = {}
        self.events_: dict[int, int] = {}
        for seg in np.unique(flat_s[rows]):
            mine = rows[flat_s[rows] == seg]
            self.events_[int(seg)] = int(flat_y[mine].sum())
            if self.events_[int(seg)] < self.min_events:
                continue  # too little evidence to correct the hazard
            self.by_segment_[int(seg)] = _offset_logistic(self._inputs(flat_x[mine]), flat_x[mine, 0],
                                                          flat_y[mine], self.penalty)
        return self

    def _inputs(self, x: np.ndarray) -> np.ndarray:
        return np.column_stack([np.ones(len(x)), (x[:, 1:] - self.mean_) / self.std_])

    def predict(self, features: np.ndarray, segment: np.ndarray) -> np.ndarray:
        out = np.empty(len(features))
        for seg in np.unique(segment):
            rows = segment == seg
            weights = self.by_segment_.get(int(seg))
            eta = features[rows, 0] + (0.0 if weights is None else self._inputs(features[rows]) @ weights)
            out[rows] = _sigmoid(eta)
        return out


def _sigmoid(eta: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(eta, -40.0, 40.0)))


def _offset_logistic(x: np.ndarray, offset: np.ndarray, y: np.ndarray, penalty: float,
                     iterations: int = 30) -> np.ndarray:
    """Weights of ``sigmoid(offset + x w)`` by Newton's method on the log loss plus ``penalty / 2 * |w|^2``.

    Each Newton step is damped by backtracking (halved until the penalised loss falls by at least ``1e-4`` of
    what the step's slope promises, Armijo's rule). A full step can overshoot where the offset or the inputs are
    extreme: there ``p (1 - p)`` is near 0, the Hessian is little more than the penalty, and the step is as large
    as the gradient. On the Azure day's fit at minute 600 (validation origins 360..540, one half of them held out)
    the rarely invoked segment's undamped weights reached -183 standardised units, and its cross-fitted Brier
    score was 0.298 against the hazard's 0.014, so the stack scored 0.116 on the whole tail against the
    hazard's 0.048; damped, it scores 0.0357 there. The loss is convex, so the damped iteration goes to the one
    minimum the undamped one aimed at.
    """
    w = np.zeros(x.shape[1])

    def penalised_loss(v: np.ndarray) -> tuple[float, np.ndarray]:
        eta = offset + x @ v
        return float(np.sum(np.logaddexp(0.0, eta) - y * eta) + 0.5 * penalty * (v @ v)), eta

    loss, eta = penalised_loss(w)
    for _ in range(iterations):
        p = _sigmoid(eta)  # eta of the accepted w: one matrix product per trial, none again here
        grad = x.T @ (p - y) + penalty * w
        hess = (x * (p * (1 - p))[:, None]).T @ x + penalty * np.eye(x.shape[1])
        step = np.linalg.solve(hess, grad)
        slope = float(grad @ step)  # > 0: the Hessian is positive definite
        t = 1.0
        while True:
            trial, trial_eta = penalised_loss(w - t * step)
            if trial <= loss - 1e-4 * t * slope or t < 1e-10:
                break
            t *= 0.5
        w = w - t * step
        loss, eta = trial, trial_eta
        if np.max(np.abs(t * step)) < 1e-6:
            break
    return w
