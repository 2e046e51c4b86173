"""Idle-time hazards and the ensemble's stacked p_any (forecaster/forecast/hazard.py, p_any.py)."""

import numpy as np
import pandas as pd
import pytest

from forecaster.forecast.ensemble import Ensemble
from forecaster.forecast.hazard import IdleTimeHazard, idle_time_state
from forecaster.forecast.members import MovingAverage, actuals
from forecaster.forecast.p_any import PAnyModel, p_any_folds, segment_of
from forecaster.forecast.panel import Panel


def test_idle_time_state_counts_gaps_by_hand():
    invoked = np.array([[0, 1, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 1]], dtype=bool)
    hist, excess, active, last = idle_time_state(invoked, max_age=4)
    assert hist[0, 3] == 1 and hist[0, 1] == 1 and hist[0].sum() == 2  # gaps 3 and 1
    assert hist[1].sum() == 0 and last[1] == -1 and active[1] == 0
    assert hist[2, 5] == 1 and excess[2] == 2  # gap 6 > max_age 4: overflow bin, excess 6 - 4
    assert list(active) == [3, 0, 2] and list(last) == [5, -1, 6]


def timer_panel(n_steps: int = 600, period: int = 10) -> np.ndarray:
    values = np.zeros((2, n_steps))
    values[0, ::period] = 1.0  # a timer
    values[1, 5::97] = 1.0  # rare calls
    return values


def test_hazard_of_a_timer_peaks_at_its_period_and_is_causal():
    values = timer_panel()
    model = IdleTimeHazard(max_age=60).fit(values[:, :400])
    origin = 501  # last call at 500: the next is due 9 steps ahead (step 510)
    p = model.p_any(values, [origin], 12)[0, 0]
    assert p[9] > 0.8
    assert p[:8].max() < 0.2
    later = values.copy()
    later[:, origin:] = 7.0  # what happens at or after the origin must not matter
    assert np.array_equal(model.p_any(later, [origin], 12), model.p_any(values, [origin], 12))


def test_p_any_folds_are_contiguous_halves():
    assert list(p_any_folds(5)) == [0, 0, 0, 1, 1]
    assert list(segment_of(np.array([0.0, 0.05, 0.2, 0.5, 0.9]))) == [0, 1, 2, 3, 4]


def test_p_any_method_is_validated():
    with pytest.raises(ValueError, match="p_any must be"):
        PAnyModel(method="magic")


def sparse_panel(seed: int = 0, n_steps: int = 720) -> Panel:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(12):
        period = 7 + i
        row = np.zeros(n_steps)
        row[i::period] = 1.0  # timers of different periods
        rows.append(row)
    for rate in (0.02, 0.05, 0.1, 3.0):
        rows.append(rng.poisson(rate, n_steps).astype(float))
    values = np.array(rows)
    ids = np.array([f"s{i:02d}" for i in range(len(values))], dtype=object)
    return Panel(ids=ids, start=pd.Timestamp("2024-01-01", tz="UTC"), step=pd.Timedelta(minutes=1), values=values)


def test_stacked_p_any_beats_the_residual_p_any_on_timers():
    """The residual p_any of a smooth point forecast cannot see a timer's phase; the hazard can."""
    panel = sparse_panel()
    fit_steps = 600
    train = Panel(panel.ids, panel.start, panel.step, panel.values[:, :fit_steps])
    origins = list(range(fit_steps, 710, 5))
    stacked = Ensemble([MovingAverage(window=30)], horizon=10, refit=False).fit_panel(train)
    plain = Ensemble([MovingAverage(window=30)], horizon=10, refit=False, p_any="residuals").fit_panel(train)
    assert stacked.p_any_model_.method_ != "residuals"
    assert set(stacked.p_any_model_.scores_) >= {"residuals", "hazard", "recent", "long", "poisson"}
    y = actuals(panel.values, origins, 10) > 0
    brier = {}
    for name, model in (("stacked", stacked), ("residuals", plain)):
        p = model.forecast(panel, origins, 10)["p_any"]
        assert np.all((p >= 0) & (p <= 1))
        brier[name] = float(np.mean((p - y) ** 2))
    assert brier["stacked"] < 0.5 * brier["residuals"], brier


