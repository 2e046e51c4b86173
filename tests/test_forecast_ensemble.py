"""Ensemble: failing members are skipped, weights, calibrated quantiles and probability of any invocation."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from forecaster.forecast.backtest import Protocol, run_backtest
from forecaster.forecast.ensemble import (
    Ensemble,
    conformal_rank,
    needed_residuals,
    pool_horizons,
    residual_quantiles,
)
from forecaster.forecast.members import Member, MovingAverage, SeasonalNaive
from forecaster.forecast.panel import Panel
from forecaster.forecast.trees import LightGBMMember

START = pd.Timestamp("2024-03-01 00:00", tz="UTC")


def poisson_panel(rates: np.ndarray, n_steps: int, seed: int = 3) -> Panel:
    rng = np.random.default_rng(seed)
    values = rng.poisson(np.repeat(rates[:, None], n_steps, axis=1)).astype(float)
    return Panel.from_wide([f"p{k:03d}" for k in range(len(rates))], values, start=START, step="1min")


def mixed_panel(n_steps: int = 360) -> Panel:
    """Two 15-minute timers and four Poisson series."""
    rng = np.random.default_rng(11)
    t = np.arange(n_steps)
    rows = [np.where(t % 15 == 3, 5.0, 0.0), np.where(t % 15 == 9, 2.0, 0.0)]
    rows += [rng.poisson(r, n_steps).astype(float) for r in (0.3, 2.0, 6.0, 15.0)]
    ids = ["timer-a", "timer-b", "rare", "p2", "p6", "p15"]
    return Panel.from_wide(ids, np.stack(rows), start=START, step="1min")


class Broken(Member):
    """A member that raises in fit (or, with ``when="forecast"``, in forecast)."""

    name = "broken"

    def __init__(self, when: str = "fit"):
        self.when = when

    def _fit(self, panel: Panel) -> None:
        if self.when == "fit":
            raise RuntimeError("cannot fit")

    def _forecast(self, panel: Panel, origins, h):
        raise RuntimeError("cannot forecast")


class Partial(SeasonalNaive):
    """Seasonal naive that, like ARIMA, covers only some series (NaN elsewhere)."""

    def __init__(self, season_length: int = 15, covers: tuple[str, ...] = ("p15",)):
        super().__init__(season_length)
        self.covers = covers

    @property
    def name(self) -> str:
        return "partial"

    def _forecast(self, panel: Panel, origins, h):
        out = super()._forecast(panel, origins, h)
        out[~np.isin(panel.ids, self.covers)] = np.nan
        return out


def test_member_failing_in_fit_is_reported_and_skipped() -> None:
    panel = mixed_panel()
    ensemble = Ensemble([Broken(), MovingAverage(30)], horizon=10).fit(panel.to_long())
    assert "broken" in ensemble.failures_ and "cannot fit" in ensemble.failures_["broken"]
    assert ensemble.member_names_ == ["moving_average_30", "fallback"]
    out = ensemble.predict(10)
    assert len(out) == panel.n_series * 10 and np.isfinite(out["ensemble"]).all()


def test_member_failing_at_forecast_time_leaves_the_fallback() -> None:
    panel = mixed_panel()
    ensemble = Ensemble([Broken("forecast")], horizon=10).fit_panel(panel)
    assert "broken" in ensemble.failures_
    assert ensemble.member_names_ == ["fallback"]
    np.testing.assert_allclose(ensemble.weights_, 1.0)
    # and when a member only starts failing after validation, forecasts still come out
    healthy = Ensemble([MovingAverage(30)], horizon=10, weighting="inverse_error").fit_panel(panel)
    healthy.members_[0]._forecast = lambda *args: (_ for _ in ()).throw(RuntimeError("gone"))
    out = healthy.predict(5)
    assert np.isfinite(out["ensemble"]).all() and "moving_average_30 (forecast)" in healthy.failures_


def test_forecast_evaluates_a_member_only_for_the_series_that_weight_it() -> None:
    panel = mixed_panel()
    ensemble = Ensemble([SeasonalNaive(15), MovingAverage(60)], horizon=10, weighting="inverse_error")
    ensemble.fit_panel(panel)
    ensemble.weights_[:2] = [0.0, 0.0, 1.0]  # the first two series rely on the fallback alone
    seen: list[int] = []
    member = ensemble.members_[0]
    original = member._forecast
    member._forecast = lambda sub, origins, h: seen.append(sub.n_series) or original(sub, origins, h)
    ensemble.forecast(panel, [300], 10)
    assert seen == [panel.n_series - 2]
    ensemble.forecast(panel, [300], 10, members=True)  # every member's forecast asked for: all series
    assert seen[-1] == panel.n_series


def test_every_member_failing_still_forecasts_with_the_fallback() -> None:
    panel = mixed_panel()
    out = Ensemble([Broken(), Broken("forecast")], horizon=5).fit_panel(panel).predict(5)
    assert {"ensemble", "q0.1", "q0.5", "q0.9", "p_any"} <= set(out.columns)
    assert len(out) == panel.n_series * 5


def test_weights_favour_the_member_that_was_right_on_validation() -> None:
    panel = mixed_panel()
    ensemble = Ensemble(
        [SeasonalNaive(15), MovingAverage(60)], horizon=10, weighting="inverse_error", refit=False
    ).fit_panel(panel)
    weights = pd.DataFrame(ensemble.weights_, index=panel.ids, columns=ensemble.member_names_)
    assert weights.loc["timer-a", "seasonal_naive_15"] > 0.3  # shares it with the fallback, also exact
    assert weights.loc["timer-a", "moving_average_60"] < 1e-3
    np.testing.assert_allclose(weights.sum(axis=1), 1.0)
    best = Ensemble([SeasonalNaive(15), MovingAverage(60)], horizon=10, weighting="best").fit_panel(panel)
    assert set(np.unique(best.weights_)) == {0.0, 1.0}


def test_member_covering_some_series_only_is_weighted_where_it_forecasts() -> None:
    panel = mixed_panel()
    ensemble = Ensemble([Partial()], horizon=10, weighting="inverse_error", refit=False).fit_panel(panel)
    arrays = ensemble.forecast(panel, [300], 10, members=True)
    covered = panel.ids == "p15"
    assert np.isnan(arrays["partial"][~covered]).all() and np.isfinite(arrays["partial"][covered]).all()
    assert np.isfinite(arrays["ensemble"]).all()
    assert ensemble.weights_[~covered, 0].tolist() == [0.0] * 5 and ensemble.weights_[covered, 0][0] > 0


def test_series_too_new_and_unseen_series_use_the_fallback() -> None:
    panel = mixed_panel()
    values = panel.values.copy()
    values[0, :-10] = np.nan  # timer-a only known for its last 10 steps
    young = Panel(panel.ids, panel.start, panel.step, values)
    ensemble = Ensemble([MovingAverage(30)], horizon=5, min_history=30).fit_panel(young)
    assert ensemble.weights_[0].tolist() == [0.0, 1.0]
    newcomer = pd.DataFrame(
        {"unique_id": "brand-new", "ds": panel.ds(300, 60), "y": np.ones(60)}  # the last hour only
    )
    out = ensemble.predict(3, history=pd.concat([panel.to_long(), newcomer]))
    new_rows = out[out["unique_id"] == "brand-new"]
    assert len(new_rows) == 3 and np.allclose(new_rows["ensemble"], 1.0)


def test_output_columns_are_ordered_quantiles_and_probabilities() -> None:
    panel = mixed_panel()
    out = Ensemble([MovingAverage(30)], horizon=10).fit_panel(panel).predict(12, members=True)
    assert list(out.columns[:9]) == ["unique_id", "ds", "ensemble", "q0.1", "q0.5", "q0.9", "q0.95", "q0.99",
                                     "p_any"]
    assert "moving_average_30-q0.9" in out.columns
    assert (out["q0.1"] <= out["q0.5"]).all() and (out["q0.5"] <= out["q0.9"]).all()
    assert (out["q0.9"] <= out["q0.95"]).all() and (out["q0.95"] <= out["q0.99"]).all()
    assert (out["q0.1"] >= 0).all() and out["p_any"].between(0, 1).all()
    assert np.array_equal(out["ensemble"], out["q0.5"])


# ---------------------------------------------------------------------------- calibration


def test_conformal_level_and_quantiles_match_hand_values() -> None:
    assert conformal_rank(0.9, 99) == 90  # ceil(100 * 0.9)
    assert conformal_rank(0.1, 99) == 10  # floor(100 * 0.1)
    assert conformal_rank(0.9, 19) == 18  # ceil(20 * 0.9)
    assert conformal_rank(0.9, 5) == 5  # ceil(5.4) = 6, capped at n
    residuals = np.arange(99.0, 0.0, -1.0)[None, None, :]  # 99..1, unsorted on purpose
    assert residual_quantiles(residuals, (0.1, 0.5, 0.9), min_count=10)[0, 0].tolist() == [10.0, 50.0, 90.0]
    assert residual_quantiles(residuals, (0.9,), min_count=10, conformal=False)[0, 0, 0] == 90.0  # ceil(89.1)
    with_gaps = np.concatenate([residuals, np.full((1, 1, 7), np.nan)], axis=2)
    assert residual_quantiles(with_gaps, (0.9,), min_count=10)[0, 0, 0] == 90.0  # NaN = no residual
    assert np.isnan(residual_quantiles(residuals[:, :, :5], (0.9,), min_count=10)).all()


@pytest.mark.parametrize("interval_scale", ["none", "sqrt"])
def test_q90_covers_ninety_percent_of_poisson_counts_with_known_rates(interval_scale: str) -> None:
    rates = np.linspace(2.0, 30.0, 40)
    panel = poisson_panel(rates, 700)
    protocol = Protocol("poisson", 400, tuple(range(400, 686, 15)), 15, 1.0, None, (1, 5, 15))
    ensemble = Ensemble(
        [MovingAverage(60)], horizon=15, validation_steps=200, stride=2, refit=False, interval_scale=interval_scale
    )
    arrays = run_backtest(ensemble, panel, protocol)["ensemble"]
    actual = np.stack([panel.values[:, o : o + 15] for o in protocol.origins], axis=1)
    coverage90 = np.mean(actual <= arrays.q90)
    coverage10 = np.mean(actual < arrays.q10)
    assert 0.87 <= coverage90 <= 0.93, coverage90  # 11,400 points: 2 standard errors ~ 0.006
    assert 0.07 <= coverage10 <= 0.13, coverage10
    # and the quantiles sit near the true Poisson quantiles of each series
    from scipy.stats import poisson

    true90 = poisson.ppf(0.9, rates)
    assert np.median(np.abs(arrays.q90.mean(axis=(1, 2)) - true90) / true90) < 0.1


def test_q95_and_q99_are_calibrated_from_sixteen_validation_origins() -> None:
    # 16 validation origins, as the default retrain has on one day: one (series, horizon) cell holds 16
    # residuals, whose largest covers only 16/17 = 0.94; pooling neighbouring horizons makes q0.99 a real q0.99
    rates = np.linspace(2.0, 30.0, 40)
    panel = poisson_panel(rates, 1000, seed=3)
    protocol = Protocol("poisson", 400, tuple(range(400, 986, 15)), 15, 1.0, None, (1, 5, 15))
    ensemble = Ensemble([MovingAverage(60)], horizon=15, validation_steps=200, stride=12, refit=False)
    ensemble.fit_panel(panel.head(protocol.fit_steps))
    assert len(ensemble.validation_origins_) == 16
    arrays = ensemble.forecast(panel, list(protocol.origins), 15)
    actual = np.stack([panel.values[:, o : o + 15] for o in protocol.origins], axis=1)  # 23,400 points
    # split conformal with n residuals covers at least tau and at most tau + 1 / (n + 1): 0.95 pools 48
    # residuals (<= 0.97), 0.99 pools 112 (<= 0.999); on counts P(y < q) is the lower end (EVALUATION.md)
    for tau, upper in ((0.95, 0.97), (0.99, 0.999)):
        weak, strict = np.mean(actual <= arrays[f"q{tau}"]), np.mean(actual < arrays[f"q{tau}"])
        assert weak >= tau - 0.005 and strict <= upper + 0.005, (tau, strict, weak)
    assert (arrays["q0.99"] >= arrays["q0.95"]).all() and (arrays["q0.95"] >= arrays["q0.9"]).all()


def test_pooled_horizons_give_each_level_enough_residuals() -> None:
    assert [needed_residuals(t) for t in (0.9, 0.95, 0.99, 0.1)] == [9, 19, 99, 9]
    residuals = np.arange(60 * 16, dtype=float).reshape(1, 60, 16)
    assert pool_horizons(residuals, 0.9) is residuals  # 16 >= 9: nothing pooled
    assert pool_horizons(residuals, 0.95).shape == (1, 60, 48)  # 3 horizons
    pooled = pool_horizons(residuals, 0.99)
    assert pooled.shape == (1, 60, 112)  # 7 horizons x 16 origins >= 99
    assert np.array_equal(np.unique(pooled[0, 0] // 16), np.arange(7))  # h1 pools h1..h7 (shifted inward)
    assert np.array_equal(np.unique(pooled[0, 30] // 16), np.arange(27, 34))  # h31 pools h28..h34


def test_probability_of_any_invocation_matches_known_rates() -> None:
    rates = np.repeat([0.05, 0.2, 0.5, 1.0, 2.0], 8)
    panel = poisson_panel(rates, 900, seed=5)
    ensemble = Ensemble([MovingAverage(60, "median")], horizon=5, validation_steps=400, stride=1, refit=False)
    ensemble.fit_panel(panel.head(700))
    p_any = ensemble.forecast(panel, list(range(700, 895, 5)), 5)["p_any"]
    expected = 1 - np.exp(-rates)
    per_series = p_any.mean(axis=(1, 2))
    assert np.abs(per_series - expected).max() < 0.12
    assert np.abs(per_series - expected).mean() < 0.05
    observed = np.stack([panel.values[:, o : o + 5] >= 1 for o in range(700, 895, 5)], axis=1).mean(axis=(1, 2))
    assert np.abs(per_series - observed).mean() < 0.05


# ---------------------------------------------------------------------------- quantile heads


def small_head() -> LightGBMMember:
    """A light LightGBM whose settings the quantile heads copy (fast enough for tests)."""
    return LightGBMMember(horizon=15, params={"n_estimators": 60})


def burst_panel(n: int = 30, n_steps: int = 900, seed: int = 7) -> tuple[Panel, np.ndarray]:
    """Poisson counts whose rate is 20x higher at minute 7 of every quarter hour (a timer with variable load)."""
    rng = np.random.default_rng(seed)
    t = np.arange(n_steps)
    rate = np.where(t % 15 == 7, 20.0, 1.0)[None, :] * rng.uniform(0.5, 1.5, (n, 1))
    values = rng.poisson(rate).astype(float)
    return Panel.from_wide([f"b{k:02d}" for k in range(n)], values, start=START, step="1min"), rate


def test_quantile_heads_follow_bursts_that_residual_quantiles_average_away() -> None:
    from scipy.stats import poisson

    panel, rate = burst_panel()
    protocol = Protocol("bursts", 600, tuple(range(600, 886, 15)), 15, 1.0, None, (1, 5, 15))
    actual = np.stack([panel.values[:, o : o + 15] for o in protocol.origins], axis=1)
    true90 = poisson.ppf(0.9, np.stack([rate[:, o : o + 15] for o in protocol.origins], axis=1))
    burst = (np.arange(900)[protocol.origins[0] : protocol.origins[0] + 15] % 15 == 7)[None, None, :]
    burst = np.broadcast_to(burst, actual.shape)  # origins are 15 apart: the same phase at every origin

    coverage = {}
    for heads in (False, small_head()):
        ensemble = Ensemble([MovingAverage(60)], horizon=15, refit=False, quantile_heads=heads)
        arrays = run_backtest(ensemble, panel, protocol)["ensemble"]
        covered = actual <= arrays.q90
        coverage[bool(heads)] = (covered[burst].mean(), covered[~burst].mean(), covered.mean())
        if heads:
            assert ensemble.quantile_method_ in ("heads", "heads_empirical")
            assert ensemble.quantile_scores_[ensemble.quantile_method_] < ensemble.quantile_scores_["residuals"]
            assert set(ensemble.heads_) == {0.1, 0.9} and ensemble.heads_[0.9].name == "lightgbm_q0.9"
            assert ensemble.head_series_.mean() >= 0.9  # chosen per series, on validation: nearly all here
            # the high bound sits on the true quantile at the burst minutes, and stays low elsewhere
            assert 0.85 <= np.median(arrays.q90[burst] / true90[burst]) <= 1.15
            assert np.median(arrays.q90[~burst] - true90[~burst]) <= 1.0
            assert (arrays.q10 <= arrays.point).all() and (arrays.point <= arrays.q90).all()
            assert 0.03 <= np.mean(actual < arrays.q10) <= 0.13
            # q0.95 and q0.99 ride on the q0.9 head (no head of their own), conformalised at their own level
            assert ensemble.head_base_ == {0.1: 0.1, 0.9: 0.9, 0.95: 0.9, 0.99: 0.9}
            full = ensemble.forecast(panel, list(protocol.origins), 15)
            true99 = poisson.ppf(0.99, np.stack([rate[:, o : o + 15] for o in protocol.origins], axis=1))
            assert 0.85 <= np.median(full["q0.99"][burst] / true99[burst]) <= 1.25
            # calibrated over all minutes (measured 0.984 / 0.953); at the burst minutes alone q0.99 covers
            # 0.91 (q0.9 0.85): one additive offset per series and horizon cannot be conditional on the phase
            assert np.mean(actual <= full["q0.99"]) >= 0.975 and 0.93 <= np.mean(actual <= full["q0.95"]) <= 0.98
            at_bursts = {q: np.mean(actual[burst] <= full[q][burst]) for q in ("q0.9", "q0.99")}
            assert at_bursts["q0.99"] >= at_bursts["q0.9"] + 0.03
            assert (full["q0.9"] <= full["q0.95"]).all() and (full["q0.95"] <= full["q0.99"]).all()
    residual_burst, _, _ = coverage[False]
    head_burst, head_quiet, head_all = coverage[True]
    assert residual_burst < 0.8  # one bound per horizon mixes burst and quiet minutes
    assert head_burst >= 0.8 and head_burst > residual_burst + 0.07
    assert 0.85 <= head_quiet <= 0.97 and 0.87 <= head_all <= 0.95


def test_failing_quantile_head_is_reported_and_residual_quantiles_remain(monkeypatch) -> None:
    monkeypatch.setattr(LightGBMMember, "quantile_head", lambda self, tau: Broken())
    panel = mixed_panel()
    ensemble = Ensemble([MovingAverage(30)], horizon=10, quantile_heads=True).fit_panel(panel)
    assert "cannot fit" in ensemble.failures_["broken"]
    assert ensemble.quantile_method_ == "residuals" and ensemble.heads_ == {}
    out = ensemble.predict(10)
    assert np.isfinite(out[["q0.1", "q0.9"]]).all().all() and (out["q0.9"] >= out["q0.5"]).all()


def test_quantile_heads_are_on_only_with_a_lightgbm_member() -> None:
    panel = mixed_panel()
    plain = Ensemble([MovingAverage(30)], horizon=10, refit=False).fit_panel(panel)
    assert plain.heads_ == {} and plain.quantile_scores_ == {}
    ensemble = Ensemble([LightGBMMember(horizon=10, params={"n_estimators": 20})], horizon=10, refit=False)
    ensemble.fit_panel(panel)
    assert set(ensemble.quantile_scores_) == {"residuals", "heads", "heads_empirical", "per_series_choice"}
    assert ensemble.quantile_scores_["per_series_choice"] <= min(ensemble.quantile_scores_.values()) + 1e-12
    assert {"lightgbm_q0.1", "lightgbm_q0.9"} <= set(ensemble.fit_seconds_)


def test_families_choose_which_default_members_the_ensemble_builds() -> None:
    """``families`` (``PREWARM_FORECAST_MEMBERS``) builds only those members, plus the fallback; an unknown name
    is refused when the ensemble is made, not after an hour of fitting."""
    ensemble = Ensemble(families=("arima",), horizon=10, refit=False).fit_panel(mixed_panel())
    assert ensemble.member_names_ == ["arima", "fallback"] and ensemble.heads_ == {}  # no LightGBM: no heads
    with pytest.raises(ValueError, match=r"unknown member families \['prophet'\]"):
        Ensemble(families=("arima", "prophet"))


def test_heads_are_chosen_per_series_and_exact_series_keep_residual_bounds() -> None:
    bursts, _ = burst_panel(n=12, n_steps=600)
    t = np.arange(600)
    timers = np.stack([np.where(t % 15 == 3, 5.0, 0.0), np.where(t % 15 == 9, 2.0, 0.0)])
    panel = Panel.from_wide([*bursts.ids, "timer-a", "timer-b"], np.vstack([bursts.values, timers]),
                            start=START, step="1min")
    ensemble = Ensemble([MovingAverage(60)], horizon=15, refit=False, quantile_heads=small_head())
    ensemble.fit_panel(panel.head(540))
    chosen = pd.Series(ensemble.head_series_, index=panel.ids)
    assert not chosen[["timer-a", "timer-b"]].any()  # the fallback forecasts them exactly: nothing to gain
    assert chosen.drop(["timer-a", "timer-b"]).mean() >= 0.9
    arrays = ensemble.forecast(panel, [540, 555], 15)
    timer_rows = np.isin(panel.ids, ["timer-a", "timer-b"])
    actual = np.stack([panel.values[:, 540:555], panel.values[:, 555:570]], axis=1)
    for column in ("q0.1", "ensemble", "q0.9"):  # exact forecasts, zero-width residual bounds
        np.testing.assert_array_equal(arrays[column][timer_rows], actual[timer_rows])
    assert (arrays["q0.9"][~timer_rows] > arrays["ensemble"][~timer_rows]).mean() > 0.5


def test_shrunk_scores_follow_the_segment_without_evidence_and_the_series_with_it():
    from forecaster.forecast.ensemble import shrunk_scores

    # three sparse series (same segment); member 0 is better on two of them, member 1 on the third
    mae = np.array([[1.0, 2.0], [1.0, 2.0], [2.0, 1.0]])
    values = np.zeros((3, 100))
    values[:, ::50] = 1.0
    silent = np.zeros((3, 2, 5))
    score = shrunk_scores(mae, values, silent, shrinkage=20.0)
    assert (score.argmin(axis=1) == 0).all()  # no invoked validation step: the segment's choice
    busy_tail = np.ones((3, 20, 5))
    score = shrunk_scores(mae, values, busy_tail, shrinkage=20.0)
    assert list(score.argmin(axis=1)) == [0, 0, 1]  # 100 invoked steps each: their own errors
    mae[2, 1] = np.inf  # a member not available stays unavailable
    assert np.isinf(shrunk_scores(mae, values, busy_tail, shrinkage=20.0)[2, 1])


# ---------------------------------------------------------------------------- forecast path: same numbers, less work


def sparse_burst_panel(n: int = 24, n_steps: int = 600, seed: int = 5) -> Panel:
    """Mostly idle series (rate 0.15 per minute) that burst 30x at minute 7 of every quarter hour, and two timers:
    point forecasts of 0 at quiet minutes, heads chosen for the bursty series."""
    rng = np.random.default_rng(seed)
    t = np.arange(n_steps)
    rate = np.where(t % 15 == 7, 4.5, 0.15)[None, :] * rng.uniform(0.5, 1.5, (n, 1))
    timers = np.stack([np.where(t % 15 == 3, 5.0, 0.0), np.where(t % 15 == 9, 2.0, 0.0)])
    ids = [*(f"s{k:02d}" for k in range(n)), "timer-a", "timer-b"]
    return Panel.from_wide(ids, np.vstack([rng.poisson(rate).astype(float), timers]), start=START, step="1min")


@pytest.fixture(scope="module")
def tree_ensemble() -> tuple[Ensemble, Panel]:
    """Small LightGBM, XGBoost and RandomForest members with LightGBM quantile heads, fitted on 540 minutes."""
    from forecaster.forecast.trees import RandomForestMember, XGBoostMember

    panel = sparse_burst_panel()
    members = [LightGBMMember(horizon=15, params={"n_estimators": 40}),
               XGBoostMember(horizon=15, params={"n_estimators": 40, "max_depth": 4}),
               RandomForestMember(horizon=15, params={"n_estimators": 5}), MovingAverage(60)]
    ensemble = Ensemble(members, horizon=15, refit=False, p_any="residuals").fit_panel(panel.head(540))
    return ensemble, panel


def served_panel(panel: Panel) -> Panel:
    """The panel's series in another order, one of them twice, and one series the fit never saw."""
    order = np.array([3, 0, 25, 7, 7, 12, 24, 1, *range(13, 20)])
    ids = np.asarray([*panel.ids[order], "unseen"], dtype=object)
    values = np.vstack([panel.values[order], panel.values[5:6] * 2.0])
    return Panel(ids, panel.start, panel.step, values)


