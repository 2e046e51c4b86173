"""Backtest: origins exactly as EVALUATION.md section 1 says, and metric values computed by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from forecaster.forecast.backtest import (
    MethodForecasts,
    Protocol,
    azure_protocol,
    evaluate,
    generic_protocol,
    huawei_protocol,
    pinball,
    run_backtest,
)
from forecaster.forecast.ensemble import Ensemble
from forecaster.forecast.members import MovingAverage, Naive
from forecaster.forecast.panel import Panel

START = pd.Timestamp("2024-03-01 00:00", tz="UTC")


# ---------------------------------------------------------------------------- origins


def test_azure_origins_are_1080_to_1425_every_15_and_tile_the_test_period() -> None:
    protocol = azure_protocol(1440)
    assert protocol.fit_steps == 1080 and protocol.horizon == 15
    assert protocol.origins == tuple(range(1080, 1426, 15))
    assert len(protocol.origins) == 24 and protocol.origins[-1] == 1425
    targets = [o + h for o in protocol.origins for h in range(protocol.horizon)]
    assert sorted(targets) == list(range(1080, 1440))  # every test step exactly once
    assert protocol.season is None and protocol.report_horizons == (1, 5, 15)
    assert protocol.spike_min_h == 5 and protocol.spike_window == 60 and protocol.busy_threshold == 1.0


def test_huawei_origins_every_12_steps_from_day_24() -> None:
    protocol = huawei_protocol(8640)
    assert protocol.fit_steps == 6624 and protocol.horizon == 12 and protocol.season == 288
    assert protocol.origins[0] == 6624 and np.all(np.diff(protocol.origins) == 12)
    assert protocol.origins[-1] + 12 <= 8640 and protocol.origins[-1] + 24 > 8640
    assert len(protocol.origins) == 168
    assert protocol.spike_min_h == 1 and protocol.spike_window == 12 and protocol.busy_threshold == 5.0


def test_generic_protocol_holds_out_the_last_fifth_with_hourly_origins() -> None:
    minute = generic_protocol(1001, 1.0)
    assert minute.fit_steps == 1001 - 201  # ceil(0.2 * 1001) = 201
    assert minute.origins == (800, 860, 920, 980) and minute.horizon == 15 and minute.season is None
    five = generic_protocol(288 * 10, 5.0)
    assert five.fit_steps == 2880 - 576 and five.horizon == 12 and five.season == 288
    assert np.all(np.diff(five.origins) == 12)


# ---------------------------------------------------------------------------- metrics by hand


@pytest.fixture
def hand_case():
    """Two 5-minute series, fit on 4 steps, origins 4 and 6, horizons 1..2.

    Series ``s`` = 1 3 2 4 | 5 1 2 6: point 3, q0.1 1, q0.9 5 everywhere.
    Series ``z`` = 0 0 0 0 | 0 0 0 10: point 0, q0.1 0, q0.9 1 (constant fit: MASE skipped).
    """
    values = np.array([[1, 3, 2, 4, 5, 1, 2, 6], [0, 0, 0, 0, 0, 0, 0, 10]], dtype=float)
    panel = Panel.from_wide(["s", "z"], values, start=START, step="5min")
    protocol = Protocol("hand", 4, (4, 6), 2, 5.0, None, (1, 2))
    shape = (2, 2, 2)
    forecasts = MethodForecasts(
        point=np.stack([np.full(shape[1:], 3.0), np.zeros(shape[1:])]),
        q10=np.stack([np.full(shape[1:], 1.0), np.zeros(shape[1:])]),
        q90=np.stack([np.full(shape[1:], 5.0), np.ones(shape[1:])]),
        seconds=2.0,
    )
    return evaluate(panel, protocol, {"m": forecasts})


def test_pinball_loss() -> None:
    assert pinball(np.array([5.0]), np.array([1.0]), 0.1)[0] == pytest.approx(0.4)
    assert pinball(np.array([1.0]), np.array([5.0]), 0.9)[0] == pytest.approx(0.4)


def test_mase_per_series_and_per_horizon_by_hand(hand_case) -> None:
    table = hand_case.table.set_index(["unique_id", "h"])
    # s: errors |5-3|=2 (o=4,h=1), |1-3|=2 (o=4,h=2), |2-3|=1 (o=6,h=1), |6-3|=3 (o=6,h=2)
    # scale = mean |diff(1 3 2 4)| = (2 + 1 + 2) / 3
    scale = 5 / 3
    assert table.loc[("s", 1), "mae"] == pytest.approx(1.5)
    assert table.loc[("s", 2), "mae"] == pytest.approx(2.5)
    assert table.loc[("s", 1), "mase"] == pytest.approx(1.5 / scale)
    assert np.isnan(table.loc[("z", 1), "mase"])
    summary = hand_case.summary.set_index("subset").loc["all"]
    assert summary["mase_median"] == pytest.approx(2.0 / scale)  # only s has a scale
    assert summary["mase"] == pytest.approx(2.0 / scale)
    assert summary["mase_h1"] == pytest.approx(1.5 / scale) and summary["mase_h2"] == pytest.approx(2.5 / scale)
    assert summary["mase_skipped"] == 1 and summary["series"] == 2
    assert summary["mae"] == pytest.approx((8 + 10) / 8)


def test_weighted_quantile_loss_coverage_and_spike_recall_by_hand(hand_case) -> None:
    summary = hand_case.summary.set_index("subset").loc["all"]
    # s: pinball q0.1 of (5,1,2,6) vs 1 = .4 + 0 + .1 + .5 = 1.0; q0.5 vs 3 = 1 + 1 + .5 + 1.5 = 4.0;
    #    q0.9 vs 5 = 0 + .4 + .3 + .9 = 1.6
    # z: actual (0,0,0,10): q0.1 vs 0 = 1.0; q0.5 vs 0 = 5.0; q0.9 vs 1 = .1*3 + 8.1 = ... computed below
    z_q90 = 3 * 0.1 * 1 + 0.9 * 9
    total = 14 + 10
    assert summary["wql_q0.1"] == pytest.approx(2 * (1.0 + 1.0) / total)
    assert summary["wql_q0.5"] == pytest.approx(2 * (4.0 + 5.0) / total)
    assert summary["wql_q0.9"] == pytest.approx(2 * (1.6 + z_q90) / total)
    assert summary["wql"] == pytest.approx(2 * (2.0 + 9.0 + 1.6 + z_q90) / total / 3)
    # covered: s 5,1,2 yes, 6 no; z 0,0,0 yes, 10 no
    assert summary["coverage_q90"] == pytest.approx(6 / 8)
    # spikes (5-minute data: every horizon counts; trailing hour = 12 steps = all before):
    # s at t=7: 6 > 2 * mean(1 3 2 4 5 1 2) = 5.14 and 6 >= 5 -> spike, q0.9 = 5 >= 4.8 -> hit
    # s at t=4: 5 > 2 * 2.5 fails (not strictly greater); z at t=7: 10 > 0 -> spike, q0.9 = 1 -> miss
    assert summary["spikes"] == 2 and summary["spike_recall"] == pytest.approx(0.5)
    assert summary["seconds_per_1000_series"] == pytest.approx(1000.0)
    table = hand_case.table.set_index(["unique_id", "h"])
    assert table.loc[("s", 2), "spikes"] == 1 and table.loc[("s", 2), "spike_recall"] == 1.0
    assert table.loc[("s", 1), "wql"] == pytest.approx(2 * ((0.4 + 0.1) + (1 + 0.5) + (0 + 0.3)) / 3 / 7)


def test_busy_subset_is_chosen_from_the_fit_window(hand_case) -> None:
    busy = hand_case.summary.set_index("subset").loc["busy"]
    assert busy["series"] == 0  # 5-minute data: busy means a fit mean >= 5 per step; s has 2.5


def test_spikes_only_count_forecasts_five_minutes_ahead() -> None:
    values = np.zeros((1, 40))
    values[0, 29] = values[0, 37] = 9.0  # h=4 from origin 26 (too close) and h=6 from origin 32
    values[0, 33] = 4.0  # > 2 x trailing mean but below 5 invocations: not a spike
    panel = Panel.from_wide(["a"], values, start=START, step="1min")
    protocol = Protocol("m", 20, (26, 32), 6, 1.0, None, (1,))
    forecasts = {"m": MethodForecasts(np.zeros((1, 2, 6)), np.zeros((1, 2, 6)), np.full((1, 2, 6), 7.0))}
    summary = evaluate(panel, protocol, forecasts).summary.set_index("subset").loc["all"]
    assert summary["spikes"] == 1 and summary["spike_recall"] == 0.0  # 7 < 0.8 x 9


# ---------------------------------------------------------------------------- running


def small_panel() -> Panel:
    rng = np.random.default_rng(2)
    t = np.arange(400)
    values = np.stack([np.where(t % 15 == 0, 3.0, 0.0), rng.poisson(4, 400), rng.poisson(0.2, 400)]).astype(float)
    return Panel.from_wide(["timer", "busy", "rare"], values, start=START, step="1min")


def test_run_backtest_fits_once_on_the_fit_window_and_never_sees_later_data() -> None:
    panel = small_panel()
    protocol = generic_protocol(panel.n_steps, 1.0)
    ensemble = Ensemble([MovingAverage(30), Naive()], horizon=protocol.horizon)
    clean = run_backtest(ensemble, panel, protocol, members=True)
    assert ensemble.panel_.n_steps == protocol.fit_steps
    assert all(m.panel_.n_steps == protocol.fit_steps for m in ensemble.members_)
    assert set(clean) == {"ensemble", "moving_average_30", "naive", "fallback"}
    assert clean["ensemble"].point.shape == (3, len(protocol.origins), protocol.horizon)

    tampered = panel.values.copy()
    tampered[:, protocol.origins[1] :] = 50.0
    dirty = run_backtest(
        Ensemble([MovingAverage(30), Naive()], horizon=protocol.horizon),
        Panel(panel.ids, panel.start, panel.step, tampered),
        protocol,
    )
    np.testing.assert_array_equal(clean["ensemble"].point[:, 0], dirty["ensemble"].point[:, 0])
    np.testing.assert_array_equal(clean["ensemble"].q90[:, 0], dirty["ensemble"].q90[:, 0])


def test_peer_with_empirical_intervals_and_a_plain_member() -> None:
    panel = small_panel()
    protocol = generic_protocol(panel.n_steps, 1.0)
    peer = run_backtest(Ensemble([Naive()], horizon=15, fallback=False, refit=False), panel, protocol)["ensemble"]
    assert peer.q10 is not None and (peer.q10 <= peer.point).all() and (peer.point <= peer.q90).all()
    plain = run_backtest(Naive(), panel, protocol)
    assert set(plain) == {"naive"} and plain["naive"].q90 is None
    result = evaluate(panel, protocol, {"naive": plain["naive"], "naive_interval": peer})
    summary = result.summary.set_index(["method", "subset"])
    assert np.isnan(summary.loc[("naive", "all"), "coverage_q90"])
    assert summary.loc[("naive_interval", "all"), "mase_median"] == pytest.approx(
        summary.loc[("naive", "all"), "mase_median"]
    )
    assert len(result.table) == 2 * 3 * protocol.horizon
