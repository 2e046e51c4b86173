"""The ensemble: per-series weights from validation errors, conformal quantiles, probability of any invocation.

Fitting (``Ensemble.fit``), on a fit window of ``T`` steps:

1. every member is fitted on the first ``T - V`` steps (``V`` = validation tail);
2. each forecasts the tail from rolling origins (every ``stride`` steps,
   horizons ``1..horizon``), conditioning on the data before each origin with
   its parameters fixed, as in the backtest;
3. per series, all weight goes to one member: the one with the lowest
   :func:`shrunk_scores` on that tail (``weighting="shrunk"``, the default, with
   ``shrinkage=20``: its relative validation MAE shrunk towards its activity
   segment's), or the one with the lowest MAE (``weighting="best"``, the default
   before 2026-12-04); or member ``m`` gets weight ``1 / MAE_m^power``
   (``weighting="inverse_error"``; weights under :data:`MIN_RELATIVE_WEIGHT` of
   the series' largest are 0). The choice was made by nested validation inside
   the fit window (``bench/accuracy.py --select``: on the Azure day an inner fit
   on steps 0..863 of the 1,080-step fit window and 14 inner origins; lowest
   inner wQL over all series among the candidates that meet issue 13's
   calibration targets on the inner busy series), on all 1,350 Azure series and
   on Huawei DC4: inner wQL on the Azure day 0.3086 against 0.3213 for
   ``best``, median MASE over active series 0.6165 against 0.6164; on Huawei
   every figure the same as ``best``'s. Inverse-error weights scored a lower
   wQL (power 8: 0.3072 on Azure, 0.1680 on Huawei) but missed the calibration
   (inner busy q0.99 coverage 0.977 on Azure, bracket [0.865, 0.865] on
   Huawei), and a first run that took them lost the busy q0.99 target on the
   test origins too (0.962; issue 13's note). Per-series medians are not
   improved by averaging medians of differently biased members, and a mix is
   slower to forecast: every member runs for every series. On a tie (common: an
   all-zero tail) the fallback wins;
4. the weighted forecasts' residuals on the tail give, per series and horizon,
   an empirical residual distribution (split conformal): ``q_tau = point +
   Q_tau(residuals)`` clipped at 0; ``P(point + residual >= 0.5)`` is the
   residual estimate of ``p_any``, the probability of at least one invocation
   in the step (step 7 turns it into the ``p_any`` output);
5. quantile heads (``quantile_heads``; on by default when a LightGBM member is
   in the ensemble): one global LightGBM per outer level (q0.1, q0.9) with the
   quantile objective on the LightGBM member's features, fitted on the same
   split. Each head's validation forecasts are conformalised per series and
   horizon (conformalised quantile regression: ``q_tau = head_tau +
   Q_tau(actual - head_tau)``). Whether a series' bounds come from step 4 or
   from the heads is decided per series on the validation tail alone: each
   option learns its offsets on the odd validation origins and is scored
   (pinball loss) on the even ones and vice versa (``head_series_``,
   ``quantile_method_``, ``quantile_scores_``). The heads condition on what
   residual quantiles cannot see (recent volatility, time since the last
   invocation, the target's phase), so bounds widen where bursts are likely
   and narrow elsewhere; series forecast exactly (timers) or idle keep their
   residual bounds, and only the series that use a head pay for its forecast
   (a head below the median only where the point forecast is above 0, since
   the bound is 0 wherever the point is; the heads and the tree members build
   their feature rows once between them at forecast time);
6. with ``refit=True`` the members (and the chosen heads) are refitted on the
   whole window (weights and quantile offsets stay those of steps 3-5);
7. ``p_any`` (``p_any="stacked"``, the default with the fallback): the residual
   estimate, an idle-time hazard, the recent and long-run shares of invoked
   steps and the point forecast read as a Poisson mean, combined by a logistic
   regression per activity segment on the validation tail, or the single one of
   them that scores better there (cross-fitted Brier score on contiguous
   halves of the validation origins; :mod:`forecaster.forecast.p_any`).

A member that raises in fit or forecast is reported in ``failures_`` and
skipped; the ``Fallback`` member always remains, and a series with fewer than
``min_history`` known steps uses the fallback alone. A series without enough
validation residuals gets Poisson quantiles around the point forecast.
A member (or quantile head) that raises at forecast time leaves its series to
the other members: each forecast call lists that call's failures in
``forecast_failures_`` (member -> series affected, error text) and logs each
at WARNING, at most once an hour per member and shard for the same error
(:data:`member_failure_log`); a shard's caller logs its shard's failures itself
(:func:`failures_reported_by_caller`).

Output columns: ``ensemble`` (the point forecast, equal to ``q0.5``), one
``q<level>`` per requested quantile (default ``q0.1``, ``q0.5``, ``q0.9``,
``q0.95``, ``q0.99``, named by :func:`forecaster.contracts.forecast.quantile_column`),
``p_any``, and with ``members=True`` each member's point forecast under its own name.

Levels beyond q0.9 (issue 11): with the default retrain's 16 validation
origins one (series, horizon) cell holds 16 residuals, and the split-conformal
q0.95 and q0.99 of 16 residuals are both their largest, which covers only
16/17 of new points. Such levels pool neighbouring horizons until there are
enough residuals (:func:`pool_horizons`; q0.9 and q0.1 are unchanged), series
on the quantile heads conformalise them on the nearest head (``head_levels``),
and the upper levels are sorted so that q0.9 <= q0.95 <= q0.99.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import itertools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import numpy as np
import pandas as pd

from forecaster.contracts.forecast import FORECAST_LEVELS, quantile_column
from forecaster.forecast.members import Fallback, Member, actuals
from forecaster.forecast.panel import Panel, forecast_frame
from forecaster.settings import MEMBER_FAMILIES, member_families

T = TypeVar("T")

log = logging.getLogger(__name__)


class FailureLog:
    """WARNINGs of failures at forecast time, rate-limited per ``(where, what)``: the forecast job runs every minute,
    and a member that fails on every run must not write a line a minute.

    The first failure of a ``(where, what)`` is logged at once, and so is a different error text; the same error
    again is logged once ``interval_s`` has passed, with the number of runs it failed in meanwhile.
    """

    def __init__(self, interval_s: float = 3600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[tuple[str, str], tuple[float, str, int]] = {}  # -> (logged at, error, repeats since)
        self._lock = threading.Lock()

    def warn(self, where: str, what: str, error: str, series: int, *, action: str = "forecast without it") -> bool:
        """Log that ``what`` (a member, a head, a shard) failed for ``series`` series; False when rate-limited."""
        now = self.clock()
        with self._lock:
            logged_at, last_error, repeats = self._last.get((where, what), (None, None, 0))
            if logged_at is not None and error == last_error and now - logged_at < self.interval_s:
                self._last[(where, what)] = (logged_at, last_error, repeats + 1)
                return False
            self._last[(where, what)] = (now, error, 0)
        again = f" (failed {repeats} more time(s) since the last warning)" if repeats else ""
        log.warning("%s%s failed at forecast time for %d series, %s: %s%s", f"{where}: " if where else "", what,
                    series, action, error, again)
        return True

    def clear(self) -> None:
        with self._lock:
            self._last.clear()


#: The process's log of forecast-time failures (members, heads, whole shards).
member_failure_log = FailureLog()

_reported_by_caller: contextvars.ContextVar[bool] = contextvars.ContextVar("member_failures_reported_by_caller",
                                                                           default=False)


@contextlib.contextmanager
def failures_reported_by_caller() -> Iterator[None]:
    """Within it, :meth:`Ensemble.forecast` records its failures without logging them: a shard's ensemble runs in a
    worker, whose log may go nowhere, and its caller (:class:`~forecaster.forecast.sharded.ShardedEnsemble`)
    logs them in the scheduler, with the shard's name."""
    token = _reported_by_caller.set(True)
    try:
        yield
    finally:
        _reported_by_caller.reset(token)