@pytest.mark.parametrize("origins, h", [([600], 15), ([560, 575, 600], 15), ([600], 20)])
def test_tree_members_forecast_the_same_numbers_on_shared_feature_rows(tree_ensemble, origins, h) -> None:
    from forecaster.forecast.trees import GlobalTreeMember, SharedFeatures

    ensemble, panel = tree_ensemble
    served = served_panel(panel)
    trees = [m for m in [*ensemble.members_, *ensemble.heads_.values()] if isinstance(m, GlobalTreeMember)]
    assert len(trees) == 5
    shared = SharedFeatures(served, origins, h)
    rng = np.random.default_rng(1)
    for member in trees:  # overlapping subsets: rows built for one member are reused by the next
        rows = np.sort(rng.choice(served.n_series, size=9, replace=False))
        rows[0] = served.n_series - 1  # the unseen series, scaled by what precedes the first origin
        sub = Panel(served.ids[rows], served.start, served.step, served.values[rows])
        own = member.forecast(sub, origins, h)
        np.testing.assert_array_equal(member.forecast_shared(shared, rows), own)
        cells = rng.random(own.shape) < 0.4
        partial = member.forecast_shared(shared, rows, cells)
        np.testing.assert_array_equal(partial[cells], own[cells])
        assert np.isnan(partial[~cells]).all()
    assert len(shared._groups) == 1  # one set of feature rows for all five


