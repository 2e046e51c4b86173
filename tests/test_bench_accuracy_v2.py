"""bench/accuracy.py protocol v2 pieces: targets, member ablation, nested-validation --select (small members)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from bench import accuracy
from forecaster.forecast.backtest import azure_protocol, evaluate, generic_protocol, run_backtest
from forecaster.forecast.ensemble import Ensemble
from forecaster.forecast.members import MovingAverage, Naive
from forecaster.forecast.panel import Panel

START = pd.Timestamp("2024-03-01 00:00", tz="UTC")


def small_panel(n_steps: int = 400) -> Panel:
    rng = np.random.default_rng(4)
    t = np.arange(n_steps)
    values = np.stack([np.where(t % 15 == 0, 3.0, 0.0), rng.poisson(4, n_steps), rng.poisson(0.3, n_steps),
                       np.zeros(n_steps)]).astype(float)
    return Panel.from_wide(["a_timer", "b_busy", "c_rare", "d_idle"], values, start=START, step="1min")


def test_inner_protocol_stays_inside_the_fit_window() -> None:
    outer = azure_protocol(1440)
    inner = accuracy.inner_protocol(outer)
    assert inner.fit_steps == 1080 - 216  # ceil(0.2 * 1080) = 216
    assert inner.origins == tuple(range(864, 1066, 15))
    assert inner.origins[-1] + inner.horizon <= outer.fit_steps


def test_select_never_sees_the_test_window_and_applies_the_fixed_rule(monkeypatch) -> None:
    monkeypatch.setattr(accuracy, "default_members", lambda h, families: [MovingAverage(30), Naive()])
    panel = small_panel()
    protocol = generic_protocol(panel.n_steps, 1.0)
    candidates = [{"weighting": "best"}, {"weighting": "inverse_error", "power": 1.0},
                  {"weighting": "best", "interval_scale": "sqrt"}]
    clean = accuracy.select("small", panel, protocol, candidates, max_fit_steps=None)
    tampered = panel.values.copy()
    tampered[:, protocol.fit_steps:] = 99.0
    dirty = accuracy.select("small", Panel(panel.ids, panel.start, panel.step, tampered), protocol, candidates,
                            max_fit_steps=None)
    assert [r["all:wql"] for r in clean["candidates"]] == [r["all:wql"] for r in dirty["candidates"]]
    calibrated = [r["calibrated"] for r in clean["candidates"]]
    wql = [r["all:wql"] if ok or not any(calibrated) else np.inf for r, ok in zip(clean["candidates"], calibrated)]
    assert clean["winner"] == int(np.argmin(wql)) and clean["winner_config"] == candidates[clean["winner"]]
    assert clean["inner_fit_steps"] == protocol.fit_steps - int(np.ceil(0.2 * protocol.fit_steps))


def test_select_passes_over_a_lower_wql_that_misses_the_calibration_targets() -> None:
    def row(q99: float, strict: float, inclusive: float) -> dict:
        return {"busy:coverage_q99": q99, "busy:coverage_q90_strict": strict, "busy:coverage_q90": inclusive}

    assert accuracy.calibrated_on_validation(row(0.9856, 0.517, 0.949))  # shrunk k = 20 on the Azure day
    assert not accuracy.calibrated_on_validation(row(0.9772, 0.775, 0.923))  # inverse error, power 8: q0.99 short
    assert not accuracy.calibrated_on_validation(row(0.9859, 0.8652, 0.8652))  # its Huawei bracket: 0.9 outside
    assert accuracy.calibrated_on_validation(row(0.98, 0.92, 0.95))  # q0.99 at the limit is enough


def test_ablation_reference_row_is_the_ensemble_without_heads() -> None:
    panel = small_panel()
    protocol = generic_protocol(panel.n_steps, 1.0)
    ensemble = Ensemble([MovingAverage(30), Naive()], horizon=protocol.horizon)  # no LightGBM: no heads
    forecasts = run_backtest(ensemble, panel, protocol, members=True)
    table = accuracy.ablation(panel, protocol, ensemble, forecasts)
    rows = table["rows"]["all"]
    assert set(rows) == {"all members", "only moving_average_30", "only naive", "without moving_average_30",
                         "without naive"}
    reference = evaluate(panel, protocol, {"ensemble": forecasts["ensemble"]}).summary.set_index("subset")
    assert rows["all members"]["mase_median_active"] == pytest.approx(reference.loc["all", "mase_median_active"])
    assert rows["all members"]["coverage_q90"] == pytest.approx(reference.loc["all", "coverage_q90"])
    # with two members, "without naive" is "only moving_average_30"
    assert rows["without naive"] == rows["only moving_average_30"]
    share = table["chosen_share"]["all"]
    assert sum(share.values()) == pytest.approx(1.0)
    assert share == {m: pytest.approx(float(np.mean(np.argmax(ensemble.weights_, axis=1) == j)))
                     for j, m in enumerate(ensemble.member_names_)}


def test_ablation_rows_weigh_members_with_the_validation_evidence_as_the_fit_did() -> None:
    """The shrunk rule ranks members per series by its invoked validation steps: without them every series of a
    segment would take the segment's member, and the ablation's rows would not be the ensemble's rule."""
    rng = np.random.default_rng(0)
    walks = np.maximum(0, 50 + np.cumsum(rng.normal(0, 3, (6, 600)), axis=1)).round()  # naive's kind of series
    noise = rng.poisson(20, (6, 600)).astype(float)  # the moving average's
    panel = Panel.from_wide([f"s{i}" for i in range(12)], np.vstack([walks, noise]),
                            start=pd.Timestamp("2024-01-01", tz="UTC"), step="1min")
    protocol = generic_protocol(panel.n_steps, 1.0)
    ensemble = Ensemble([MovingAverage(30), Naive()], horizon=protocol.horizon, weighting="shrunk")
    run_backtest(ensemble, panel, protocol, members=True)
    weights = accuracy.rule_weights(ensemble, [0, 1, 2])
    np.testing.assert_array_equal(weights, ensemble.weights_)
    assert len(set(weights.argmax(axis=1).tolist())) > 1  # series of one segment, more than one member chosen


