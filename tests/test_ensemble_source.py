"""The ensemble as a causal forecast source for replays: causality across retrains, the schedule, the frame."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from forecaster.contracts.forecast import FORECAST_LEVELS, ForecastSource, validate_forecast
from forecaster.forecast.ensemble import Ensemble
from forecaster.forecast.sharded import ShardedEnsemble, production_model
from forecaster.forecast.trees import LightGBMMember
from forecaster.planning.ensemble_source import EnsembleForecast
from forecaster.planning.forecasts import CountPanel
from forecaster.settings import Settings

START = pd.Timestamp("2019-07-15", tz="UTC")
SETTINGS = Settings.model_construct(forecast_horizon_min=15)  # defaults otherwise; min_train_min = 60
LEVEL_COLUMNS = ["q0.1", "q0.5", "q0.9", "q0.95", "q0.99"]


def replay_panel(minutes: int = 600, seed: int = 11) -> CountPanel:
    """12 timers (every 5/15/30 minutes), 12 Poisson series with a daily-ish swing, 6 bursty ones."""
    rng = np.random.default_rng(seed)
    t = np.arange(minutes)
    rows = []
    for k in range(12):
        period = (5, 15, 30)[k % 3]
        rows.append(np.where(t % period == k % period, 1 + k % 4, 0))
    for k in range(12):
        rate = (0.3 + k) * (1.2 + np.sin(2 * np.pi * t / 480 + k))
        rows.append(rng.poisson(rate))
    for _ in range(6):
        on = rng.random(minutes) < 0.03
        rows.append(np.where(on, rng.poisson(20, minutes), 0))
    ids = np.array([f"m{k:02d}" for k in range(len(rows))], dtype=object)
    return CountPanel(ids=ids, start=START, counts=np.asarray(rows, dtype=np.float64))


def small_lightgbm() -> LightGBMMember:
    """A LightGBM with lags and rolling windows (the features that could peek), small enough for a test."""
    return LightGBMMember(horizon=15, max_train_rows=4000, params={"n_estimators": 15, "num_leaves": 15,
                                                                   "min_child_samples": 10})


def source(panel: CountPanel, **kwargs) -> EnsembleForecast:
    options = {"train_until_min": 240, "retrain_every_min": 120, "members": [small_lightgbm()],
               "settings": SETTINGS, "horizon_min": 10} | kwargs
    return EnsembleForecast(panel, **options)


def at(minute: int):
    return (START + pd.Timedelta(minutes=minute)).to_pydatetime()


def test_frames_up_to_t_ignore_every_count_at_and_after_t_across_a_retrain():
    panel = replay_panel()
    t = 400  # after the fits at 240 and 360, before the one at 480
    altered_counts = panel.counts.copy()
    rng = np.random.default_rng(3)
    altered_counts[:, t:] = rng.poisson(50.0, altered_counts[:, t:].shape)
    altered = CountPanel(ids=panel.ids, start=panel.start, counts=altered_counts)
    nows = [100, 239, 240, 241, 300, 359, 360, 361, 399, 400]
    original, changed = source(panel), source(altered)
    one_by_one = source(altered, block_min=1)  # single-origin forecasts: what blocks must reproduce
    for minute in nows:
        expected = original.quantiles(at(minute), 10)
        pd.testing.assert_frame_equal(changed.quantiles(at(minute), 10), expected, check_exact=True)
        pd.testing.assert_frame_equal(one_by_one.quantiles(at(minute), 10), expected, check_exact=True)
    assert original.retrain_minutes == changed.retrain_minutes == [240, 360]
    # the alteration is visible from the next minute on: the source does read the latest counts
    after = [original.quantiles(at(m), 10)["q0.9"].to_numpy() for m in (401, 410)]
    assert not np.array_equal(after[0], changed.quantiles(at(401), 10)["q0.9"].to_numpy())
    assert not np.array_equal(after[1], changed.quantiles(at(410), 10)["q0.9"].to_numpy())


def test_retrains_follow_the_schedule_in_simulated_time():
    panel = replay_panel()
    replay = source(panel, members=[])  # the fallback alone: the schedule, not the model, is under test
    for minute in range(panel.n_minutes):
        replay.quantiles(at(minute), 10)
    assert replay.retrains == 3 and replay.retrain_minutes == [240, 360, 480]
    assert len(replay.fit_seconds) == 3 and replay.empirical_calls == 240  # minutes 0..239: before the first fit
    assert [set(m) for m in replay.member_fit_seconds] == [{"fallback"}] * 3
    assert replay.forecast_origins == 600 - 240  # every later minute forecast once, in blocks
    # a second policy replaying the same trace reuses the fits and the cached forecasts
    for minute in range(0, panel.n_minutes, 7):
        replay.quantiles(at(minute), 10)
    assert replay.retrains == 3 and replay.forecast_origins == 360
    # the default interval on a day: the warm-up end, then every 6 simulated hours
    day = CountPanel(ids=panel.ids, start=START, counts=np.zeros((len(panel.ids), 1440)))
    assert EnsembleForecast(day, train_until_min=240, settings=SETTINGS).schedule == [240, 600, 960, 1320]
    # too little history for a fit (4 x the 15-minute horizon): skipped, and the empirical source answers
    early = EnsembleForecast(day, train_until_min=30, retrain_every_min=45, settings=SETTINGS)
    assert early.skipped_retrains == [30] and early.schedule[:2] == [75, 120]
    assert early.fit_minute(74) is None and early.fit_minute(75) == 75 and early.fit_minute(119) == 75


def test_frames_follow_the_contract_with_ordered_levels_and_p_any():
    panel = replay_panel()
    replay = source(panel)
    assert isinstance(replay, ForecastSource) and replay.name == replay.forecaster == "ensemble"
    for minute in (10, 239, 240, 333, 599, 600):  # empirical, first fitted minute, later, the last origins
        frame = replay.quantiles(at(minute), 10)
        levels = validate_forecast(frame)
        assert [c for _, c in levels] == LEVEL_COLUMNS
        assert len(frame) == len(panel.ids) * 10 and frame["ds"].iloc[0] == START + pd.Timedelta(minutes=minute)
        values = frame[LEVEL_COLUMNS].to_numpy()
        assert (np.diff(values, axis=1) >= 0).all()
        assert frame["p_any"].between(0.0, 1.0).all()
    # the ensemble's p_any follows the data: a 30-minute timer that fired at 332 is not due at 333, the
    # busiest Poisson series (rate >= 2.3 per minute) almost surely is
    frame = replay.quantiles(at(333), 1).set_index("unique_id")
    assert frame.loc["m02", "p_any"] < 0.1 and frame.loc["m23", "p_any"] > 0.9
    # fits are made when first needed: no call fell in 360..479
    assert replay.report()["retrain_minutes"] == [240, 480] and replay.report()["empirical_calls"] == 2


def test_default_model_is_the_production_factory():
    model = production_model(Settings.model_construct())
    shard = model.factory()
    assert isinstance(model, ShardedEnsemble) and model.shard_max_series == 5000
    assert isinstance(shard, Ensemble) and shard.members is None  # None = default_members() at fit
    assert shard.horizon == 60 and shard.quantiles == FORECAST_LEVELS
    assert shard.weighting == "shrunk"
    assert production_model(Settings.model_construct(forecast_weighting="best")).factory().weighting == "best"
    assert shard.families == ("lightgbm", "xgboost", "random_forest", "arima", "lstm")
    assert production_model(Settings.model_construct(forecast_members="arima,xgboost")).factory().families == (
        "xgboost", "arima")
    replay = EnsembleForecast(replay_panel(), train_until_min=240)
    assert replay.members is None and replay.levels == FORECAST_LEVELS and replay.min_train_min == 240


def test_a_longer_horizon_than_cached_recomputes_and_a_minute_outside_is_refused():
    panel = replay_panel(minutes=400)
    replay = source(panel, members=[], horizon_min=5)
    short = replay.quantiles(at(300), 5)
    longer = replay.quantiles(at(300), 12)
    assert replay.horizon_min == 12 and len(longer) == len(panel.ids) * 12
    head = longer.groupby("unique_id").head(5).reset_index(drop=True)
    pd.testing.assert_frame_equal(head, short)
    with pytest.raises(ValueError, match="outside the replay"):
        replay.quantiles(at(401), 5)