def test_ensemble_forecast_is_the_same_without_shared_feature_rows(tree_ensemble, monkeypatch) -> None:
    from forecaster.forecast.trees import SharedFeatures

    ensemble, panel = tree_ensemble
    served = served_panel(panel)
    shared = ensemble.forecast(served, [570, 600], 15, members=True)
    monkeypatch.setattr(SharedFeatures, "fits", classmethod(lambda cls, *args: False))
    own = ensemble.forecast(served, [570, 600], 15, members=True)
    assert shared.keys() == own.keys()
    for column in own:
        np.testing.assert_array_equal(shared[column], own[column], err_msg=column)


def test_lower_head_skips_cells_where_the_point_is_zero_and_its_bound_is_unchanged(tree_ensemble,
                                                                                   monkeypatch) -> None:
    from forecaster.forecast.trees import GlobalTreeMember

    ensemble, panel = tree_ensemble
    head = ensemble.heads_[0.1]
    predicted: list[int] = []
    original = GlobalTreeMember._predict

    def counting(self, features):
        if self is head:
            predicted.append(len(features))
        return original(self, features)

    monkeypatch.setattr(GlobalTreeMember, "_predict", counting)
    arrays = ensemble.forecast(panel, [600], 15)
    point = arrays["ensemble"]
    users = ensemble.head_series_
    zero = point[users] <= 0
    assert 0.2 < zero.mean() < 0.9  # both kinds of cells among the series on the heads
    assert predicted == [int((~zero).sum())]  # the head forecast only where the point is above 0
    # the bound the full head forecast gives, min(point, head + offset) clipped at 0, on every cell of those series
    full = head.forecast(Panel(panel.ids[users], panel.start, panel.step, panel.values[users]), [600], 15)
    offset = ensemble.head_offsets_[0.1][users][:, None, :15, 0]
    assert np.isfinite(offset).all()
    expected = np.clip(np.minimum(point[users], full + offset), 0.0, None)
    np.testing.assert_array_equal(arrays["q0.1"][users], expected)