def test_one_member_wrappers_keep_the_residual_p_any():
    panel = sparse_panel(n_steps=300)
    model = Ensemble([MovingAverage(window=30)], horizon=5, fallback=False, refit=False).fit_panel(panel)
    assert model.p_any_model_.method_ == "residuals"


def test_unseen_cells_of_the_pool_take_their_nearest_seen_neighbour():
    from forecaster.forecast.hazard import carry_forward, empty_pool

    events, exposure = empty_pool()
    events[2, 3] += 5.0
    exposure[2, 3] += 100.0  # one seen cell: hazard 5.1 / 101
    pooled = carry_forward(events, exposure)
    seen_rate = 5.1 / 101.0
    assert pooled[2, 3] == pytest.approx(seen_rate)
    assert pooled[2, 20] == pytest.approx(seen_rate)  # older ages than ever seen
    assert pooled[2, 0] == pytest.approx(seen_rate)  # younger too
    assert pooled[7, 10] == pytest.approx(seen_rate)  # an activity bin never seen: the nearest lower seen one
    assert pooled[0, 10] == pytest.approx(seen_rate)  # below every seen bin: the nearest higher one
    assert not np.isclose(pooled, 0.1).any()  # the prior's 0.1 per step never stands for an unseen cell


def test_the_origin_pool_follows_the_window_not_the_fit():
    """With pool="origin" an origin's p_any depends on its lookback window only, not on which window was fitted."""
    values = sparse_panel(n_steps=720).values
    early = IdleTimeHazard(max_age=60, lookback=300).fit(values[:, :100])
    late = IdleTimeHazard(max_age=60, lookback=300).fit(values[:, :500])
    frozen = IdleTimeHazard(max_age=60, lookback=300, pool="fit").fit(values[:, :100])
    origins = [600, 650, 700]
    assert np.array_equal(early.p_any(values, origins, 5), late.p_any(values, origins, 5))
    assert not np.array_equal(early.p_any(values, origins, 5), frozen.p_any(values, origins, 5))
    with pytest.raises(ValueError, match="pool must be"):
        IdleTimeHazard(pool="magic")


def test_p_any_is_chosen_per_segment_and_horizon_band():
    """Every (segment, band) cell of the tail gets a method; thin cells keep the hazard; predict follows the cells."""
    from forecaster.forecast.p_any import HORIZON_BAND_EDGES, SEGMENT_EDGES, SegmentedStack, horizon_band

    assert list(horizon_band(12)) == [0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3]
    panel = sparse_panel()
    train = Panel(panel.ids, panel.start, panel.step, panel.values[:, :600])
    model = Ensemble([MovingAverage(window=30)], horizon=10, refit=False).fit_panel(train).p_any_model_
    assert model.method_ == "per_segment" and model.segment_methods_
    for (seg, band), name in model.segment_methods_.items():
        assert 0 <= seg <= len(SEGMENT_EDGES) and 0 <= band <= len(HORIZON_BAND_EDGES)
        scores = model.segment_scores_[(seg, band)]
        assert name == "hazard" or name == min(scores, key=scores.get)
    assert SegmentedStack.min_events > 0
    origins = list(range(600, 700, 7))
    values = panel.values
    point = np.zeros((len(values), len(origins), 10))
    p_resid = np.full_like(point, 0.5)
    estimates = model.estimates(values, origins, point, p_resid)
    p = model.predict(values, origins, point, p_resid)
    segment = segment_of(estimates["long"])
    band = np.broadcast_to(horizon_band(10)[None, None, :], point.shape)
    for (seg, b), name in model.segment_methods_.items():
        mine = (segment == seg) & (band == b)
        if mine.any() and name != "stacked":
            assert np.allclose(p[mine], np.broadcast_to(estimates[name], p.shape)[mine])
    unchosen = ~np.isin(segment * 10 + band, [s * 10 + b for s, b in model.segment_methods_])
    assert np.allclose(p[unchosen], estimates["hazard"][unchosen])