def test_v2_targets_against_the_best_peer() -> None:
    rows = pd.DataFrame({
        "mase_median_active": [0.8, 1.0, 0.95], "wql": [0.3, 0.32, 0.31], "coverage_q90_strict": [0.85, 0.8, 0.8],
        "coverage_q90": [0.92, 0.9, 0.9], "coverage_q99": [0.985, 0.99, 0.99], "brier_any": [0.08, 0.1, 0.1],
        "brier_any_climatology": [0.12, 0.12, 0.12], "brier_any_recent": [0.1, 0.1, 0.1],
        "spike_recall": [0.5, 0.4, 0.55],
    }, index=["ensemble", "naive", "moving_average_60"])
    t = accuracy.v2_targets(rows, ["naive", "moving_average_60"], "busy")
    assert t["mase_median_active"]["best_peer"] == "moving_average_60"
    assert t["mase_median_active"]["gain"] == pytest.approx(1 - 0.8 / 0.95) and t["mase_median_active"]["met"]
    assert t["wql"]["gain"] == pytest.approx(1 - 0.3 / 0.31) and not t["wql"]["met"]
    assert t["coverage_q90_bracket"]["met"] and t["coverage_q99"]["met"]
    assert t["brier_any"]["baseline"] == 0.1 and t["brier_any"]["met"]  # 20% below the recent baseline
    assert t["spike_recall"]["best_peer"] == "moving_average_60" and not t["spike_recall"]["met"]
    rows.loc["ensemble", ["coverage_q90_strict", "coverage_q90"]] = [0.75, 0.86]  # bracket misses 0.9 by > 0.03
    assert not accuracy.v2_targets(rows, ["naive"], "busy")["coverage_q90_bracket"]["met"]


def test_paired_spike_recall_difference_and_its_series_bootstrap() -> None:
    """Two series with spikes: the ensemble catches 6 of 10 and 1 of 10, the peer 4 of 10 and 3 of 10."""
    rows = []
    for method, hits in (("ensemble", (6, 1, 0)), ("naive", (4, 3, 0))):
        for uid, hit, spikes in zip(("a", "b", "c"), hits, (10, 10, 0), strict=True):
            rows.append({"method": method, "unique_id": uid, "h": 5, "spikes": spikes, "spikes_hit": hit})
    result = accuracy.BacktestResult(pd.DataFrame(rows), pd.DataFrame())
    ids = np.array(["a", "b", "c"], dtype=object)
    out = accuracy.paired_spike_recall(result, np.ones(3, dtype=bool), ids, "naive", resamples=500)
    assert out["difference"] == pytest.approx(0.0)  # 7 / 20 against 7 / 20
    assert out["series_with_spikes"] == 2  # the series without spikes is left out
    # resampling whole series: both drawn twice gives +0.2 or -0.2, so the interval spans them
    assert out["ci95"][0] == pytest.approx(-0.2) and out["ci95"][1] == pytest.approx(0.2)
    only_a = accuracy.paired_spike_recall(result, np.array([True, False, True]), ids, "naive")
    assert only_a["difference"] == pytest.approx(0.2) and only_a["ci95"] == [pytest.approx(0.2)] * 2