def test_per_series_tables_follow_the_panel_rows(tree_ensemble) -> None:
    ensemble, panel = tree_ensemble
    own = ensemble._per_series(panel, ensemble.grid_)
    assert np.shares_memory(own, ensemble.grid_) and not own.flags.writeable  # the shard's own series: no copy
    served = served_panel(panel)
    table = ensemble._per_series(served, ensemble.grid_)
    position = pd.Index(panel.ids).get_indexer(served.ids)
    np.testing.assert_array_equal(table[:-1], ensemble.grid_[position[:-1]])
    assert np.isnan(table[-1]).all() and table.flags.writeable  # the unseen series has no residuals
    weights = ensemble._weights_for(served)
    assert (weights[-1] == np.eye(len(ensemble.members_))[-1]).all()  # unseen: the fallback alone


def test_residual_p_any_in_blocks_is_the_one_shot_formula(monkeypatch) -> None:
    import forecaster.forecast.ensemble as ensemble_module
    from forecaster.forecast.ensemble import residual_p_any

    rng = np.random.default_rng(6)
    point = np.where(rng.random((301, 2, 15)) < 0.5, 0.0, rng.gamma(1.0, 2.0, (301, 2, 15)))
    spread = np.sqrt(point + 1.0)
    grid = np.sort(rng.normal(0.0, 1.5, (301, 2, 15, 20)), axis=-1)
    grid[:7] = np.nan  # series without residual quantiles: Poisson
    expected = np.mean(point[..., None] + spread[..., None] * grid >= 0.5, axis=-1)
    expected[:7] = 1.0 - np.exp(-point[:7])
    monkeypatch.setattr(ensemble_module, "RESIDUAL_BLOCK_VALUES", 1300)  # blocks of 2 series, the last of 1
    np.testing.assert_array_equal(residual_p_any(point, spread, grid), expected)
    monkeypatch.setattr(ensemble_module, "RESIDUAL_BLOCK_VALUES", 10**9)  # one block
    np.testing.assert_array_equal(residual_p_any(point, spread, grid), expected)