#: Quantile levels kept per series and horizon: 20 equal-probability points
#: (0.025, 0.075, ..., 0.975) that describe the residual distribution for ``p_any``.
GRID = (np.arange(20) + 0.5) / 20


def default_members(horizon: int = 60, *, n_jobs: int = 1, device: str | None = None,
                    families: Sequence[str] = MEMBER_FAMILIES) -> list[Member]:
    """Members of the model families of issue 3 with their measured defaults (fallback added by the ensemble).

    ``families`` keeps only those (:data:`MEMBER_FAMILIES`: all five by default; ``PREWARM_FORECAST_MEMBERS``),
    in that order."""
    from forecaster.forecast.arima import ARIMAMember
    from forecaster.forecast.lstm import LSTMMember
    from forecaster.forecast.trees import LightGBMMember, RandomForestMember, XGBoostMember

    make = {
        "lightgbm": lambda: LightGBMMember(horizon=horizon, n_jobs=n_jobs),
        "xgboost": lambda: XGBoostMember(horizon=horizon, n_jobs=n_jobs),
        "random_forest": lambda: RandomForestMember(horizon=horizon, n_jobs=n_jobs),
        "arima": lambda: ARIMAMember(),
        "lstm": lambda: LSTMMember(horizon=horizon, n_jobs=n_jobs, device=device),
    }
    return [make[f]() for f in member_families(families)]


def conformal_rank(tau: float, n: int) -> int:
    """Split-conformal order statistic (1-based) for ``n`` residuals at level ``tau``.

    ``ceil((n+1) tau)`` above the median (capped at ``n``), ``floor((n+1) tau)``
    below it (at least 1): the bound then covers a new point with probability
    at least ``tau`` (at most ``tau`` below) when residuals are exchangeable.
    """
    position = (n + 1) * tau
    if tau >= 0.5:
        return int(min(n, max(1, np.ceil(position - 1e-9))))
    return int(max(1, min(n, np.floor(position + 1e-9))))


def needed_residuals(tau: float) -> int:
    """Fewest residuals whose split-conformal bound at level ``tau`` is not simply the extreme one.

    ``ceil((n + 1) tau) <= n`` needs ``n >= tau / (1 - tau)`` above the median
    (9 at 0.9, 19 at 0.95, 99 at 0.99), ``n >= (1 - tau) / tau`` below it. With
    fewer, the bound is the largest residual, which covers a new point with
    probability only ``n / (n + 1)`` (0.94 for 16 residuals), not ``tau``.
    """
    ratio = tau / (1.0 - tau) if tau >= 0.5 else (1.0 - tau) / tau
    return int(np.ceil(ratio - 1e-9))