def test_p_any_is_never_worse_than_its_best_single_estimate_on_the_tail():
    """Two series, too few invoked points for any cell to leave the hazard, and a residual estimate that nearly
    knows the answer: the cells (all hazard) score worse than the residuals everywhere, so the residuals are used
    everywhere."""
    from forecaster.forecast.members import actuals
    from forecaster.forecast.p_any import PAnyModel

    rng = np.random.default_rng(11)
    values = rng.poisson(0.4, (2, 600)).astype(float)
    origins = list(range(400, 590, 5))
    actual = actuals(values, origins, 5)
    point = np.zeros_like(actual)
    p_resid = np.where(actual > 0, 0.9, 0.1)
    model = PAnyModel(lookback=300).fit(values, 400, origins, point, p_resid, actual, say=lambda _: None)
    assert model.scores_["residuals"] < model.scores_["per_segment"]
    assert model.scores_["residuals"] == min(v for k, v in model.scores_.items() if k != "per_segment")
    assert model.method_ == "residuals" and model.segment_methods_ == {}
    later = list(range(430, 590, 7))
    fresh = np.full((2, len(later), 5), 0.37)
    np.testing.assert_array_equal(model.predict(values, later, np.zeros_like(fresh), fresh), fresh)


def test_a_sampled_pool_keeps_the_cell_rates():
    """pool_counts with a stride samples exposures; on a stationary panel each well-seen cell's rate stays put."""
    from forecaster.forecast.hazard import pool_counts

    rng = np.random.default_rng(3)
    values = (rng.random((4000, 600)) < 0.1).astype(float)
    full_events, full_exposure = pool_counts(values, 300)
    events, exposure = pool_counts(values, 300, stride=5)
    assert exposure.sum() < 0.25 * full_exposure.sum()
    seen = full_exposure > 20_000
    assert seen.sum() >= 3
    np.testing.assert_allclose((events / exposure)[seen], (full_events / full_exposure)[seen], rtol=0.1)


def test_a_cell_leaves_the_hazard_only_for_a_gain_spread_over_series():
    """The same mean gain in Brier score replaces the hazard when many series share it, not when one series
    carries it (points of one series are not independent)."""
    from forecaster.forecast.p_any import clearly_lower

    rng = np.random.default_rng(5)
    series = np.repeat(np.arange(200), 50)
    base = rng.random(len(series)) * 0.01
    shared = base - 0.002 + rng.normal(0.0, 0.0005, len(series))
    carried = base.copy()
    carried[series == 7] -= 0.002 * 200  # the same total gain, all on one series
    assert abs((shared - base).mean() - (carried - base).mean()) < 1e-4
    assert clearly_lower(shared, base, series)
    assert not clearly_lower(carried, base, series)
    assert not clearly_lower(base + 0.001, base, series)
    assert not clearly_lower(shared[:50], base[:50], series[:50])  # one series: no spread to judge by


def _mixed_panel(seed: int, n: int, t: int) -> np.ndarray:
    """Sparse, busy, timer-like and silent series with unknown (NaN) stretches."""
    rng = np.random.default_rng(seed)
    rates = rng.choice([0.0, 0.002, 0.02, 0.2, 0.9], size=n)
    values = rng.poisson(rates[:, None], size=(n, t)).astype(float)
    values[::7, ::13] = 3.0  # timers
    values[rng.random((n, t)) < 0.01] = np.nan
    values[:5, :50] = np.nan  # series registered late
    return values


def test_idle_time_state_matches_a_loop_over_each_series():
    values = _mixed_panel(11, 60, 700)
    invoked = values > 0
    hist, excess, active, last = idle_time_state(invoked, max_age=40)
    for i in range(len(invoked)):
        cols = np.flatnonzero(invoked[i])
        gaps = np.diff(cols)
        expected = np.zeros(42)
        for gap in gaps:
            expected[min(gap, 41)] += 1
        assert np.array_equal(hist[i], expected)
        assert excess[i] == sum(g - 40 for g in gaps if g > 40)
        assert active[i] == len(cols) and last[i] == (cols[-1] if len(cols) else -1)