def test_members_fitted_on_threads_make_the_same_ensemble_number_for_number() -> None:
    """``fit_threads`` changes when members fit, never what they learn: tree members, quantile heads, the LSTM (torch)
    and ARIMA, with refits and a member that fails, fitted one after another and three at once."""
    from forecaster.forecast.arima import ARIMAMember
    from forecaster.forecast.lstm import LSTMMember
    from forecaster.forecast.trees import RandomForestMember, XGBoostMember

    panel = sparse_burst_panel()

    def fitted(threads: int) -> Ensemble:
        members = [LightGBMMember(horizon=15, params={"n_estimators": 30}),
                   XGBoostMember(horizon=15, params={"n_estimators": 30, "max_depth": 4}),
                   RandomForestMember(horizon=15, params={"n_estimators": 5}), Broken(),
                   ARIMAMember(max_series=3, min_mean=0.1), LSTMMember(horizon=15, samples=2000, epochs=2)]
        return Ensemble(members, horizon=15, fit_threads=threads).fit_panel(panel.head(540))

    one, three = fitted(1), fitted(3)
    assert one.member_names_ == three.member_names_ and set(one.heads_) == set(three.heads_) == {0.1, 0.9}
    assert "lstm" in one.member_names_ and "arima" in one.member_names_
    assert one.failures_ == three.failures_ and "broken" in one.failures_
    assert set(one.fit_seconds_) == set(three.fit_seconds_)
    for name in ("weights_", "validation_mae_"):
        np.testing.assert_array_equal(getattr(one, name), getattr(three, name))
    origins = list(range(540, 600, 5))
    a, b = one.forecast(panel, origins, 15), three.forecast(panel, origins, 15)
    assert set(a) == set(b)
    for column in a:
        np.testing.assert_array_equal(a[column], b[column], err_msg=column)


