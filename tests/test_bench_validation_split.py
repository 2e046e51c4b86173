"""bench/validation_split.py: the member benchmarks score on exactly the ensemble's validation split."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bench import validation_split as vs
from forecaster.forecast.ensemble import Ensemble
from forecaster.forecast.members import MovingAverage, Naive
from forecaster.forecast.panel import Panel

START = pd.Timestamp("2024-03-01 00:00", tz="UTC")
TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def small_panel(n_steps: int = 400) -> Panel:
    rng = np.random.default_rng(7)
    t = np.arange(n_steps)
    values = np.stack([np.where(t % 15 == 0, 3.0, 0.0), rng.poisson(4, n_steps), rng.poisson(0.3, n_steps),
                       np.zeros(n_steps)]).astype(float)
    return Panel.from_wide(["a_timer", "b_busy", "c_rare", "d_idle"], values, start=START, step="1min")


@pytest.mark.parametrize("horizon", [15, 60])
def test_split_is_the_ensembles_own(horizon: int) -> None:
    panel = small_panel()
    split = vs.make_split(panel, horizon)
    ensemble = Ensemble([Naive()], horizon=horizon, refit=False, quantile_heads=False).fit_panel(panel)
    assert split.origins == ensemble.validation_origins_
    assert split.train.n_steps == panel.n_steps - vs.validation_tail_steps(panel.n_steps, horizon)
    assert split.origins[0] == split.train.n_steps and split.origins[-1] + horizon <= panel.n_steps
    # the fallback's per-series MAE is the one the ensemble weighs its members against
    fallback = ensemble.member_names_.index("fallback")
    np.testing.assert_allclose(split.fallback_mae, ensemble.validation_mae_[:, fallback])
    naive = ensemble.member_names_.index("naive")
    np.testing.assert_allclose(vs.member_mae(split, Naive().fit_panel(split.train)), ensemble.validation_mae_[:, naive])


def test_tail_formula() -> None:
    assert vs.validation_tail_steps(1080) == 240  # Azure: max(240, 216)
    assert vs.validation_tail_steps(864) == 240  # Huawei's last 3 days
    assert vs.validation_tail_steps(2880) == 576  # two days: T // 5
    assert vs.validation_tail_steps(300) == 150  # short: T // 2
    assert vs.validation_stride() == 12


def test_summary_relative_and_active_series() -> None:
    panel = small_panel()
    split = vs.make_split(panel, 15)
    mae = vs.member_mae(split, MovingAverage(60).fit_panel(split.train))
    out = vs.summary(split, mae)
    assert out["series"] == 4
    assert out["mae_mean"] == pytest.approx(mae.mean())
    # the timer (forecast exactly by the fallback's 15-minute seasonal naive) and the idle series have a fallback
    # MAE of 0 and are left out of the relative figure
    ok = split.fallback_mae > 0
    assert ok.tolist() == [False, True, True, False] and out["rel_series"] == 2
    assert out["mae_rel_fallback"] == pytest.approx(np.mean(mae[ok] / split.fallback_mae[ok]))
    assert not split.active[3] and out["active_series"] == 3
    # a member that leaves a series NaN (ARIMA on quiet series) is scored on the series it covers
    mae[1] = np.nan
    covered = vs.summary(split, mae)
    assert covered["series"] == 3 and covered["rel_series"] == 1
    assert vs.summary(split, mae, rows=np.array([True, False, False, False]))["series"] == 1


def test_huawei_fit_window_is_its_last_three_days() -> None:
    from bench.accuracy import DATASETS, load_panel

    if not (TRACES / DATASETS["huawei_dc4"][0]).exists():
        pytest.skip("Huawei trace not available")
    window = vs.load_fit_window("huawei_dc4", TRACES)
    full = load_panel(TRACES / DATASETS["huawei_dc4"][0], DATASETS["huawei_dc4"][1])
    assert window.n_steps == 3 * 288
    assert window.start == full.start + (23 * 288 - 864) * full.step
    np.testing.assert_array_equal(window.values, full.values[:, 23 * 288 - 864 : 23 * 288])