def pool_horizons(residuals: np.ndarray, tau: float) -> np.ndarray:
    """Residuals ``(N, H, K)`` -> ``(N, H, K * w)``: each horizon with its ``w - 1`` nearest, enough for ``tau``.

    The window width ``w`` (odd, in horizons) is the smallest with
    ``w * K >= needed_residuals(tau)``, ``K`` = validation origins; it is
    shifted inward at the first and last horizons so that every horizon pools
    the same number. With 16 validation origins (the Azure day's default
    retrain) q0.9 pools nothing (``w = 1``), q0.95 three horizons, q0.99 seven.
    Neighbouring horizons' errors are nearly exchangeable at minute steps (the
    spread grows slowly with the horizon), so this trades a little horizon
    resolution for a bound that is calibrated at all.
    """
    n, h, k = residuals.shape
    width = 1
    while width * k < needed_residuals(tau) and width < h:
        width += 2
    width = min(width, h)  # all horizons when the window would not fit
    if width <= 1:
        return residuals
    first = np.clip(np.arange(h) - width // 2, 0, max(h - width, 0))
    columns = np.minimum(first[:, None] + np.arange(width)[None, :], h - 1)  # (H, w)
    return residuals[:, columns, :].reshape(n, h, -1)


def residual_quantiles(
    residuals: np.ndarray, levels: Sequence[float], min_count: int, *, conformal: bool = True, pool: bool = False
) -> np.ndarray:
    """Per-row quantiles of residuals ``(N, H, K)`` (NaN = missing) -> ``(N, H, len(levels))``.

    Args:
        residuals: actual minus point forecast, per series, horizon and origin.
        levels: quantile levels.
        min_count: rows with fewer residuals get NaN.
        conformal: use :func:`conformal_rank`; ``False`` uses the plain
            empirical quantile (order statistic ``ceil(n tau)``), which is what
            describes the residual distribution for ``p_any``.
        pool: for a level that needs more residuals than one (series, horizon)
            cell holds (:func:`needed_residuals`), pool neighbouring horizons
            (:func:`pool_horizons`); levels that need no pooling are unchanged.
    """
    n, h, _ = residuals.shape
    out = np.full((n, h, len(levels)), np.nan)
    plain = None
    for j, tau in enumerate(levels):
        values = pool_horizons(residuals, tau) if pool else residuals
        if values is residuals:
            if plain is None:
                plain = ((~np.isnan(residuals)).sum(axis=2), np.sort(residuals, axis=2))  # NaN sort last
            count, ordered = plain
        else:
            count, ordered = (~np.isnan(values)).sum(axis=2), np.sort(values, axis=2)
        for k in np.unique(count[count >= min_count]):
            rows = count == k
            rank = conformal_rank(tau, int(k)) if conformal else int(min(k, max(1, np.ceil(k * tau - 1e-9))))
            out[rows, j] = ordered[rows][:, rank - 1]
    return out


def poisson_quantile(mean: np.ndarray, tau: float) -> np.ndarray:
    """Quantile ``tau`` of a Poisson count with the given mean (vectorised)."""
    from scipy.stats import poisson

    mean = np.clip(np.nan_to_num(np.asarray(mean, dtype=np.float64), nan=0.0), 0.0, 1e9)
    return poisson.ppf(tau, np.maximum(mean, 1e-12))


class Ensemble:
    """Weighted members plus calibrated quantiles; follows the member contract.

    Args:
        members: the members to combine (unfitted; deep-copied). ``None`` uses
            :func:`default_members` of ``families``. The fallback is always added.
        families: with ``members=None``, the member families to build (default all of
            :data:`~forecaster.settings.MEMBER_FAMILIES`; ``PREWARM_FORECAST_MEMBERS``).
        horizon: horizons ``1..horizon`` the weights and quantiles are learned for;
            longer requests reuse the last horizon's quantiles.
        quantiles: levels of the quantile columns; default
            :data:`~forecaster.contracts.forecast.FORECAST_LEVELS` (0.1, 0.5,
            0.9, 0.95, 0.99), the levels the forecast job stores and the
            planner sizes with. Levels that need more validation residuals
            than one (series, horizon) cell holds pool neighbouring horizons
            (:func:`pool_horizons`), so q0.95 and q0.99 are calibrated rather
            than "the largest of 16 residuals". Upper levels are sorted
            across levels after the heads are applied (monotone
            rearrangement: never a worse quantile estimate, and q0.9 <=
            q0.95 <= q0.99 always holds).
        validation_steps: the tail ``V``; ``None`` = ``min(max(4 * horizon, T // 5), T // 2)``.
        stride: steps between validation origins; ``None`` = ``max(1, horizon // 5)``.
        weighting: ``"shrunk"`` (default), ``"best"`` or ``"inverse_error"``; ``"shrunk"`` is the best member
            per series by :func:`shrunk_scores`: its own relative validation
            error shrunk towards its activity segment's, so that a series with
            little evidence on the tail takes the member that does best on
            series like it.
        shrinkage: pseudo-observations (invoked validation steps) of the
            segment's errors in ``"shrunk"``.
        power: exponent of the inverse error.
        refit: refit members on the whole window after validation.
        min_history: series with fewer known steps in the fit window use the fallback alone.
        min_residuals: series with fewer validation residuals per horizon get Poisson quantiles.
        fallback: add the :class:`Fallback` member (the member of last resort).
            ``False`` turns a one-member ensemble into "this member with
            conformal intervals" (how the peers get their empirical intervals);
            the last member is then the one of last resort and may not fail.
        interval_scale: ``"sqrt"`` divides residuals by ``sqrt(point + 1)``
            before taking their quantiles and multiplies back at forecast time
            (normalised conformal scores: intervals widen when the forecast
            level is high, as Poisson-like counts do); ``"none"`` (default) uses
            plain residuals. On the ``--select`` inner validation (with
            ``weighting="best"``) sqrt read wQL 0.3201 against 0.3213 on
            the Azure day and 0.1718 against 0.1709 on Huawei DC4, so it
            stays off (not measured on top of ``"shrunk"``).
        quantile_heads: ``None`` (default): fit quantile heads when a
            :class:`~forecaster.forecast.trees.LightGBMMember` is among the
            members, with its settings; ``True``: always (default LightGBM
            settings unless a LightGBM member is present); ``False``: never; a
            ``LightGBMMember``: always, with its settings. The bench peers
            (one simple member, ``fallback=False``) thus keep plain empirical
            intervals. Chosen on the fit windows' validation tails
            (cross-fitted pinball loss per point, q0.1 + q0.9; residuals /
            heads / heads with the empirical quantile / per-series choice):
            Azure day 0.1383 / 0.1372 / 0.1294 / 0.1232 (heads on 20% of the
            series), Huawei 186.7 / 163.3 / 163.2 / 163.2. On the test origins
            (``bench/accuracy.py``, before protocol v2; for the record only,
            the choice itself is the validation figure above; residual
            quantiles only -> with heads):
            Azure all wQL 0.333 -> 0.310, spike recall 0.516 -> 0.549,
            coverage 0.982 -> 0.981; busy wQL 0.296 -> 0.276, recall 0.593 ->
            0.627, coverage 0.944 -> 0.938; Huawei wQL 0.145 -> 0.128, recall
            0.685 -> 0.691, coverage 0.889 -> 0.915. Cost on 2 shared cores:
            retrain 155 -> 271 s, 60-minute forecasts for 10,000 series 2.7 ->
            5.9 s. Heads for every series instead of the per-series choice
            scored Azure all wQL 0.300 but took 17.7 s for the 10,000 series.
        head_levels: levels that get a quantile head of their own (default
            0.1 and 0.9, the measured configuration above). Any other
            requested level of a series that uses the heads is conformalised
            on the head nearest to it on the same side of the median
            (q0.95 and q0.99 = head q0.9 + the conformal 0.95 / 0.99 quantile
            of ``actual - head_q0.9``, per series and horizon): it keeps the
            head's view of where bursts are likely without two more
            LightGBM fits per retrain.
        p_any: how ``p_any`` is made (see :mod:`forecaster.forecast.p_any`):
            ``"stacked"`` (a logistic combination of the residual
            distribution, an idle-time hazard, the recent and the long-run
            share of invoked steps and the point forecast, fitted on the
            validation tail and kept only if it beats each of them there,
            cross-fitted); ``"residuals"`` (the residual distribution alone, as
            before issue 13). ``None`` (default): ``"stacked"`` for an
            ensemble with the fallback, ``"residuals"`` for a one-member
            calibration wrapper (``fallback=False``, how the bench peers get
            their intervals).
        p_any_lookback: steps before an origin the hazard and the long-run
            share read (bounds a forecast's cost whatever the history's length).
        fit_threads: members (and then quantile heads, then refits) fitted at once, each on a thread of its own.
            The members share nothing while they fit and each keeps its own one-thread estimator, so the fitted
            ensemble is the same number for number whatever this is (``tests/test_forecast_ensemble.py``); what
            changes is the wall time, where the libraries release the GIL (the tree members, torch). 1 (default):
            one after another, as the nightly retrain on a busy machine wants; ``prewarm report`` fits with 2
            while its other processes wait for the forecasts (:mod:`forecaster.report.replay`).
        progress: called with one line per stage (defaults to ``logging.info``).
    """

    name = "ensemble"

    def __init__(
        self,
        members: Sequence[Member] | None = None,
        *,
        families: Sequence[str] = MEMBER_FAMILIES,
        horizon: int = 60,
        quantiles: Sequence[float] = FORECAST_LEVELS,
        validation_steps: int | None = None,
        stride: int | None = None,
        weighting: str = "shrunk",
        power: float = 1.0,
        shrinkage: float = 20.0,
        refit: bool = True,
        min_history: int = 30,
        min_residuals: int = 10,
        fallback: bool = True,
        interval_scale: str = "none",
        quantile_heads: bool | Member | None = None,
        head_levels: Sequence[float] = (0.1, 0.9),
        p_any: str | None = None,
        p_any_lookback: int = 1440,
        fit_threads: int = 1,
        progress: Callable[[str], None] | None = None,
    ):
        self.members = members
        self.families = member_families(families)
        self.horizon = horizon
        self.quantiles = tuple(quantiles)
        self.validation_steps = validation_steps
        self.stride = stride
        self.weighting = weighting
        self.power = power
        self.shrinkage = float(shrinkage)
        self.refit = refit
        self.min_history = min_history
        self.min_residuals = min_residuals
        self.fallback = fallback
        self.interval_scale = interval_scale
        self.quantile_heads = quantile_heads
        self.head_levels = tuple(head_levels)
        self.p_any = p_any
        self.p_any_lookback = int(p_any_lookback)
        self.fit_threads = int(fit_threads)
        self.progress = progress

    # ------------------------------------------------------------------ fit
    def fit(self, df: pd.DataFrame) -> Ensemble:
        """Fit on the long frame ``unique_id, ds, y`` (the whole fit window)."""
        return self.fit_panel(Panel.from_long(df))

    def fit_panel(self, panel: Panel) -> Ensemble:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}")
        say = self.progress or log.info
        h = self.horizon
        tail = self.validation_steps or min(max(4 * h, panel.n_steps // 5), panel.n_steps // 2)
        stride = self.stride or max(1, h // 5)
        first = panel.n_steps - tail
        origins = list(range(first, panel.n_steps - h + 1, stride)) or [first]
        train = panel.head(first)
        if self.members is None:  # (a model pickled before ``families`` existed had all five)
            candidates = default_members(h, families=getattr(self, "families", MEMBER_FAMILIES))
        else:
            candidates = [copy.deepcopy(m) for m in self.members]
        if self.fallback:
            candidates.append(Fallback(horizon=h))
        if not candidates:
            raise ValueError("an ensemble without fallback needs at least one member")

        self.failures_: dict[str, str] = {}
        self.fit_seconds_: dict[str, float] = {}
        threads = getattr(self, "fit_threads", 1)  # (a model pickled before the setting existed)

        def fit_and_validate(member: Member, what: str) -> Callable[[], np.ndarray]:
            def task() -> np.ndarray:
                say(f"ensemble: {what}: fit on {first} steps, validate on {len(origins)} origins")
                member.fit_panel(train)
                return member.forecast(panel, origins, h)
            return task

        fitted: list[Member] = []
        forecasts: list[np.ndarray] = []
        done = run_each([fit_and_validate(m, f"member {k + 1}/{len(candidates)} {m.name}")
                         for k, m in enumerate(candidates)], threads)
        for k, (member, (forecast, error, seconds)) in enumerate(zip(candidates, done, strict=True)):
            if error is not None:  # reported and skipped; the fallback remains
                if isinstance(member, Fallback) or (k == len(candidates) - 1 and not fitted):
                    raise error  # the member of last resort failing is a bug, not a data problem
                self.failures_[member.name] = f"{type(error).__name__}: {error}"
                say(f"ensemble: member {member.name} failed and is skipped: {self.failures_[member.name]}")
                continue
            self.fit_seconds_[member.name] = seconds
            fitted.append(member)
            forecasts.append(forecast)

        heads: dict[float, Member] = {}
        head_forecasts: dict[float, np.ndarray] = {}
        unfitted_heads = self._heads(candidates)
        done = run_each([fit_and_validate(head, f"quantile head {head.name}") for head in unfitted_heads.values()],
                        threads)
        for (tau, head), (forecast, error, seconds) in zip(unfitted_heads.items(), done, strict=True):
            if error is not None:  # reported; the residual quantiles remain
                self.failures_[head.name] = f"{type(error).__name__}: {error}"
                say(f"ensemble: quantile head {head.name} failed and is skipped: {self.failures_[head.name]}")
                continue
            self.fit_seconds_[head.name] = seconds
            head_forecasts[tau] = forecast
            heads[tau] = head

        actual = actuals(panel.values, origins, h)  # (N, O, h)
        stacked = np.stack(forecasts, axis=0)  # (M, N, O, h)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mae = np.nanmean(np.abs(stacked - actual[None]), axis=(2, 3)).T  # (N, M)
        self.member_names_ = [m.name for m in fitted]
        self.validation_mae_ = mae
        self.weights_ = self._weights(mae, panel, actual)
        point = _combine(stacked, self.weights_)
        self._calibrate(point, actual, stacked, origins)
        self._calibrate_heads(point, actual, head_forecasts)
        self.validation_origins_ = origins
        self._fit_p_any(panel, first, point, actual, origins)

        if self.refit:
            refits = [(k, m, fitted) for k, m in enumerate(fitted)]
            if self.quantile_method_ != "residuals":
                head_list = list(heads.values())
                refits += [(k, m, head_list) for k, m in enumerate(head_list)]
            previous: dict[int, Member] = {}  # the version fitted on the shorter window, while its refit runs

            def refit(position: int, member: Member) -> Callable[[], None]:
                def task() -> None:
                    say(f"ensemble: refit {member.name} on {panel.n_steps} steps")
                    previous[position] = copy.deepcopy(member)
                    member.fit_panel(panel)
                    del previous[position]
                return task

            done = run_each([refit(j, member) for j, (_, member, _) in enumerate(refits)], threads)
            for j, ((k, member, owner), (_, error, seconds)) in enumerate(zip(refits, done, strict=True)):
                if error is not None:  # keep the version fitted on the shorter window
                    self.failures_[f"{member.name} (refit)"] = f"{type(error).__name__}: {error}"
                    owner[k] = previous.pop(j)
                self.fit_seconds_[member.name] += seconds
            heads = dict(zip(heads, head_list, strict=True)) if self.quantile_method_ != "residuals" else heads
        self.heads_ = heads if self.quantile_method_ != "residuals" else {}
        self.members_ = fitted
        self.panel_ = panel
        self.step_ = panel.step
        return self

    def _fit_p_any(self, panel: Panel, first: int, point: np.ndarray, actual: np.ndarray,
                   origins: list[int]) -> None:
        """Fit the ``p_any`` model on the validation tail (see ``p_any`` and :mod:`forecaster.forecast.p_any`)."""
        from forecaster.forecast.p_any import PAnyModel, p_any_folds

        method = self.p_any or ("stacked" if self.fallback else "residuals")
        model = PAnyModel(method=method, lookback=self.p_any_lookback)
        if method == "residuals":
            self.p_any_model_ = model
            return
        fold = p_any_folds(len(origins))
        spread = self._spread(point)
        p_resid = np.full(point.shape, np.nan)
        for f in (0, 1):  # the residual p_any of one fold's origins from the other fold's residuals
            residuals = np.where((fold == f)[None, :, None], (actual - point) / spread, np.nan).transpose(0, 2, 1)
            grid = residual_quantiles(residuals, GRID, max(2, self.min_residuals // 2), conformal=False)
            mine = residual_p_any(point, spread, np.broadcast_to(grid[:, None], (*point.shape, len(GRID))))
            p_resid[:, fold != f] = mine[:, fold != f]
        self.p_any_model_ = model.fit(panel.values, first, origins, point, p_resid, actual,
                                      say=self.progress or log.info)

    def _calibrate(self, point: np.ndarray, actual: np.ndarray, stacked: np.ndarray, origins: list[int]) -> None:
        """Residual quantiles from the validation forecasts ``(N, O, h)`` (and each member's ``(M, N, O, h)``)."""
        residuals = ((actual - point) / self._spread(point)).transpose(0, 2, 1)  # (N, h, O)
        levels = tuple(sorted(set(self.quantiles) | {0.1, 0.9}))
        self.levels_ = levels
        self.offsets_ = residual_quantiles(residuals, levels, self.min_residuals, pool=True)  # (N, h, L)
        self.grid_ = residual_quantiles(residuals, GRID, self.min_residuals, conformal=False)  # (N, h, 20)
        # per member q0.1 / q0.9 offsets, so that each member can be scored on its own
        self.member_offsets_ = {
            name: residual_quantiles(
                ((actual - stacked[j]) / self._spread(stacked[j])).transpose(0, 2, 1), (0.1, 0.9), self.min_residuals
            )
            for j, name in enumerate(self.member_names_)
        }

    def _heads(self, candidates: Sequence[Member]) -> dict[float, Member]:
        """Unfitted quantile heads, one per requested level other than the median (see ``quantile_heads``)."""
        from forecaster.forecast.trees import LightGBMMember

        if isinstance(self.quantile_heads, LightGBMMember):
            template = self.quantile_heads
        else:
            template = next((m for m in candidates if isinstance(m, LightGBMMember)), None)
            if not (template is not None if self.quantile_heads is None else self.quantile_heads):
                return {}
            template = template or LightGBMMember(horizon=self.horizon)
        return {tau: template.quantile_head(tau) for tau in self.head_levels if tau in self.quantiles and tau != 0.5}

    def _head_base(self, tau: float, heads: Sequence[float]) -> float | None:
        """The head level a quantile at ``tau`` is conformalised on: its own, else the nearest on the same side."""
        side = [t for t in heads if (t > 0.5) == (tau > 0.5)]
        return min(side, key=lambda t: abs(t - tau)) if side else None

    def _calibrate_heads(self, point: np.ndarray, actual: np.ndarray, head_forecasts: dict[float, np.ndarray]) -> None:
        """Per series, residual quantiles or conformalised heads, whichever had the lower validation pinball loss.

        Candidates: ``"residuals"`` (split-conformal residuals of the point
        forecast, per series and horizon), ``"heads"`` (each head's forecast plus
        the conformal quantile of ``actual - head`` per series and horizon, i.e.
        conformalised quantile regression) and ``"heads_empirical"`` (the same
        with the plain empirical quantile of those corrections). Each is scored
        on the validation tail with offsets learned on the odd origins and
        scored on the even ones and vice versa (pinball loss summed over the
        head levels). Per series the heads are used where they score strictly
        lower than the residuals (``head_series_``); of the two head variants,
        the one with the lower total over all series after that choice wins
        (``quantile_method_``; ``quantile_scores_`` keeps the mean loss per
        point of each option alone and of the choice).
        """
        from forecaster.forecast.backtest import pinball

        self.quantile_scores_: dict[str, float] = {}
        self.head_offsets_: dict[float, np.ndarray] = {}
        self.head_series_ = np.zeros(point.shape[0], dtype=bool)
        self.head_base_: dict[float, float] = {}
        self.quantile_method_ = "residuals"
        expected = {t for t in self.head_levels if t in self.quantiles and t != 0.5}
        if not head_forecasts or set(head_forecasts) != expected:
            return
        known = ~np.isnan(actual)
        observed = np.where(known, actual, 0.0)
        points = max(1, int(known.sum()))
        spread = self._spread(point)
        options = {
            "residuals": (None, True), "heads": (head_forecasts, True), "heads_empirical": (head_forecasts, False),
        }
        per_series = {}
        for method, (bases, conformal) in options.items():
            loss = np.zeros(point.shape[0])
            for tau in head_forecasts:
                base, scale = (point, spread) if bases is None else (bases[tau], np.ones_like(point))
                bound = _crossfit_bound(base, scale, actual, point, tau, self.min_residuals, conformal)
                loss += np.where(known, pinball(observed, bound, tau), 0.0).sum(axis=(1, 2))
            per_series[method] = loss
            self.quantile_scores_[method] = float(loss.sum() / points)
        chosen = {m: np.minimum(per_series["residuals"], per_series[m]) for m in ("heads", "heads_empirical")}
        method = min(chosen, key=lambda m: chosen[m].sum())
        self.quantile_scores_["per_series_choice"] = float(chosen[method].sum() / points)
        self.head_series_ = per_series[method] < per_series["residuals"]
        if not self.head_series_.any():
            return
        self.quantile_method_ = method
        for tau in self.quantiles:
            base = self._head_base(tau, list(head_forecasts)) if tau != 0.5 else None
            if base is None:
                continue  # no head on this side of the median: the residual quantiles stand
            residuals = (actual - head_forecasts[base]).transpose(0, 2, 1)
            offsets = residual_quantiles(residuals, (tau,), self.min_residuals, conformal=method == "heads",
                                         pool=True)
            offsets[~self.head_series_] = np.nan  # these series keep their residual quantiles
            self.head_offsets_[tau] = offsets
            self.head_base_[tau] = base

    def _weights(self, mae: np.ndarray, panel: Panel, actual: np.ndarray | None = None) -> np.ndarray:
        """Per-series weights ``(N, M)`` from validation MAE (NaN = member not available)."""
        n, m = mae.shape
        available = np.isfinite(mae)
        fallback = m - 1
        available[:, fallback] = True
        safe = np.where(available, np.nan_to_num(mae, nan=0.0), np.inf)
        if self.weighting == "shrunk":
            safe = shrunk_scores(safe, panel.values, actual, self.shrinkage)
        if self.weighting in ("best", "shrunk"):
            best = np.argmin(safe, axis=1)
            # on a tie (all-zero validation tails are common) the simplest member wins
            tie = safe[:, fallback] <= safe[np.arange(n), best] * (1 + 1e-9) + 1e-12
            best[tie] = fallback
            weights = np.zeros((n, m))
            weights[np.arange(n), best] = 1.0
        else:
            typical = np.where(np.isfinite(safe), safe, np.nan)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                eps = 1e-3 * np.nan_to_num(np.nanmean(typical, axis=1), nan=0.0) + 1e-9
            weights = np.where(available, 1.0 / (safe + eps[:, None]) ** self.power, 0.0)
            # a member far worse than the series' best keeps no weight at all: with a high power its weight is
            # ~1e-24 and would still lift an exact forecast of 0 (a timer's idle steps) to ~1e-27, which reads as
            # "above zero" wherever a quantile is compared with an observed 0
            weights[weights < MIN_RELATIVE_WEIGHT * weights.max(axis=1, keepdims=True)] = 0.0
        known_steps = (~np.isnan(panel.values)).sum(axis=1)
        too_new = known_steps < self.min_history
        weights[too_new] = 0.0
        weights[too_new, fallback] = 1.0
        weights /= weights.sum(axis=1, keepdims=True)
        return weights

    # ------------------------------------------------------------------ forecast
    def forecast(
        self, panel: Panel, origins: Sequence[int], h: int, *, members: bool = False
    ) -> dict[str, np.ndarray]:
        """Arrays ``(N, len(origins), h)`` per output column (see the module docstring).

        With ``members=True`` also each member's point forecast and its own
        conformal q0.1 / q0.9 (``<name>``, ``<name>-q0.1``, ``<name>-q0.9``).
        """
        if not hasattr(self, "members_"):
            raise RuntimeError("Ensemble is not fitted; call fit() first")
        from forecaster.forecast.trees import SharedFeatures

        origins = list(origins)
        position = self._positions(panel)
        weights = self._weights_for(panel, position)
        # the tree members and heads build their feature rows once per series between them
        shared = SharedFeatures(panel, origins, h) if SharedFeatures.fits(panel.n_series, len(origins), h) else None
        outputs = []
        self.forecast_seconds_: dict[str, float] = {}
        #: This call's failures (member or head -> series affected, error text); ``failures_`` keeps every one seen.
        self.forecast_failures_: dict[str, dict] = {}
        for j, member in enumerate(self.members_):
            started = time.perf_counter()
            # only the series that give this member weight (with "best" weighting, each
            # series needs one member), unless every member's forecast is asked for
            rows = np.ones(panel.n_series, dtype=bool) if members else weights[:, j] > 0
            if j == len(self.members_) - 1:
                rows = np.ones(panel.n_series, dtype=bool)  # the member of last resort covers gaps
            output = np.full((panel.n_series, len(origins), h), np.nan)
            try:
                if rows.any():
                    output[rows] = _forecast_rows(member, panel, rows, origins, h, shared)
                self.forecast_seconds_[member.name] = time.perf_counter() - started
            except Exception as error:  # a member failing at forecast time is skipped too
                if member is self.members_[-1]:
                    raise
                self.failures_[f"{member.name} (forecast)"] = f"{type(error).__name__}: {error}"
                self.forecast_failures_[member.name] = {"series": int((weights[:, j] > 0).sum()),
                                                        "error": f"{type(error).__name__}: {error}"}
            outputs.append(output)
        stacked = np.stack(outputs, axis=0)
        point = _combine(stacked, weights)
        result = {self.name: point}
        offsets = self._per_series(panel, self.offsets_, position)  # (N, H, L)
        grid = self._per_series(panel, self.grid_, position)
        offsets, grid = _extend(offsets, h), _extend(grid, h)
        head_cache: dict[float, tuple[np.ndarray, np.ndarray] | None] = {}
        bounds: dict[float, np.ndarray] = {}
        for j, tau in enumerate(self.levels_):
            if tau not in self.quantiles:
                continue
            if tau == 0.5:
                bounds[tau] = point
                continue
            shifted = point + self._spread(point) * offsets[:, None, :, j]
            bound = np.maximum(point, shifted) if tau > 0.5 else np.minimum(point, shifted)
            missing = np.isnan(bound)
            if missing.any():  # scipy's ppf is slow: only where there are no residual quantiles
                bound[missing] = poisson_quantile(np.broadcast_to(point, bound.shape)[missing], tau)
            if tau in getattr(self, "head_offsets_", {}) and getattr(self, "heads_", {}):
                bound = self._head_bound(panel, origins, h, tau, point, bound, head_cache, position=position,
                                         shared=shared)
            bounds[tau] = np.clip(bound, 0.0, None)
        # monotone rearrangement outward from the median (each bound already lies on its side of the point):
        # sorting quantile estimates never makes them worse (Chernozhukov, Fernandez-Val and Galichon, 2010)
        for side in ([t for t in bounds if t > 0.5], [t for t in bounds if t < 0.5]):
            outward = sorted(side, key=lambda t: abs(t - 0.5))
            for inner, outer in itertools.pairwise(outward):
                bounds[outer] = (np.maximum if outer > 0.5 else np.minimum)(bounds[outer], bounds[inner])
        for tau in sorted(bounds):
            result[quantile_column(tau)] = bounds[tau]
        p_resid = residual_p_any(point, self._spread(point), np.broadcast_to(grid[:, None], (*point.shape, grid.shape[-1])))
        p_any_model = getattr(self, "p_any_model_", None)  # models saved before issue 13 have none
        result["p_any"] = p_resid if p_any_model is None else p_any_model.predict(panel.values, origins, point, p_resid)
        if members:
            for j, member in enumerate(self.members_):
                own = _extend(self._per_series(panel, self.member_offsets_[member.name], position), h)
                result[member.name] = stacked[j]
                spread = self._spread(stacked[j])
                result[f"{member.name}-q0.1"] = _bounded(stacked[j], spread * own[:, None, :, 0], 0.1)
                result[f"{member.name}-q0.9"] = _bounded(stacked[j], spread * own[:, None, :, 1], 0.9)
        if not _reported_by_caller.get():
            for name, failure in self.forecast_failures_.items():
                member_failure_log.warn("", name, failure["error"], failure["series"])
        return result

    def predict(self, h: int, history: pd.DataFrame | None = None, *, members: bool = False) -> pd.DataFrame:
        """Forecast ``h`` steps after the end of ``history`` (default: the fit window), no refit.

        Returns:
            ``unique_id, ds, ensemble``, one ``q<level>`` per quantile, ``p_any`` (plus member columns).
        """
        if not hasattr(self, "members_"):
            raise RuntimeError("Ensemble is not fitted; call fit() first")
        panel = self.panel_ if history is None else Panel.from_long(history, step=self.step_)
        arrays = self.forecast(panel, [panel.n_steps], h, members=members)
        return forecast_frame(panel, panel.n_steps, {k: v[:, 0, :] for k, v in arrays.items()})

    # ------------------------------------------------------------------ helpers
    def _head_bound(self, panel: Panel, origins: list[int], h: int, tau: float, point: np.ndarray,
                    residual_bound: np.ndarray, cache: dict | None = None, *, position: np.ndarray | None = None,
                    shared=None) -> np.ndarray:
        """Conformalised head forecast for level ``tau``; the residual bound where the head has no offset or fails.

        ``cache`` (head level -> (rows, forecast) or None) lets the levels that
        share a head (q0.9, q0.95, q0.99 on the q0.9 head) forecast it once;
        ``position`` is :meth:`_positions` of ``panel`` and ``shared`` the
        tree members' :class:`~forecaster.forecast.trees.SharedFeatures`, if any.

        A bound below the median is ``min(point, head + offset)``, clipped at 0
        by the caller: where the point forecast is 0 that is 0 whatever the head
        says, so a head below the median forecasts only the cells where the
        point is above 0 (in a 5,000-series shard of the production ensemble,
        42 % of the q0.1 head's cells), and the bound there is the point itself,
        which is the same number after the clip.
        """
        base = getattr(self, "head_base_", {}).get(tau, tau)
        head = self.heads_[base]
        offset = _extend(self._per_series(panel, self.head_offsets_[tau], position), h)[:, None, :, 0]  # (N, 1, h)
        rows = ~np.isnan(offset).all(axis=(1, 2))  # series that use the head (unseen ones never do)
        if not rows.any():
            return residual_bound
        cache = {} if cache is None else cache
        if base not in cache:
            # forecast the head once for every series that uses the heads (a superset of ``rows``)
            head_series = self._per_series(panel, self.head_series_[:, None].astype(np.float64), position)
            users = rows | (head_series[:, 0] == 1.0)
            cells = ~(point <= 0) if base < 0.5 else None  # below the median: only where the point is above 0
            started = time.perf_counter()
            try:
                full = np.full((panel.n_series, len(origins), h), np.nan)
                full[users] = _forecast_rows(head, panel, users, origins, h, shared, cells)
                cache[base] = full
                self.forecast_seconds_[head.name] = time.perf_counter() - started
            except Exception as error:  # the residual quantiles stand in
                self.failures_[f"{head.name} (forecast)"] = f"{type(error).__name__}: {error}"
                failures = getattr(self, "forecast_failures_", None)
                if failures is not None:
                    failures[head.name] = {"series": int(users.sum()), "error": f"{type(error).__name__}: {error}"}
                cache[base] = None
        if cache[base] is None:
            return residual_bound
        forecast = cache[base][rows]
        shifted = forecast + offset[rows]
        bound = residual_bound.copy()
        if tau > 0.5:
            mine = np.maximum(point[rows], shifted)
        else:  # where the point is 0 (the cells the head skipped) the clipped bound is the point
            zero = (point[rows] <= 0) & ~np.isnan(offset[rows])
            mine = np.where(zero, point[rows], np.minimum(point[rows], shifted))
        bound[rows] = np.where(np.isnan(mine), residual_bound[rows], mine)
        return bound

    def _spread(self, point: np.ndarray) -> np.ndarray:
        """Residual normaliser: ``sqrt(point + 1)`` (Poisson-like spread) or 1 (plain residuals)."""
        if self.interval_scale == "sqrt":
            return np.sqrt(np.clip(np.nan_to_num(point, nan=0.0), 0.0, None) + 1.0)
        return np.ones_like(point)

    def _weights_for(self, panel: Panel, position: np.ndarray | None = None) -> np.ndarray:
        """Fitted weights on ``panel``'s rows; unseen series use the fallback alone."""
        position = self._positions(panel) if position is None else position
        weights = np.zeros((panel.n_series, len(self.members_)))
        weights[:, -1] = 1.0
        known = position >= 0
        weights[known] = self.weights_[position[known]]
        return weights

    def _positions(self, panel: Panel) -> np.ndarray:
        """Row of the fit window's panel of each of ``panel``'s series (-1: not seen in the fit window)."""
        return pd.Index(self.panel_.ids).get_indexer(panel.ids)

    def _per_series(self, panel: Panel, table: np.ndarray, position: np.ndarray | None = None) -> np.ndarray:
        """Rows of the fitted per-series ``table`` for ``panel``'s series, float64; NaN for series not seen in the fit.

        ``position`` is :meth:`_positions` of ``panel`` (computed when not given).
        When ``panel`` holds the fitted series in their order (a shard forecasting
        its own series), the result is a read-only view of ``table`` rather than
        a copy: the grid of residual quantiles alone is 48 MB for 5,000 series.
        """
        position = self._positions(panel) if position is None else position
        table = np.asarray(table, dtype=np.float64)
        if len(position) == len(table) and np.array_equal(position, np.arange(len(table))):
            view = table.view()
            view.flags.writeable = False
            return view
        known = position >= 0
        if not known.any():
            return np.full((panel.n_series, *table.shape[1:]), np.nan)
        out = table[np.where(known, position, 0)]
        out[~known] = np.nan
        return out


def run_each(tasks: Sequence[Callable[[], T]], threads: int = 1) -> list[tuple[T | None, Exception | None, float]]:
    """Run every task, one after another or up to ``threads`` at once on threads of their own, and return each
    one's ``(result, exception, wall seconds)`` in the order given: a task that raises does not stop the others."""

    def timed(task: Callable[[], T]) -> tuple[T | None, Exception | None, float]:
        started = time.perf_counter()
        try:
            return task(), None, time.perf_counter() - started
        except Exception as error:  # noqa: BLE001 - handed back to the caller, who reports or raises it
            return None, error, time.perf_counter() - started

    if threads <= 1 or len(tasks) <= 1:
        return [timed(task) for task in tasks]
    from concurrent.futures import ThreadPoolExecutor

    # Python's warning filters are one list for all threads: a member's ``catch_warnings`` that ends while another
    # member is inside its own puts back the list as it was when it began, undoing the other's "ignore". The
    # warnings the members silence when alone (RuntimeWarning of empty slices, and all of statsmodels' in the ARIMA
    # fits) are silenced here for the whole threaded fit, so a threaded fit prints what a sequential one prints;
    # warnings do not change any number
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.filterwarnings("ignore", module=r"statsmodels(\.|$)")
        with ThreadPoolExecutor(max_workers=min(threads, len(tasks)), thread_name_prefix="ensemble-fit") as pool:
            return list(pool.map(timed, tasks))


def _forecast_rows(member: Member, panel: Panel, rows: np.ndarray, origins: list[int], h: int, shared,
                   cells: np.ndarray | None = None) -> np.ndarray:
    """``member``'s forecast ``(rows.sum(), O, h)`` of the series ``rows`` (bool) of ``panel``.

    A direct tree member reads the feature rows it shares with the others from ``shared``
    (:class:`~forecaster.forecast.trees.SharedFeatures`, ``None``: not shared) and, with ``cells`` (bool
    ``(N, O, h)``), forecasts only those cells (NaN elsewhere); any other member forecasts a panel of those rows,
    every cell.
    """
    if shared is not None and getattr(member, "strategy", None) == "direct" and hasattr(member, "forecast_shared"):
        return member.forecast_shared(shared, np.flatnonzero(rows), None if cells is None else cells[rows])
    sub = panel if rows.all() else Panel(panel.ids[rows], panel.start, panel.step, panel.values[rows])
    return member.forecast(sub, origins, h)


def _combine(stacked: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted mean over members ``(M, N, O, h)`` with weights ``(N, M)``, renormalised where a member is NaN."""
    w = weights.T[:, :, None, None] * ~np.isnan(stacked)
    total = w.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        combined = (np.nan_to_num(stacked) * w).sum(axis=0) / total
    # the fallback (last member) is always finite: it covers rows whose weighted members all failed
    return np.where(total > 0, combined, stacked[-1])


WEIGHTINGS = ("best", "inverse_error", "shrunk")
#: Inverse-error weights below this share of a series' largest are set to 0 (with power 8: members whose
#: validation MAE is more than 5.6 times the best's).
MIN_RELATIVE_WEIGHT = 1e-6
#: Values (points x quantiles) per block of :func:`residual_p_any`: 1 MB buffers.
RESIDUAL_BLOCK_VALUES = 131_072


def shrunk_scores(mae: np.ndarray, values: np.ndarray, actual: np.ndarray | None, shrinkage: float) -> np.ndarray:
    """Per series and member, validation error relative to the series' typical member, shrunk to its segment's.

    ``rel[i, m] = MAE[i, m] / mean_m MAE[i, m]``; the segment of a series is its
    activity (share of invoked steps in the fit window, the bins of
    :data:`~forecaster.forecast.p_any.SEGMENT_EDGES`); the score is
    ``(e_i rel[i, m] + k pooled[seg_i, m]) / (e_i + k)`` with ``e_i`` the
    series' invoked validation steps and ``pooled`` the segment's mean of
    ``rel``. On a tail where a sparse series is invoked twice, its own ranking
    of the members is mostly noise; the segment's is not. ``inf`` (a member
    not available) stays ``inf``.
    """
    from forecaster.forecast.p_any import segment_of

    finite = np.isfinite(mae)
    with np.errstate(invalid="ignore", divide="ignore"):
        typical = np.nanmean(np.where(finite, mae, np.nan), axis=1, keepdims=True)
        rel = np.where(finite, mae / np.where(typical > 0, typical, 1.0), np.nan)
    invoked = np.nan_to_num(values, nan=0.0) > 0
    segment = segment_of(invoked.mean(axis=1) if values.shape[1] else np.zeros(len(values)))
    pooled = np.full_like(rel, np.nan)
    for seg in np.unique(segment):
        rows = segment == seg
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            pooled[rows] = np.nanmean(rel[rows], axis=0)
    evidence = np.zeros(len(mae)) if actual is None else (np.nan_to_num(actual, nan=0.0) > 0).sum(axis=(1, 2))
    score = (evidence[:, None] * np.nan_to_num(rel, nan=0.0) + shrinkage * np.nan_to_num(pooled, nan=0.0)) / (
        evidence[:, None] + shrinkage)
    return np.where(finite, score, np.inf)


def residual_p_any(point: np.ndarray, spread: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """P(point + residual >= 0.5) from residual quantiles ``grid`` (``point.shape + (G,)``); Poisson where none.

    Computed a block of series at a time in two reused buffers of :data:`RESIDUAL_BLOCK_VALUES` values: for a
    whole 5,000-series shard (60 horizons, 20 quantiles) each temporary array would be 48 MB, fresh pages in a
    Dask worker (0.075 s against 0.047 s there, 0.06 against 0.04 s in a plain process). The same operations on
    the same values, so the same numbers.
    """
    p_any = np.empty(point.shape)
    block = max(1, RESIDUAL_BLOCK_VALUES // max(1, int(np.prod(grid.shape[1:]))))
    shifted = np.empty((min(block, len(point)), *grid.shape[1:]))
    above = np.empty(shifted.shape, dtype=bool)
    with np.errstate(invalid="ignore"):
        for lo in range(0, len(point), block):
            part = slice(lo, lo + block)
            rows = len(point[part])
            np.multiply(spread[part][..., None], grid[part], out=shifted[:rows])
            np.add(point[part][..., None], shifted[:rows], out=shifted[:rows])
            np.greater_equal(shifted[:rows], 0.5, out=above[:rows])
            p_any[part] = np.mean(above[:rows], axis=-1)
    missing = np.isnan(grid[..., 0]) | np.isnan(point)
    p_any[missing] = (1.0 - np.exp(-np.nan_to_num(point[missing], nan=0.0)))
    return p_any


def _extend(table: np.ndarray, h: int) -> np.ndarray:
    """``(N, H, L)`` -> ``(N, h, L)``: horizons beyond ``H`` reuse the last one."""
    if table.shape[1] >= h:
        return table[:, :h]
    return np.concatenate([table, np.repeat(table[:, -1:], h - table.shape[1], axis=1)], axis=1)


def _crossfit_bound(base, scale, actual, point, tau: float, min_count: int, conformal: bool) -> np.ndarray:
    """Validation bounds ``(N, O, h)`` at level ``tau``, offsets learned on the other half of the origins.

    Origins alternate between two folds; the offsets of ``(actual - base) / scale``
    (per series and horizon) from one fold bound the other fold's points. A
    row without enough residuals in its fold gets the Poisson quantile, as at
    forecast time.
    """
    fold = np.arange(actual.shape[1]) % 2
    out = np.full(actual.shape, np.nan)
    for f in (0, 1):
        residuals = np.where((fold == f)[None, :, None], (actual - base) / scale, np.nan).transpose(0, 2, 1)
        offset = residual_quantiles(residuals, (tau,), max(2, min_count // 2), conformal=conformal)[..., 0]
        shifted = base + scale * offset[:, None, :]
        bound = np.maximum(point, shifted) if tau > 0.5 else np.minimum(point, shifted)
        out[:, fold != f] = bound[:, fold != f]
    missing = np.isnan(out)
    out[missing] = poisson_quantile(point[missing], tau)
    return np.clip(out, 0.0, None)


def _bounded(point: np.ndarray, offset: np.ndarray, tau: float) -> np.ndarray:
    shifted = point + offset
    bound = np.maximum(point, shifted) if tau > 0.5 else np.minimum(point, shifted)
    missing = np.isnan(bound) & ~np.isnan(point)
    bound[missing] = poisson_quantile(point[missing], tau)
    return np.clip(bound, 0.0, None)