def test_a_failing_member_of_last_resort_raises_its_own_error_with_threads() -> None:
    with pytest.raises(RuntimeError, match="cannot fit"):
        Ensemble([Broken(), Broken()], horizon=10, fallback=False, fit_threads=2).fit_panel(mixed_panel())


class FailsOnRefit(MovingAverage):
    """Fits on the training part of the window, raises on the whole window (the refit)."""

    def __init__(self, most_steps: int):
        super().__init__(30)
        self.most_steps = most_steps

    def _fit(self, panel: Panel) -> None:
        if panel.n_steps > self.most_steps:
            raise RuntimeError("refit refused")
        super()._fit(panel)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_failing_refit_keeps_the_member_fitted_on_the_shorter_window(threads: int) -> None:
    panel = mixed_panel()  # 360 steps; the validation tail is 72, so the members first fit on 288
    ensemble = Ensemble([FailsOnRefit(300), MovingAverage(60)], horizon=10, fit_threads=threads).fit_panel(panel)
    assert ensemble.failures_ == {"moving_average_30 (refit)": "RuntimeError: refit refused"}
    kept = ensemble.members_[0]
    assert isinstance(kept, FailsOnRefit) and kept.panel_.n_steps == 288  # not the half-done refit's panel
    assert ensemble.members_[1].panel_.n_steps == 360
    assert np.isfinite(ensemble.predict(10)["ensemble"]).all()


