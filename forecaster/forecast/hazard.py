"""Idle-time hazards: the probability of any invocation in each coming step, from the gaps between invocations.

For a sparse series the count in a step matters less than whether there is one
at all: a replica held warm for a model that is not called is waste, one missing
when it is called is a cold start. An invocation process is described here by
its *idle times* (steps from one invoked step to the next) and their hazard:
``h(a) = P(invoked at age a | not invoked since the last one, a steps ago)``.

* Per series, the empirical hazard ``#{IT = a} / #{IT >= a}`` over its own
  idle times (bins of one step up to ``max_age``, a geometric tail beyond),
  shrunk towards a pooled hazard of all series in the same (activity, age)
  bin with ``prior_weight`` pseudo-observations. Periodic timers get a sharp
  hazard at their period, bursty series a decreasing one, series never seen
  the pooled rate of their bin.
* The probability of at least one invocation ``k`` steps ahead chains the
  hazard from the current age through the renewal equation
  (:func:`renewal_p_any`).

Two users share these functions: the planner's causal
:class:`~forecaster.planning.forecasts.EmpiricalForecast` (incremental state,
all history) and the ensemble's ``p_any`` (:class:`IdleTimeHazard`: the
per-series idle times and the pooled table are re-read at every origin from the
last ``lookback`` steps, so the cost of a forecast does not grow with the stored
history and the pool follows the fleet as the empirical source's does).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Age given to a series with no invocation in the window read: beyond every age bin, in fit and forecast alike.
NEVER_AGE = 10**6
#: Activity bins (invoked steps seen: 0, 1, 2-3, ...) x age bins (half octaves of steps since the last one).
N_ACTIVITY_BINS = 20
N_AGE_BINS = 26


def age_bin(age: np.ndarray) -> np.ndarray:
    """Half-octave bins of steps since the last invocation (1, 1.4, 2, 2.8, ... capped)."""
    return np.minimum(np.floor(np.log2(np.maximum(age, 1)) * 2).astype(np.int64), N_AGE_BINS - 1)


def activity_bin(active_steps: np.ndarray) -> np.ndarray:
    """Bins of how many invoked steps a series has had (0, 1, 2-3, ...)."""
    return np.minimum(np.floor(np.log2(np.asarray(active_steps) + 1) * 1.5).astype(np.int64), N_ACTIVITY_BINS - 1)


def empty_pool() -> tuple[np.ndarray, np.ndarray]:
    """Pooled (events, exposure) tables with a weak prior of 0.1 events per unit of exposure."""
    return np.full((N_ACTIVITY_BINS, N_AGE_BINS), 0.1), np.ones((N_ACTIVITY_BINS, N_AGE_BINS))


def hazard(
    hist: np.ndarray,
    excess: np.ndarray,
    active: np.ndarray,
    ages: np.ndarray,
    pooled: np.ndarray,
    *,
    max_age: int,
    prior_weight: float,
) -> np.ndarray:
    """Per series ``h(age)``: own idle-time hazard shrunk to the pooled one; ``ages`` is ``(N,)`` or ``(N, K)``.

    Args:
        hist: ``(N, max_age + 2)`` idle-time counts; column ``a`` = idle times of
            ``a`` steps, column ``max_age + 1`` = the longer ones.
        excess: ``(N,)`` sum over the longer idle times of ``IT - max_age``.
        active: ``(N,)`` invoked steps seen (selects the pooled activity bin).
        ages: steps since the last invocation at each step asked for.
        pooled: ``(N_ACTIVITY_BINS, N_AGE_BINS)`` pooled hazard.
    """
    ages = np.asarray(ages)
    two_d = ages.ndim == 2
    a2 = ages if two_d else ages[:, None]
    h0 = pooled[activity_bin(active)[:, None], age_bin(a2)]
    survival = np.cumsum(hist[:, ::-1], axis=1)[:, ::-1]
    idx = np.minimum(np.maximum(a2, 1), max_age + 1)
    rows = np.arange(len(hist))[:, None]
    num = hist[rows, idx]
    den = survival[rows, idx]
    h = (num + prior_weight * h0) / (den + prior_weight)
    # beyond the histogram's range: geometric tail fitted to the overflow idle times (MLE n / sum of excess)
    n_over = hist[:, max_age + 1][:, None]
    tail = (n_over + prior_weight * h0) / (excess[:, None] + prior_weight / np.maximum(h0, 1e-6))
    h = np.where(a2 > max_age, tail, h)
    return h if two_d else h[:, 0]


def renewal_p_any(hazard_at, age0: np.ndarray, active: np.ndarray, horizon: int) -> np.ndarray:
    """``(N, horizon)`` P(at least one invocation) in each of the next ``horizon`` steps.

    ``hazard_at(ages, active)`` is the hazard (:func:`hazard` with the state
    bound). Step ``k`` (0-based) is the first event with probability
    ``f(k) = h(a+k) prod_{j<k} (1 - h(a+j))`` from the current age ``a``; after
    an event the chain restarts at age 1 (renewal):
    ``u(k) = f(k) + sum_{j<k} u(j) g(k-j)``, ``g`` the idle-time distribution
    after an event.
    """
    n = len(age0)
    k = np.arange(horizon)
    h_now = hazard_at(age0[:, None] + k[None, :], active)
    survive = np.cumprod(np.concatenate([np.ones((n, 1)), 1 - h_now[:, :-1]], axis=1), axis=1)
    first = h_now * survive
    if horizon == 1:
        return first
    h_new = hazard_at(np.tile(k[None, :] + 1, (n, 1)), active + 1)
    s_new = np.cumprod(np.concatenate([np.ones((n, 1)), 1 - h_new[:, :-1]], axis=1), axis=1)
    g = h_new * s_new  # g[:, d-1] = P(next event d steps after an event)
    u = np.zeros_like(first)
    u[:, 0] = first[:, 0]
    for step in range(1, horizon):
        u[:, step] = first[:, step] + (u[:, :step] * g[:, step - 1::-1]).sum(axis=1)
    return np.clip(u, 0.0, 1.0)


def idle_time_state(invoked: np.ndarray, max_age: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """From a boolean ``(N, W)`` window: idle-time histogram, overflow excess, active steps, last invoked column.

    Vectorised over the invoked cells (cost grows with the number of invoked
    steps in the window, not with the window's width). ``last`` is -1 for a
    series with no invocation in the window. Counts are binned with
    ``np.bincount`` (integer counts: the same numbers as adding one at a time,
    several times faster than ``np.add.at``).
    """
    n = invoked.shape[0]
    rows, cols = np.nonzero(invoked)  # row-major: sorted by row, then column
    bins = max_age + 2
    excess = np.zeros(n)
    same = rows[1:] == rows[:-1]
    gaps = (cols[1:] - cols[:-1])[same]
    gap_rows = rows[1:][same]
    hist = np.bincount(gap_rows * bins + np.minimum(gaps, max_age + 1), minlength=n * bins).reshape(n, bins)
    hist = hist.astype(np.float64)
    over = gaps > max_age
    if over.any():
        excess += np.bincount(gap_rows[over], weights=(gaps[over] - max_age).astype(np.float64), minlength=n)
    active = np.bincount(rows, minlength=n).astype(np.float64)
    last = np.full(n, -1, dtype=np.int64)
    if len(rows):
        ends = np.flatnonzero(np.append(rows[1:] != rows[:-1], True))  # each row's last invoked cell
        last[rows[ends]] = cols[ends]
    return hist, excess, active, last


def carry_forward(events: np.ndarray, exposure: np.ndarray, min_exposure: float = 10.0) -> np.ndarray:
    """Pooled hazard ``events / exposure`` where a cell was seen, else its nearest seen neighbour's.

    A fit window of ``T`` steps never sees ages beyond ``T`` (nor activity
    beyond its busiest series), yet forecasts look such cells up; the weak
    prior of :func:`empty_pool` alone would give them a hazard of 0.1 per step.
    Unseen ages take the last seen age's hazard of the same activity bin;
    activity bins never seen take the nearest lower seen bin's row (else the
    nearest higher one's, else the window's overall rate).
    """
    rate = events / exposure
    seen = exposure - 1.0 >= min_exposure  # empty_pool's one unit of exposure is the prior
    out = rate.copy()
    overall = float(events.sum() / exposure.sum())
    for a in range(out.shape[0]):
        last = None
        for g in range(out.shape[1]):
            if seen[a, g]:
                last = rate[a, g]
            elif last is not None:
                out[a, g] = last
    row_seen = seen.any(axis=1)
    for a in np.flatnonzero(row_seen):  # ages before a seen row's first seen one take that one's hazard
        first = int(np.argmax(seen[a]))
        out[a, :first] = rate[a, first]
    for a in np.flatnonzero(~row_seen):
        lower = [b for b in range(a) if row_seen[b]]
        higher = [b for b in range(a + 1, out.shape[0]) if row_seen[b]]
        source = lower[-1] if lower else (higher[0] if higher else None)
        out[a] = overall if source is None else out[source]
    return out


def pool_counts(values: np.ndarray, lookback: int, *, stride: int = 1, chunk_rows: int = 512
                ) -> tuple[np.ndarray, np.ndarray]:
    """Pooled (events, exposure) per (activity, age) cell over the steps of ``values`` ``(N, T)``.

    Every step is one exposure in the cell of its series' activity (invoked
    steps in the ``lookback`` before it, within ``values``) and age (steps since
    its last invoked step; never seen = :data:`NEVER_AGE`), and an event if the
    step is invoked (NaN = unknown = not invoked): the cells :func:`hazard` looks up.
    With ``stride`` > 1 only every ``stride``-th step (counted back from the
    last) is an exposure, a sample that leaves each cell's rate unbiased and
    divides the cost of the binning by ``stride``.
    """
    events, exposure = empty_pool()
    width = values.shape[1]
    if not width:
        return events, exposure
    steps = np.arange(width, dtype=np.int32)
    sample = steps[::-1][::max(1, int(stride))][::-1]
    before = np.maximum(sample - 1, 0)
    back = np.maximum(sample - lookback, 0)
    size = N_ACTIVITY_BINS * N_AGE_BINS
    for lo in range(0, values.shape[0], chunk_rows):
        invoked = values[lo:lo + chunk_rows] > 0  # NaN compares False: unknown = not invoked
        last_incl = np.maximum.accumulate(np.where(invoked, steps, -1), axis=1)
        cum = np.cumsum(invoked, axis=1, dtype=np.int32)  # invoked steps in 0..t
        first = sample == 0
        last_before = np.where(first, -1, last_incl[:, before])
        cum_before = np.where(first, 0, cum[:, before])  # invoked steps before each sampled step
        cum_back = np.where(back > 0, cum[:, np.maximum(back - 1, 0)], 0)  # ... before its lookback window
        active = cum_before - cum_back
        age = np.where(last_before >= 0, sample - last_before, NEVER_AGE)
        cell = (activity_bin(active) * N_AGE_BINS + age_bin(age)).ravel()
        exposure += np.bincount(cell, minlength=size).reshape(exposure.shape)
        events += np.bincount(cell, weights=invoked[:, sample].ravel().astype(np.float64),
                              minlength=size).reshape(events.shape)
    return events, exposure


class WindowPool:
    """:func:`pool_counts` (stride 1) of many windows ``values[:, lo:origin]`` of one panel, without redoing the
    running counts per window.

    For a window starting at column ``lo`` every step ``t`` in it has ``C[t] - C[lo]`` invoked steps before it in
    the window (``C`` = invoked steps before ``t`` in the whole panel) and age ``t - L[t]`` when its last invoked
    step before it, ``L[t]``, lies in the window (else :data:`NEVER_AGE`): the cells :func:`pool_counts` bins,
    from running counts made once. The bins come from tables built with :func:`activity_bin` and
    :func:`age_bin` themselves, and rows are binned in the same chunks, so the tables are those
    :func:`pool_counts` gives (``tests/test_forecast_hazard.py`` compares them).
    """

    def __init__(self, values: np.ndarray, lookback: int, chunk_rows: int = 512):
        self.invoked = values > 0  # NaN compares False: unknown = not invoked
        n, t = self.invoked.shape
        self.lookback = int(lookback)
        self.chunk_rows = int(chunk_rows)
        self.before = np.zeros((n, t + 1), dtype=np.int32)  # invoked steps in columns 0..t-1
        np.cumsum(self.invoked, axis=1, dtype=np.int32, out=self.before[:, 1:])
        steps = np.arange(t, dtype=np.int32)
        last_incl = np.maximum.accumulate(np.where(self.invoked, steps, -1), axis=1)
        self.last_before = np.concatenate([np.full((n, 1), -1, dtype=np.int32), last_incl[:, :-1]], axis=1)
        self.steps = steps
        # an active count is at most the window's width; ``t - L[t]`` at most ``t + 1`` (L = -1: none before t)
        self.activity_table = (activity_bin(np.arange(min(t, self.lookback) + 1)) * N_AGE_BINS).astype(np.int32)
        self.age_table = age_bin(np.arange(t + 2)).astype(np.int32)
        self.never_bin = int(age_bin(np.array([NEVER_AGE]))[0])

    def idle_state(self, lo: int, origin: int, max_age: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``idle_time_state(values[:, lo:origin] > 0, max_age)`` from the panel's invoked cells, found once.

        An idle time lies in the window when both invoked steps that bound it do (``lo <= previous``,
        ``next < origin``); the counts are integers, so binning them in any order gives the same numbers.
        """
        if not hasattr(self, "_pairs"):
            rows, cols = (index.astype(np.int32) for index in np.nonzero(self.invoked))
            same = rows[1:] == rows[:-1]
            self._pairs = (rows[1:][same], cols[:-1][same], cols[1:][same])  # row, previous, next invoked column
        n = self.invoked.shape[0]
        bins = max_age + 2
        rows, previous, following = self._pairs
        inside = (previous >= lo) & (following < origin)
        gap_rows, gaps = rows[inside].astype(np.int64), (following - previous)[inside].astype(np.int64)
        hist = np.bincount(gap_rows * bins + np.minimum(gaps, max_age + 1), minlength=n * bins).reshape(n, bins)
        excess = np.zeros(n)
        over = gaps > max_age
        if over.any():
            excess += np.bincount(gap_rows[over], weights=(gaps[over] - max_age).astype(np.float64), minlength=n)
        active = (self.before[:, origin] - self.before[:, lo]).astype(np.float64)
        last = self.last_before[:, origin] if origin < self.invoked.shape[1] else self._last_incl_end()
        last = np.where(last >= lo, last - lo, -1).astype(np.int64)
        return hist.astype(np.float64), excess, active, last

    def _last_incl_end(self) -> np.ndarray:
        """Last invoked column of each series in the whole panel (-1: none)."""
        t = self.invoked.shape[1]
        return np.where(self.invoked[:, -1], t - 1, self.last_before[:, -1]) if t else np.full(len(self.invoked), -1)

    def counts(self, lo: int, origin: int) -> tuple[np.ndarray, np.ndarray]:
        """``pool_counts(values[:, lo:origin], lookback)`` for a window no wider than ``lookback``."""
        if origin - lo > self.lookback:
            raise ValueError(f"window {lo}..{origin} is wider than the lookback {self.lookback}")
        events, exposure = empty_pool()
        if origin <= lo:
            return events, exposure
        size = N_ACTIVITY_BINS * N_AGE_BINS
        steps = self.steps[lo:origin]
        for r in range(0, self.invoked.shape[0], self.chunk_rows):
            part = slice(r, r + self.chunk_rows)
            active = self.before[part, lo:origin] - self.before[part, lo:lo + 1]
            last = self.last_before[part, lo:origin]
            age = np.where(last >= lo, self.age_table[steps - last], self.never_bin)
            cell = (self.activity_table[active] + age).ravel()
            exposure += np.bincount(cell, minlength=size).reshape(exposure.shape)
            events += np.bincount(cell, weights=self.invoked[part, lo:origin].ravel().astype(np.float64),
                                  minlength=size).reshape(events.shape)
        return events, exposure