@pytest.mark.parametrize("n_series", [40, 1100])  # one chunk of rows, and three
def test_window_pool_gives_exactly_the_pool_of_each_window(n_series):
    """WindowPool (running counts made once) bins every window as pool_counts on the window's own columns does."""
    from forecaster.forecast.hazard import WindowPool, pool_counts

    values = _mixed_panel(12, n_series, 900)
    lookback = 500
    pools = WindowPool(values, lookback)
    for lo, origin in [(0, 1), (0, 37), (0, 500), (1, 501), (123, 600), (400, 900), (899, 900), (300, 300)]:
        events, exposure = pools.counts(lo, origin)
        want_events, want_exposure = pool_counts(values[:, lo:origin], lookback)
        assert np.array_equal(events, want_events) and np.array_equal(exposure, want_exposure)
    with pytest.raises(ValueError, match="wider than the lookback"):
        pools.counts(0, 501)


def test_window_pool_edge_series_give_the_same_tables_as_pool_counts():
    """Series invoked at every step (an empty last run, the largest activity), never, only at a window's first or
    last step, or unknown, in chunks of 3 rows (the prior's 0.1 makes the order of additions matter)."""
    from forecaster.forecast.hazard import WindowPool, pool_counts

    width = 40
    values = np.zeros((9, width))
    values[0] = 1.0
    values[2, 0] = values[3, -1] = values[4, [0, -1]] = 2.0
    values[5] = np.nan
    values[6, ::7] = values[7, 5:9] = values[8, 3] = 1.0
    pools = WindowPool(values, width, chunk_rows=3)
    for lo, origin in [(0, width), (0, 1), (1, width), (3, 4), (5, 9), (0, width - 1)]:
        events, exposure = pools.counts(lo, origin)
        want_events, want_exposure = pool_counts(values[:, lo:origin], width, chunk_rows=3)
        assert np.array_equal(events, want_events) and np.array_equal(exposure, want_exposure)
        assert exposure.sum() == want_exposure.size + len(values) * (origin - lo)  # one per step, plus the prior
        got = pools.idle_state(lo, origin, 5)
        for a, b in zip(got, idle_time_state(values[:, lo:origin] > 0, 5), strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_p_any_state_equals_the_pool_of_each_origin_window():
    """The hazard's p_any at many origins equals the one computed origin by origin from pool_counts."""
    from forecaster.forecast import hazard as hz

    values = _mixed_panel(13, 80, 1000)
    model = IdleTimeHazard(max_age=60, lookback=300).fit(values[:, :400])
    origins = list(range(400, 700, 7))
    p, ages, actives = model.p_any_state(values, origins, 12)
    for j, origin in enumerate(origins):
        lo = max(0, origin - model.lookback)
        hist, excess, active, last = hz.idle_time_state(values[:, lo:origin] > 0, model.max_age)
        age0 = np.where(last >= 0, (origin - lo) - last, hz.NEVER_AGE)
        pooled = hz.carry_forward(*hz.pool_counts(values[:, lo:origin], model.lookback))

        def hazard_at(a, act, hist=hist, excess=excess, pooled=pooled):
            return hz.hazard(hist, excess, act, a, pooled, max_age=model.max_age, prior_weight=model.prior_weight)

        assert np.array_equal(p[:, j], hz.renewal_p_any(hazard_at, age0, active, 12))
        assert np.array_equal(ages[:, j], age0) and np.array_equal(actives[:, j], active)


def test_window_idle_state_equals_idle_time_state_of_each_window():
    from forecaster.forecast.hazard import WindowPool

    values = _mixed_panel(14, 70, 800)
    pools = WindowPool(values, 500)
    for lo, end in [(0, 0), (0, 1), (0, 260), (10, 510), (299, 799), (300, 800), (799, 800)]:
        got = pools.idle_state(lo, end, 40)
        want = idle_time_state(values[:, lo:end] > 0, 40)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_stacked_cells_read_the_same_inputs_as_the_full_design(monkeypatch):
    """predict builds the regression's inputs only at the points of stacked cells: the numbers of the full design."""
    from forecaster.forecast.p_any import SegmentedStack, horizon_band

    monkeypatch.setattr(SegmentedStack, "min_events", 5)  # weights for every segment of this small panel
    panel = sparse_panel()
    train = Panel(panel.ids, panel.start, panel.step, panel.values[:, :600])
    model = Ensemble([MovingAverage(window=30)], horizon=10, refit=False).fit_panel(train).p_any_model_
    origins = list(range(600, 700, 7))
    rng = np.random.default_rng(2)
    point = rng.gamma(0.5, 1.0, (len(panel.values), len(origins), 10))
    p_resid = rng.uniform(0.0, 1.0, point.shape)
    estimates = model.estimates(panel.values, origins, point, p_resid)
    segment = segment_of(estimates["long"])
    target = actuals(panel.values, origins, 10) > 0
    full = model.design(estimates)
    model.stack_ = SegmentedStack().fit(full, target, segment, np.ones(point.shape, dtype=bool))
    assert model.stack_.by_segment_
    # every other horizon band stacked, the rest the recent share
    model.segment_methods_ = {(seg, b): "stacked" if b % 2 == 0 else "recent" for seg in range(5) for b in range(5)}
    band = np.broadcast_to(horizon_band(10)[None, None, :], point.shape)
    expected = np.array(estimates["hazard"], dtype=np.float64)
    for (seg, b), name in model.segment_methods_.items():
        mine = (segment == seg) & (band == b)
        if mine.any():
            expected[mine] = (model.stack_.predict(full[mine], segment[mine]) if name == "stacked"
                              else np.broadcast_to(estimates[name], point.shape)[mine])
    np.testing.assert_array_equal(model.predict(panel.values, origins, point, p_resid), expected)
    picked = (band % 2 == 0) & (segment >= 0)
    np.testing.assert_array_equal(model.design(estimates, picked), full[picked])


def test_renewal_p_any_is_the_renewal_sum_step_by_step():
    """u(k) = f(k) + sum_{j<k} u(j) g(k-j), each row summed as a plain numpy row sum of the products."""
    from forecaster.forecast.hazard import renewal_p_any

    rng = np.random.default_rng(8)
    n, horizon = 300, 37
    h_now, h_new = rng.uniform(0.0, 0.3, (n, horizon)), rng.uniform(0.0, 0.3, (n, horizon))
    age0, active = rng.integers(1, 50, n), rng.integers(0, 20, n).astype(float)

    def hazard_at(ages, act):
        return h_new if np.array_equal(act, active + 1) else h_now

    first = h_now * np.cumprod(np.concatenate([np.ones((n, 1)), 1 - h_now[:, :-1]], axis=1), axis=1)
    g = h_new * np.cumprod(np.concatenate([np.ones((n, 1)), 1 - h_new[:, :-1]], axis=1), axis=1)
    u = np.zeros((n, horizon))
    u[:, 0] = first[:, 0]
    for step in range(1, horizon):
        u[:, step] = first[:, step] + (u[:, :step] * g[:, step - 1::-1]).sum(axis=1)
    np.testing.assert_array_equal(renewal_p_any(hazard_at, age0, active, horizon), np.clip(u, 0.0, 1.0))


def test_stack_regression_reaches_the_minimum_where_plain_newton_steps_overshoot():
    """Rare events at very negative offsets (dormant series: hazard logits down to -20.7) with a weak penalty: a
    full Newton step overshoots (p (1 - p) is ~0 there, so the Hessian is little more than the penalty) and the
    plain iteration diverged to a loss ~10^4 times the minimum. The damped iteration must land on the minimum
    that a general-purpose optimiser finds."""
    from scipy.optimize import minimize

    from forecaster.forecast.p_any import _offset_logistic

    rng = np.random.default_rng(0)
    n = 2000
    offset = np.where(rng.random(n) < 0.4, -20.7, rng.normal(-10, 2, n))
    x = np.column_stack([np.ones(n), rng.standard_t(3, size=(n, 9))])
    y = (rng.random(n) < 0.01).astype(float)
    penalty = 1.0

    def loss(w):
        eta = offset + x @ w
        return float(np.sum(np.logaddexp(0.0, eta) - y * eta) + 0.5 * penalty * w @ w)

    w = _offset_logistic(x, offset, y, penalty)
    best = minimize(loss, np.zeros(x.shape[1]), method="BFGS", options={"gtol": 1e-8})
    assert loss(w) == pytest.approx(best.fun, rel=1e-6)
    assert np.abs(w).max() < 50  # the plain iteration's weights ran to the hundreds
