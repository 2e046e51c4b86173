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
    # beyond the histogram's range: geometric tail fitted to the overflow idle times (MLE n / sum of excess). Its prior
    # reads prior_weight * h0 events over prior_weight / h0 steps, so a series with no long gap of its own gets h0
    # squared, below the calls seen. On the Azure day (minutes 240..1439, idle over 240 minutes) the empirical source
    # reads 0.00003 where 0.0006 of the minutes saw a call for series with no long gap of their own, 0.0002 against
    # 0.0008 for those with one (bench/long_idle.py). The calibrated form (prior_weight events) reads 0.0006 and 0.0007
    # there, and made the planner's curves worse at equal waste on both replays (2026-12-03): minute protocol p75 at the
    # hybrid's waste 13.6 % against 7.7 %, fleet day 22.3 % against 15.4 % (overall cold 1.34 against 0.64 %). Holding a
    # model idle for hours at 0.0006 a minute costs about 1,600 held minutes per call caught (at 60-240 minutes idle:
    # about 140), so the same waste catches more calls on models idle for less. So it stays; bench/long_idle.py and
    # issue 14's notes of stops 32 and 33 have the measurements.
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
    # products into one buffer rather than a new (N, step) array per step: in a Dask worker (whose nanny makes
    # glibc return freed memory at once) each new array cost fresh pages, 0.12 s against 0.05 s for 5,000
    # series and 60 steps; every row is summed as before, so the numbers are the same
    g_reversed = np.ascontiguousarray(g[:, ::-1])  # g_reversed[:, horizon - step:] is g[:, step - 1::-1]
    products = np.empty_like(first)
    for step in range(1, horizon):
        np.multiply(u[:, :step], g_reversed[:, horizon - step:], out=products[:, :step])
        u[:, step] = first[:, step] + products[:, :step].sum(axis=1)
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
    """:func:`pool_counts` (stride 1) and :func:`idle_time_state` of many windows ``values[:, lo:origin]`` of one
    panel, from the panel's invoked cells, found once.

    In a window starting at column ``lo``, a series' steps fall into runs: the steps up to and including its first
    invoked one have none before them in the window (age :data:`NEVER_AGE`, 0 active steps); after its ``k``-th
    invoked step come steps of ages ``1, 2, ..., L`` with ``k`` active steps, up to and including the next invoked
    one (or the window's last step). A run of ``L`` such steps adds the age bins of ``1..L`` to its activity bin's
    exposure, and every invoked step is one event in its own cell, so the tables that :func:`pool_counts` bins
    step by step come from the invoked cells alone (14 % of the cells of a day in a 5,000-series shard of the
    fleet, where running counts over every cell took about 0.2 s of the 0.4 s of hazard on the shared 2-core
    machine, ``bench/forecast_shard.py``). The counts are integers,
    added to the prior chunk by chunk of ``chunk_rows`` rows as :func:`pool_counts` adds them (the prior's 0.1
    makes the order of those float additions matter), so the tables are :func:`pool_counts`' bit for bit
    (``tests/test_forecast_hazard.py`` compares them).
    """

    def __init__(self, values: np.ndarray, lookback: int, chunk_rows: int = 512):
        invoked = values > 0  # NaN compares False: unknown = not invoked
        self.n_series, self.n_steps = invoked.shape
        self.lookback = int(lookback)
        self.chunk_rows = int(chunk_rows)
        rows, cols = np.nonzero(invoked)  # row-major: by row, then column
        self._rows, self._cols = rows.astype(np.int64), cols.astype(np.int64)
        # an active count is at most the window's width; an age at most the panel's width
        self.activity_table = (activity_bin(np.arange(min(self.n_steps, self.lookback) + 1)) * N_AGE_BINS)
        self.age_table = age_bin(np.arange(self.n_steps + 2))
        self.never_bin = int(age_bin(np.array([NEVER_AGE]))[0])
        self._window_cache: tuple[tuple[int, int], tuple[np.ndarray, ...]] | None = None

    def _window(self, lo: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Invoked cells in columns ``lo .. end - 1``: rows, columns (by row, then column), each cell's index among
        its row's cells in the window, and per series the number of cells and the index of its first one."""
        if self._window_cache is not None and self._window_cache[0] == (lo, end):
            return self._window_cache[1]
        inside = (self._cols >= lo) & (self._cols < end)
        rows, cols = self._rows[inside], self._cols[inside]
        per_row = np.bincount(rows, minlength=self.n_series)
        first = np.cumsum(per_row) - per_row
        rank = np.arange(len(rows)) - first[rows]
        self._window_cache = ((lo, end), (rows, cols, rank, per_row, first))
        return rows, cols, rank, per_row, first

    def idle_state(self, lo: int, origin: int, max_age: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``idle_time_state(values[:, lo:origin] > 0, max_age)`` from the panel's invoked cells, found once.

        An idle time lies in the window when both invoked steps that bound it do; the counts are integers, so
        binning them in any order gives the same numbers.
        """
        n, bins = self.n_series, max_age + 2
        rows, cols, rank, per_row, first = self._window(lo, origin)
        later = np.flatnonzero(rank > 0)  # each invoked cell after its row's first ends an idle time
        gap_rows, gaps = rows[later], cols[later] - cols[later - 1]
        hist = np.bincount(gap_rows * bins + np.minimum(gaps, max_age + 1), minlength=n * bins).reshape(n, bins)
        excess = np.zeros(n)
        over = gaps > max_age
        if over.any():
            excess += np.bincount(gap_rows[over], weights=(gaps[over] - max_age).astype(np.float64), minlength=n)
        last = np.full(n, -1, dtype=np.int64)
        seen = per_row > 0
        last[seen] = cols[first[seen] + per_row[seen] - 1] - lo
        return hist.astype(np.float64), excess, per_row.astype(np.float64), last

    def counts(self, lo: int, origin: int) -> tuple[np.ndarray, np.ndarray]:
        """``pool_counts(values[:, lo:origin], lookback)`` for a window no wider than ``lookback``."""
        if origin - lo > self.lookback:
            raise ValueError(f"window {lo}..{origin} is wider than the lookback {self.lookback}")
        events, exposure = empty_pool()
        if origin <= lo:
            return events, exposure
        n, width, size = self.n_series, origin - lo, N_ACTIVITY_BINS * N_AGE_BINS
        chunks = -(-n // self.chunk_rows)
        chunk_of = np.arange(n) // self.chunk_rows
        rows, cols, rank, per_row, first = self._window(lo, origin)
        later = rank > 0
        gap = np.where(later, cols - np.concatenate([cols[:1], cols[:-1]]), 0)  # steps since the previous one
        # events: each invoked cell, with the cells before it in the window as its activity
        cell = self.activity_table[rank] + np.where(later, self.age_table[gap], self.never_bin)
        event_counts = np.bincount(chunk_of[rows] * size + cell, minlength=chunks * size).reshape(chunks, size)
        # exposure of the runs after an invoked cell: (chunk, activity bin, run length) -> age bins of 1..length
        seen = np.flatnonzero(per_row > 0)
        last = cols[first[seen] + per_row[seen] - 1]
        run_chunk = np.concatenate([chunk_of[rows[later]], chunk_of[seen]])
        run_activity = np.concatenate([self.activity_table[rank[later]], self.activity_table[per_row[seen]]])
        run_length = np.concatenate([gap[later], origin - 1 - last])  # the tail run may be empty
        run_counts = np.bincount((run_chunk * size + run_activity) // N_AGE_BINS * (width + 1) + run_length,
                                 minlength=chunks * N_ACTIVITY_BINS * (width + 1))
        ages = np.zeros((width + 1, N_AGE_BINS))  # ages[L, b]: ages 1..L that fall in age bin b
        np.add.at(ages, (np.arange(1, width + 1), self.age_table[1 : width + 1]), 1.0)
        ages = np.cumsum(ages, axis=0)
        # integers in float64 (below 2**53): the product is exact whatever the order of its sums
        exposure_counts = (run_counts.reshape(chunks * N_ACTIVITY_BINS, width + 1).astype(np.float64) @ ages)
        exposure_counts = exposure_counts.reshape(chunks, size)
        # the steps up to and including each series' first invoked one (all of them when it has none)
        leading = np.full(n, width, dtype=np.int64)
        leading[seen] = cols[first[seen]] - lo + 1
        exposure_counts[:, self.activity_table[0] + self.never_bin] += np.bincount(
            chunk_of, weights=leading.astype(np.float64), minlength=chunks)
        for c in range(chunks):  # added chunk by chunk, in the order pool_counts adds them
            exposure += exposure_counts[c].reshape(exposure.shape)
            events += event_counts[c].reshape(events.shape)
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