class IdleTimeHazard:
    """``p_any`` from idle times, for the ensemble: per-series state and pooled table read at each origin.

    ``pool="origin"`` (default) re-estimates the pooled (activity, age) table at
    every origin from the same ``lookback`` window as the series' own idle
    times, so it sees every activity level the series have reached by then.
    ``pool="fit"`` uses the table of the fit window throughout (before issue 14's
    second pass): on the Azure day's 1,350 functions, fitted at minute 240 with
    a 120-minute validation tail (the pool then saw minutes 0..119), busy
    series climbed into activity bins the fit window never saw and took the
    nearest lower bin's hazard; their one-step Brier score on minutes 240..599
    was 0.082 against 0.058 for the planner's empirical source, whose pool
    grows with the replay (with ``pool="origin"``: 0.058; ``bench/p_any_check.py``,
    a test-origin figure, measured after the fact).

    Args:
        max_age: idle times binned one step each up to this many steps.
        prior_weight: pseudo-observations of the pooled hazard per series.
        lookback: steps before an origin whose idle times describe a series
            (and whose invoked steps select its activity bin); bounds the cost
            of a forecast whatever the stored history's length.
        pool: ``"origin"`` or ``"fit"``, see above.
        pool_steps: steps per series an origin's pool samples at most (every ``width // pool_steps``-th step of
            its window, :func:`pool_counts`). The default takes every step of a day's window: about 1.4 s per
            origin per 20,000 series on one core (random sparse data); 240 cuts that to 0.4 s, but on the Azure
            day's 1,350 functions (window up to 600 steps, so every second step) moved the one-step decision
            curve at kappa 1 from 30.9 % to 33.9 % p75 cold, so the exact pool stays the default.
    """

    name = "hazard"

    def __init__(self, *, max_age: int = 240, prior_weight: float = 3.0, lookback: int = 1440,
                 pool: str = "origin", pool_steps: int = 1440):
        if pool not in ("origin", "fit"):
            raise ValueError(f"pool must be 'origin' or 'fit', got {pool!r}")
        self.pool = pool
        self.pool_steps = max(1, int(pool_steps))
        self.max_age = int(max_age)
        self.prior_weight = float(prior_weight)
        self.lookback = int(lookback)

    def fit(self, values: np.ndarray) -> "IdleTimeHazard":
        """Estimate the pooled (activity, age) hazard on ``values`` ``(N, T)`` (NaN = unknown = not invoked).

        With ``pool="origin"`` (the default) this table only serves origins with
        no history before them; every other origin re-estimates the pool from
        its own lookback window (:meth:`p_any_state`).
        """
        self.pooled_ = carry_forward(*pool_counts(values, self.lookback))
        return self

    def p_any(self, values: np.ndarray, origins: Sequence[int], h: int) -> np.ndarray:
        """``(N, len(origins), h)``: P(any invocation) at each origin and horizon, from columns before the origin."""
        return self.p_any_state(values, origins, h)[0]

    def p_any_state(self, values: np.ndarray, origins: Sequence[int], h: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`p_any` plus each series' age (steps since its last invocation) and active steps, ``(N, O)``."""
        if not hasattr(self, "pooled_"):
            raise RuntimeError("IdleTimeHazard is not fitted; call fit() first")
        out = np.zeros((values.shape[0], len(origins), h))
        ages = np.zeros((values.shape[0], len(origins)))
        actives = np.zeros((values.shape[0], len(origins)))
        # running counts and invoked cells of the columns the origins read (from ``base``), made once for all
        base = max(0, min((int(o) for o in origins), default=0) - self.lookback)
        windows = WindowPool(values[:, base:max((int(o) for o in origins), default=0)], self.lookback)
        for j, origin in enumerate(origins):
            lo = max(0, int(origin) - self.lookback)
            end = max(lo, min(int(origin), values.shape[1]))  # the window is columns lo .. end - 1
            hist, excess, active, last = windows.idle_state(lo - base, end - base, self.max_age)
            width = end - lo
            age0 = np.where(last >= 0, width - last, NEVER_AGE)
            pooled = self.pooled_
            if self.pool == "origin" and width:
                stride = max(1, width // self.pool_steps)
                if stride == 1:
                    pooled = carry_forward(*windows.counts(lo - base, end - base))
                else:
                    pooled = carry_forward(*pool_counts(values[:, lo:end], self.lookback, stride=stride))

            def hazard_at(ages, act, hist=hist, excess=excess, pooled=pooled):
                return hazard(hist, excess, act, ages, pooled, max_age=self.max_age,
                              prior_weight=self.prior_weight)

            out[:, j] = renewal_p_any(hazard_at, age0, active, h)
            ages[:, j], actives[:, j] = age0, active
        return out, ages, actives
