"""Protocol v2 forecast metrics (EVALUATION.md section 1, "Protocol v2 additions"), with values computed by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from forecaster.contracts.forecast import p_any_from_quantiles
from forecaster.forecast.backtest import (
    MethodForecasts,
    Protocol,
    evaluate,
    fit_window,
    generic_protocol,
    p_any_baselines,
    run_backtest,
)
from forecaster.forecast.members import Naive
from forecaster.forecast.panel import Panel

START = pd.Timestamp("2024-03-01 00:00", tz="UTC")
PROTOCOL = Protocol("hand2", 4, (4, 6), 2, 5.0, None, (1, 2))


def hand_panel() -> Panel:
    """Three 5-minute series, fit on 4 steps, origins 4 and 6, horizons 1..2.

    ``a`` = 1 0 2 0 | 3 0 1 4  (active in test, scale 5/3)
    ``b`` = 2 2 2 3 | 2 3 6 2  (active, scale 1/3; 6 at t=6 is a spike)
    ``q`` = 0 1 0 1 | 0 0 0 0  (silent in the test window, scale 1)
    """
    values = np.array([[1, 0, 2, 0, 3, 0, 1, 4], [2, 2, 2, 3, 2, 3, 6, 2], [0, 1, 0, 1, 0, 0, 0, 0]], dtype=float)
    return Panel.from_wide(["a", "b", "q"], values, start=START, step="5min")


def const(values) -> np.ndarray:
    """Per-series constant ``(3, 2, 2)``."""
    return np.stack([np.full((2, 2), float(v)) for v in values])


def hand_forecasts(p_any: np.ndarray | None = None) -> MethodForecasts:
    # a: q0.1 0, point 1, q0.9 3, q0.99 4; b: 1, 2, 3, 5; q: 0, 0, 1, 1
    return MethodForecasts(const([1, 2, 0]), const([0, 1, 0]), const([3, 3, 1]), 1.0, q99=const([4, 5, 1]),
                           p_any=p_any)


@pytest.fixture
def summary() -> pd.Series:
    result = evaluate(hand_panel(), PROTOCOL, {"m": hand_forecasts()})
    return result.summary.set_index("subset").loc["all"]


def test_mase_median_active_leaves_out_series_silent_in_the_test_window(summary) -> None:
    # MAE: a |3,0,1,4 - 1| = 2,1,0,3 -> 1.5; b |2,3,6,2 - 2| = 0,1,4,0 -> 1.25; q 0
    # MASE: a 1.5 / (5/3) = 0.9, b 1.25 / (1/3) = 3.75, q 0
    assert summary["mase_median"] == pytest.approx(0.9)  # v1: all three
    assert summary["mase_median_active"] == pytest.approx((0.9 + 3.75) / 2)  # q is silent in test
    assert summary["active_series"] == 2 and summary["mase_active_skipped"] == 0
    # per horizon, active only: h=1 a (2+0)/2/(5/3) = 0.6, b (0+4)/2*3 = 6; h=2 a (1+3)/2*0.6 = 1.2, b (1+0)/2*3
    assert summary["mase_active_h1"] == pytest.approx((0.6 + 6.0) / 2)
    assert summary["mase_active_h2"] == pytest.approx((1.2 + 1.5) / 2)


def test_per_horizon_wql_pooled_over_the_subset(summary) -> None:
    # h=1 points (t=4, t=6): a 3, 1; b 2, 6; q 0, 0; sum |actual| = 12
    # pinball q0.1: a .3 + .1, b .1 + .5 -> 1.0; q0.5: a 1 + 0, b 0 + 2 -> 3.0;
    # q0.9: a 0 + .2, b .1 + 2.7, q .1 + .1 -> 3.2
    assert summary["wql_h1"] == pytest.approx(np.mean([2 * 1.0 / 12, 2 * 3.0 / 12, 2 * 3.2 / 12]))
    assert summary["wql_h1"] == pytest.approx(0.4)


def test_coverage_bracket_strict_and_inclusive_and_q99(summary) -> None:
    # q0.9: a 3 | 3 0 1 4 -> <= 3, < 2 (3 is on the bound); b 3 | 2 3 6 2 -> <= 3, < 2; q 1 | 0 0 0 0 -> 4 and 4
    assert summary["coverage_q90"] == pytest.approx(10 / 12)
    assert summary["coverage_q90_strict"] == pytest.approx(8 / 12)
    # q0.99: a 4 covers all four, b 5 misses the 6, q 1 covers all
    assert summary["coverage_q99"] == pytest.approx(11 / 12)


def test_spike_recall_q99_uses_the_same_spikes(summary) -> None:
    # one spike: b at t=6, 6 > 2 x mean(2 2 2 3 2 3) = 4.67 and 6 >= 5; q0.9 3 < 4.8 misses, q0.99 5 >= 4.8 hits
    assert summary["spikes"] == 1
    assert summary["spike_recall"] == 0.0 and summary["spike_recall_q99"] == 1.0


def test_brier_any_from_quantiles_as_the_planner_does(summary) -> None:
    # levels 0.1 0.5 0.9 0.99: a 0 1 3 4 -> highest zero level 0.1 -> 0.9; q 0 0 1 1 -> 0.5;
    # b 1 2 3 5 -> no zero level: the planner's 1 - 0.1 / 2 = 0.95
    # a events 1 0 1 1 -> 3 x 0.01 + 0.81; q events 0 0 0 0 -> 4 x 0.25; b events 1 1 1 1 -> 4 x 0.0025
    assert summary["brier_any"] == pytest.approx((0.84 + 1.0 + 0.01) / 12)
    fc = hand_forecasts()
    levels = np.array([0.1, 0.5, 0.9, 0.99])
    np.testing.assert_allclose(fc.derived_p_any()[:, 0, 0], p_any_from_quantiles(levels, np.array(
        [[0, 1, 3, 4], [1, 2, 3, 5], [0, 0, 1, 1]], dtype=float)))


def test_brier_any_uses_the_methods_own_p_any() -> None:
    p = np.full((3, 2, 2), 0.5)
    p[1] = 1.0  # b is always busy: no error there
    result = evaluate(hand_panel(), PROTOCOL, {"m": hand_forecasts(p_any=p)})
    row = result.summary.set_index("subset").loc["all"]
    assert row["brier_any"] == pytest.approx(8 * 0.25 / 12)


def test_brier_baselines_climatology_and_recent_hour(summary) -> None:
    # climatology (fit steps 0..3): a 2/4, b 4/4, q 2/4
    # a: 0.5 vs events 1 0 1 1 -> 4 x 0.25; b: 1 vs all 1 -> 0; q: 0.5 vs all 0 -> 1.0
    assert summary["brier_any_climatology"] == pytest.approx(2.0 / 12)
    # recent (12 steps = all steps before the origin): origin 4 a 0.5, b 1, q 0.5;
    # origin 6 a 1 0 2 0 3 0 -> 0.5, b 1, q 0 1 0 1 0 0 -> 1/3
    # a 1.0; b 0; q 2 x 0.25 + 2 x 1/9
    assert summary["brier_any_recent"] == pytest.approx((1.0 + 0.5 + 2 / 9) / 12)
    base = p_any_baselines(hand_panel(), PROTOCOL)
    assert base["recent"][2, 1, 0] == pytest.approx(1 / 3) and base["climatology"][1, 0, 1] == 1.0


def test_recent_baseline_looks_back_one_hour_only() -> None:
    # per-minute: the hour before origin 100 is steps 40..99; a burst before step 40 does not count
    values = np.zeros((1, 130))
    values[0, :40] = 1.0
    values[0, 90:95] = 2.0
    panel = Panel.from_wide(["x"], values, start=START, step="1min")
    protocol = Protocol("m", 100, (100,), 15, 1.0, None, (1, 5, 15))
    base = p_any_baselines(panel, protocol)
    assert base["recent"][0, 0, 0] == pytest.approx(5 / 60)
    assert base["climatology"][0, 0, 0] == pytest.approx(45 / 100)


def test_a_method_without_q99_has_no_q99_metrics() -> None:
    fc = hand_forecasts()
    fc.q99 = None
    row = evaluate(hand_panel(), PROTOCOL, {"m": fc}).summary.set_index("subset").loc["all"]
    assert np.isnan(row["coverage_q99"]) and np.isnan(row["spike_recall_q99"])
    # p_any from the levels it has (0.1 0.5 0.9): b still has no zero level
    assert row["brier_any"] == pytest.approx((0.84 + 1.0 + 0.01) / 12)


def test_fit_window_bound_keeps_the_last_steps_and_moves_the_start() -> None:
    rng = np.random.default_rng(0)
    panel = Panel.from_wide(["a", "b"], rng.poisson(2, (2, 500)).astype(float), start=START, step="1min")
    protocol = generic_protocol(panel.n_steps, 1.0)
    window = fit_window(panel, protocol, 120)
    assert window.n_steps == 120 and window.start == START + (protocol.fit_steps - 120) * pd.Timedelta("1min")
    np.testing.assert_array_equal(window.values, panel.values[:, protocol.fit_steps - 120 : protocol.fit_steps])
    assert fit_window(panel, protocol, None).n_steps == protocol.fit_steps
    model = Naive()
    run_backtest(model, panel, protocol, max_fit_steps=120)
    assert model.panel_.n_steps == 120