class Switched(MovingAverage):
    """A moving average whose forecast raises while ``failing`` (a member that breaks after the retrain)."""

    failing = False

    @property
    def name(self) -> str:
        return "switched"

    def _forecast(self, panel: Panel, origins, h):
        if type(self).failing:
            raise RuntimeError("booster corrupted (simulated)")
        return super()._forecast(panel, origins, h)


def test_a_member_failing_at_forecast_time_is_listed_per_call_and_logged_rate_limited(monkeypatch, caplog) -> None:
    from forecaster.forecast import ensemble as module

    clock = [0.0]
    monkeypatch.setattr(module, "member_failure_log", module.FailureLog(interval_s=3600, clock=lambda: clock[0]))
    panel = mixed_panel()
    monkeypatch.setattr(Switched, "failing", False)
    ensemble = Ensemble([Switched(30)], horizon=10).fit_panel(panel)
    ensemble.weights_[:] = [1.0, 0.0]  # every series relies on the member
    monkeypatch.setattr(Switched, "failing", True)
    caplog.set_level("WARNING", logger="forecaster.forecast.ensemble")
    for _ in range(3):  # three runs a minute apart: three failures listed, one warning
        ensemble.forecast(panel, [300], 10)
        assert ensemble.forecast_failures_ == {
            "switched": {"series": panel.n_series, "error": "RuntimeError: booster corrupted (simulated)"}}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "switched" in warnings[0] and "6 series" in warnings[0]
    clock[0] = 3600.0  # an hour on: logged again, with the runs it failed in meanwhile
    ensemble.forecast(panel, [300], 10)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and "2 more time(s)" in warnings[1]
    monkeypatch.setattr(Switched, "failing", False)
    ensemble.forecast(panel, [300], 10)
    assert ensemble.forecast_failures_ == {}  # this run's failures only
