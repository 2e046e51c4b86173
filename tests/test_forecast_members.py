"""The member contract for every member, exact baseline values, no leakage past the origin, input validation."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pytest

from forecaster.forecast.arima import ARIMAMember
from forecaster.forecast.lstm import LSTMMember, pick_device
from forecaster.forecast.members import (
    Fallback,
    MovingAverage,
    Naive,
    NotFittedError,
    SeasonalNaive,
    default_seasons,
)
from forecaster.forecast.panel import ForecastDataError, Panel
from forecaster.forecast.trees import LightGBMMember, RandomForestMember, XGBoostMember

START = pd.Timestamp("2024-03-01 00:00", tz="UTC")
STEPS = 300


def synthetic_panel(n_steps: int = STEPS, seed: int = 7) -> Panel:
    """Ten per-minute series of the kinds the Azure day has, 300 steps each.

    Two 15-minute timers, three Poisson series (rates 3, 8, 20 per minute), two
    intermittent ones, an all-zero one, one with unknown gaps and one that
    starts late (unknown first 200 steps).
    """
    rng = np.random.default_rng(seed)
    t = np.arange(n_steps)
    rows = {
        "timer-a": np.where(t % 15 == 0, 4.0, 0.0),
        "timer-b": np.where(t % 15 == 7, 2.0, 0.0),
        "poisson-3": rng.poisson(3, n_steps).astype(float),
        "poisson-8": rng.poisson(8 + 4 * np.sin(t / 40)).astype(float),
        "poisson-20": rng.poisson(20, n_steps).astype(float),
        "rare-a": (rng.random(n_steps) < 0.05).astype(float),
        "rare-b": rng.poisson(0.3, n_steps).astype(float),
        "zero": np.zeros(n_steps),
        "gappy": rng.poisson(2, n_steps).astype(float),
        "late": rng.poisson(5, n_steps).astype(float),
    }
    rows["gappy"][50:80] = np.nan
    rows["gappy"][-3:] = np.nan
    rows["late"][:200] = np.nan
    return Panel.from_wide(list(rows), np.stack(list(rows.values())), start=START, step="1min")


def member_factories():
    """Every member, in settings small enough for a unit test."""
    small_trees = {"n_estimators": 20}
    return [
        Naive,
        lambda: SeasonalNaive(15),
        lambda: MovingAverage(60),
        lambda: MovingAverage(30, "median"),
        lambda: Fallback(horizon=10, tail=60),
        lambda: LightGBMMember(horizon=10, max_train_rows=3000, params=small_trees),
        lambda: LightGBMMember("recursive", horizon=10, max_train_rows=3000, params=small_trees),
        lambda: XGBoostMember(horizon=10, max_train_rows=3000, params=small_trees),
        lambda: RandomForestMember(horizon=10, max_train_rows=3000, params={"n_estimators": 10}),
        lambda: ARIMAMember(max_series=3, window=200),
        lambda: LSTMMember(horizon=10, lookback=30, hidden=8, samples=256, epochs=1, batch_size=128, device="cpu"),
    ]


MEMBER_IDS = [
    "naive", "seasonal_naive", "moving_average", "moving_median", "fallback", "lightgbm_direct",
    "lightgbm_recursive", "xgboost", "random_forest", "arima", "lstm",
]


@pytest.fixture(scope="module")
def panel() -> Panel:
    return synthetic_panel()


@pytest.fixture(scope="module")
def fit_long(panel: Panel) -> pd.DataFrame:
    return panel.head(240).to_long()


@pytest.fixture(scope="module", params=list(range(len(MEMBER_IDS))), ids=MEMBER_IDS)
def fitted(request, fit_long: pd.DataFrame):
    """(member, what fit returned, an unfitted twin), fitted once per member on the first 240 steps."""
    factory = member_factories()[request.param]
    member = factory()
    return member, member.fit(fit_long), factory()


# ---------------------------------------------------------------------------- the contract


def test_fit_returns_self_and_fitted_state_ends_in_underscore(fitted) -> None:
    member, returned, twin = fitted
    assert returned is member
    fitted_state = [k for k in vars(member) if k.endswith("_")]
    assert "panel_" in fitted_state and len(fitted_state) >= 2
    settings = {k: repr(v) for k, v in vars(member).items() if not k.endswith("_")}
    assert settings == {k: repr(v) for k, v in vars(twin).items()}  # fit never touches settings


def test_a_fitted_member_survives_pickle_with_the_same_forecasts(fitted, panel) -> None:
    """Saved models and shards sent to workers are pickled: every member must come back forecasting the same."""
    import pickle

    member, _, _ = fitted
    expected = member.forecast(panel, [240, 260], 10)
    np.testing.assert_allclose(pickle.loads(pickle.dumps(member)).forecast(panel, [240, 260], 10), expected)


def test_init_only_stores_settings() -> None:
    for factory in member_factories():
        member = factory()
        assert not [k for k in vars(member) if k.endswith("_")], type(member).__name__
        with pytest.raises(NotFittedError):
            member.predict(3)


def test_predict_shape_columns_grid_and_non_negative(fitted, panel: Panel) -> None:
    member = fitted[0]
    out = member.predict(10)
    assert list(out.columns) == ["unique_id", "ds", member.name]
    covered = out["unique_id"].unique()
    expected_series = len(member.covered_) if isinstance(member, ARIMAMember) else panel.n_series
    assert len(covered) == expected_series and len(out) == expected_series * 10
    first = START + pd.Timedelta(minutes=240)
    expected_ds = pd.date_range(first, periods=10, freq="1min")
    for _, group in out.groupby("unique_id"):
        assert list(group["ds"]) == list(expected_ds)
    values = out[member.name].to_numpy()
    assert np.isfinite(values).all() and (values >= 0).all()


def test_predict_with_history_conditions_without_refitting(fitted, panel: Panel) -> None:
    member = fitted[0]
    before = {k: repr(v) for k, v in vars(member).items() if k.endswith("_") and k != "panel_"}
    history = panel.head(270).to_long()
    out = member.predict(5, history=history)
    assert out["ds"].min() == START + pd.Timedelta(minutes=270)
    assert out["ds"].max() == START + pd.Timedelta(minutes=274)
    after = {k: repr(v) for k, v in vars(member).items() if k.endswith("_") and k != "panel_"}
    assert before == after  # parameters untouched
    assert member.panel_.n_steps == 240


def test_forecast_never_reads_past_the_origin(fitted, panel: Panel) -> None:
    member = fitted[0]
    origins = [250, 265, 280]
    clean = member.forecast(panel, origins, 8)
    for k, origin in enumerate(origins):
        tampered = panel.values.copy()
        tampered[:, origin:] = 1e4
        dirty = member.forecast(Panel(panel.ids, panel.start, panel.step, tampered), [origin], 8)
        # equal up to float rounding: batch composition changes the summation order
        np.testing.assert_allclose(clean[:, k, :], dirty[:, 0, :], rtol=1e-6, atol=1e-9)


def test_forecast_shape_and_non_negative(fitted, panel: Panel) -> None:
    member = fitted[0]
    values = member.forecast(panel, [240, 255], 12)  # h beyond the trained horizon of 10
    assert values.shape == (panel.n_series, 2, 12)
    covered = values[~np.isnan(values)]
    assert (covered >= 0).all()
    if not isinstance(member, ARIMAMember):
        assert not np.isnan(values).any()


# ---------------------------------------------------------------------------- exact baseline values


def tiny_panel(values) -> Panel:
    return Panel.from_wide(["s"], np.array([values], dtype=float), start=START, step="1min")


def test_naive_uses_last_observed_value() -> None:
    panel = tiny_panel([1, 5, 2, np.nan, np.nan])
    member = Naive().fit_panel(panel)
    np.testing.assert_array_equal(member.forecast(panel, [5, 2], 3)[0], [[2, 2, 2], [5, 5, 5]])


def test_naive_level_at_a_few_origins_is_the_forward_fill_at_each() -> None:
    from forecaster.forecast.members import _naive_level, last_observed

    rng = np.random.default_rng(4)
    values = rng.poisson(1.0, (7, 50)).astype(float)
    values[rng.random(values.shape) < 0.3] = np.nan  # unknown steps everywhere
    values[1, :40] = np.nan  # a series registered late
    values[2] = np.nan  # one never known
    values[3, 20:] = np.nan  # one gone quiet
    for origins in ([50], [1, 25, 41], [3, 10, 30, 50]):
        expected = np.nan_to_num(last_observed(values)[:, np.asarray(origins) - 1], nan=0.0)
        np.testing.assert_array_equal(_naive_level(values, origins), expected)
    assert _naive_level(values, [40])[1, 0] == 0.0 and _naive_level(values, [50])[3, 0] == values[3, 19]


def test_series_windows_are_running_sums_from_the_first_column() -> None:
    from forecaster.forecast.features import SeriesWindows

    rng = np.random.default_rng(10)
    scaled = rng.poisson(0.7, (5, 300)) / rng.uniform(0.2, 3.0, (5, 1))
    scaled[rng.random(scaled.shape) < 0.1] = np.nan
    windows = SeriesWindows(scaled)
    filled = np.nan_to_num(scaled, nan=0.0)
    zeros = np.zeros((5, 1))
    np.testing.assert_array_equal(windows.csum, np.concatenate([zeros, np.cumsum(filled, axis=1)], axis=1))
    np.testing.assert_array_equal(windows.csq, np.concatenate([zeros, np.cumsum(filled * filled, axis=1)], axis=1))
    np.testing.assert_array_equal(windows.ccount, np.concatenate([zeros, np.cumsum(~np.isnan(scaled), axis=1)], 1))
    np.testing.assert_array_equal(windows.cnonzero, np.concatenate([zeros, np.cumsum(filled > 0, axis=1)], axis=1))
    last = np.maximum.accumulate(np.where(filled > 0, np.arange(300), -(10**9)), axis=1)
    np.testing.assert_array_equal(windows.last_nonzero, last)
    mean, std, nonzero = windows.window_stats(np.arange(5), np.full(5, 250), 60)
    window = scaled[:, 190:250]
    np.testing.assert_allclose(mean, np.nanmean(window, axis=1), rtol=1e-12)
    np.testing.assert_allclose(nonzero, (window > 0).sum(axis=1) / (~np.isnan(window)).sum(axis=1), rtol=1e-15)


def test_features_are_each_float64_value_rounded_once_to_float32() -> None:
    """Level-carrying features are divided by the local level in float64 and then rounded to float32."""
    from forecaster.forecast.features import LEVEL_FLOOR, FeatureSpec, SeriesWindows, build_features

    rng = np.random.default_rng(9)
    values = rng.poisson(rng.uniform(0.05, 8.0, (6, 1)), (6, 600)) / rng.uniform(0.3, 3.0, (6, 1))
    values[1, :500] = np.nan
    spec = FeatureSpec.for_panel(pd.Timedelta(minutes=1), 600, with_horizon=True)
    windows = SeriesWindows(values)
    rows = np.repeat(np.arange(6), 20)
    origin = np.full(120, 580)
    h = np.tile(np.arange(1, 21), 6)
    features, level = build_features(spec, windows, rows, origin, h, 10_000 + origin + h - 1, np.zeros(120),
                                     horizon_cap=15)
    assert features.dtype == np.float32 and features.shape == (120, len(spec.names))
    names = list(spec.names)
    recent = np.array([np.nanmean(values[r, 580 - spec.windows[-1]:580]) for r in rows])
    # the level is a difference of running sums: the window's mean up to rounding
    np.testing.assert_allclose(level, np.maximum(np.nan_to_num(recent, nan=0.0), LEVEL_FLOOR), rtol=1e-12)
    for k in (1, 2, 15):
        expected = (values[rows, 580 - k] / level).astype(np.float32)
        np.testing.assert_array_equal(features[:, names.index(f"lag_{k}")], expected)
    np.testing.assert_array_equal(features[:, names.index("log_local_level")], np.log(level).astype(np.float32))
    np.testing.assert_array_equal(features[:, names.index("h")], np.minimum(h, 15).astype(np.float32))


def test_seasonal_naive_repeats_the_last_season_and_falls_back_to_naive() -> None:
    panel = tiny_panel([1, 2, 3, 4, 5, 6, 7])
    member = SeasonalNaive(3).fit_panel(panel)
    np.testing.assert_array_equal(member.forecast(panel, [7], 5)[0, 0], [5, 6, 7, 5, 6])
    # origin 2: the season before is partly before the start -> last observed value (2)
    np.testing.assert_array_equal(member.forecast(panel, [2], 3)[0, 0], [2, 1, 2])


def test_moving_average_mean_and_median() -> None:
    panel = tiny_panel([0, 0, 9, 1, 2, np.nan])
    assert MovingAverage(4).fit_panel(panel).forecast(panel, [6], 2)[0, 0, 0] == pytest.approx(4.0)
    assert MovingAverage(4, "median").fit_panel(panel).forecast(panel, [6], 2)[0, 0, 0] == pytest.approx(2.0)
    empty = tiny_panel([np.nan, np.nan, 3.0])
    assert MovingAverage(2).fit_panel(empty).forecast(empty, [2], 1)[0, 0, 0] == 0.0


def test_fallback_picks_the_season_of_a_timer_and_a_median_for_noise(panel: Panel) -> None:
    member = Fallback(horizon=10, tail=90).fit_panel(panel.head(240))
    chosen = dict(zip(panel.ids, member.chosen_names_, strict=True))
    assert chosen["timer-a"] == "seasonal_naive_15"
    assert chosen["poisson-20"].startswith("moving_")
    timer = list(panel.ids).index("timer-a")
    forecast = member.forecast(panel, [240], 15)[timer, 0]
    np.testing.assert_array_equal(forecast, panel.values[timer, 240:255])


def test_default_seasons_need_two_full_seasons() -> None:
    assert default_seasons(pd.Timedelta("1min"), 100) == (15, 30)
    assert default_seasons(pd.Timedelta("1min"), 2 * 1440) == (15, 30, 60, 1440)
    assert default_seasons(pd.Timedelta("5min"), 10 * 288) == (3, 6, 12, 288)


def test_global_lightgbm_learns_a_timer_at_every_horizon(panel: Panel) -> None:
    member = LightGBMMember(horizon=15, max_train_rows=5000, params={"n_estimators": 60}).fit_panel(panel.head(240))
    timer = list(panel.ids).index("timer-a")
    forecast = member.forecast(panel, [240, 247], 15)[timer]
    actual = np.stack([panel.values[timer, 240:255], panel.values[timer, 247:262]])
    assert np.abs(forecast - actual).mean() < 0.5


def test_arima_covers_only_the_busiest_series_and_respects_the_time_box(panel: Panel, caplog) -> None:
    member = ARIMAMember(max_series=2, window=200).fit_panel(panel.head(240))
    assert sorted(member.covered_) == ["poisson-20", "poisson-8"]
    with caplog.at_level(logging.WARNING, logger="forecaster.forecast.arima"):
        boxed = ARIMAMember(max_series=5, max_seconds=0.0).fit_panel(panel.head(240))
    assert len(boxed.covered_) == 0 and len(boxed.skipped_) == 5  # over time before the first fit
    assert np.isnan(boxed.forecast(panel, [240], 3)).all() and boxed.predict(3).empty
    assert "5 of 5 series left to the other members" in caplog.text  # a cut fit is never silent


def test_arima_default_order_forecasts_as_statsmodels_does(panel: Panel) -> None:
    """The default order, (2, 0, 1) with a mean on log1p counts (chosen on validation by bench/member_defaults.py),
    forecasts from the end of its window as statsmodels does with the same parameters: the member's own ARMA
    recursion (innovations filter, mean, back-transform) is the d = 0 path, not the (1, 1, 1) one."""
    from statsmodels.tsa.statespace.sarimax import SARIMAX

    member = ARIMAMember(max_series=1, window=240).fit_panel(panel.head(240))
    assert member.order == (2, 0, 1) and member.log_transform
    row = list(panel.ids).index("poisson-20")
    assert member.rows_ == [row]
    y = np.log1p(panel.values[row, :240])
    model = SARIMAX(y, order=(2, 0, 1), trend="c", concentrate_scale=True)
    names = model.param_names
    fitted = dict(zip(names, [0.0] * len(names), strict=True))
    fitted |= {"intercept": member.mu_[0] * (1.0 - member.ar_[0].sum()), "ar.L1": member.ar_[0][0],
               "ar.L2": member.ar_[0][1], "ma.L1": member.ma_[0][0]}
    expected = np.expm1(model.filter([fitted[n] for n in names]).forecast(10))
    forecast = member.forecast(panel, [240], 10)[row, 0]
    np.testing.assert_allclose(forecast, expected, rtol=1e-3)
    assert np.isnan(member.forecast(panel, [240], 10)[np.arange(panel.n_series) != row]).all()


def test_xgboost_default_is_sized_like_lightgbm() -> None:
    """The XGBoost default chosen on validation by bench/member_defaults.py: LightGBM's tree count, learning rate
    and training rows, depth 8 and 256 bins (the former default was depth 6, 200 trees, 250,000 rows, 64 bins)."""
    xgb, lgb = XGBoostMember(), LightGBMMember()
    params, reference = xgb._estimator().get_params(), lgb._estimator().get_params()
    assert (params["max_depth"], params["max_bin"]) == (8, 256)
    assert params["n_estimators"] == reference["n_estimators"] == 300
    assert params["learning_rate"] == reference["learning_rate"] == 0.05
    assert xgb.default_rows == lgb.default_rows == 400_000
    assert XGBoostMember(params={"max_depth": 3})._estimator().get_params()["max_depth"] == 3  # overrides still win


def test_wall_time_caps_are_safety_nets_far_above_a_normal_fit() -> None:
    """The members' results must not depend on the machine's load: a fit is bounded by its own work (epochs,
    series), and the wall-time caps sit far above what that work takes on a loaded 2-core machine."""
    assert ARIMAMember().max_seconds >= 900.0  # (2, 0, 1) took 234 s wall for 50 series at load 5-8
    assert LSTMMember().max_seconds >= 600.0


def test_lstm_cut_by_its_wall_time_cap_says_so(panel: Panel, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="forecaster.forecast.lstm"):
        member = LSTMMember(horizon=10, lookback=30, hidden=8, samples=256, epochs=3, batch_size=128, device="cpu",
                            max_seconds=0.0).fit_panel(panel.head(240))
    assert member.epochs_run_ == 1
    assert "1 of 3 epochs" in caplog.text


def test_lstm_picks_cuda_only_when_available(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device() == "cuda"
    assert pick_device("cpu") == "cpu"


# ---------------------------------------------------------------------------- input validation


def test_from_long_round_trips_and_marks_missing_steps_unknown(panel: Panel) -> None:
    long = panel.to_long()
    back = Panel.from_long(long.dropna(subset=["y"]).sample(frac=1.0, random_state=0))
    assert list(back.ids) == list(panel.ids) and back.step == pd.Timedelta("1min")
    np.testing.assert_array_equal(back.values, panel.values)  # dropped rows come back as NaN


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda df: df.drop(columns=["y"]), "missing column"),
        (lambda df: pd.concat([df, df.head(1)]), "duplicate row"),
        (lambda df: df.assign(y=np.where(np.arange(len(df)) == 3, -1.0, df["y"])), "negative"),
        (lambda df: df.assign(ds=df["ds"] + pd.to_timedelta(np.where(np.arange(len(df)) == 5, 30, 0), unit="s")),
         "not on the"),
        (lambda df: df.assign(y=df["y"].astype(object).where(np.arange(len(df)) != 2, "x")), "not numeric"),
        (lambda df: df.iloc[:0], "no rows"),
    ],
)
def test_from_long_rejects_bad_input_with_a_clear_message(mutate, message) -> None:
    good = tiny_panel([1, 2, 3, 4, 5, 6]).to_long()
    with pytest.raises(ForecastDataError, match=message):
        Panel.from_long(mutate(good))
