"""The planner reads a forecast's count quantiles as the distribution whose mass above zero is its ``p_any``.

A row whose quantiles disagree with its ``p_any`` (the ensemble's residual quantiles beside its stacked
``p_any``) is rescaled to it (:mod:`forecaster.planning.coherence`); rows that agree (the empirical and oracle
sources) are read as they are.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from forecaster.contracts.actions import ActionKind
from forecaster.contracts.fleet import FleetState
from forecaster.planning.coherence import coherent_quantiles, incoherent_rows
from forecaster.planning.fleet import PlannerSettings
from forecaster.planning.forecasts import CountPanel, EmpiricalForecast, OracleForecast
from forecaster.planning.planner import ForecastArrays, forecast_arrays, plan
from tests.test_planner import MIN, T0, latency, model, nodes

LEVELS = (0.1, 0.5, 0.9, 0.99)


def frame(quantiles: tuple[float, ...], p_any: float, horizon: int = 5, model_id: str = "m",
          levels: tuple[float, ...] = LEVELS) -> pd.DataFrame:
    return pd.DataFrame([{"unique_id": model_id, "ds": T0 + h * MIN, "p_any": p_any,
                          **{f"q{lv:g}": v for lv, v in zip(levels, quantiles)}} for h in range(horizon)])


def test_rows_that_agree_with_p_any_are_read_unchanged():
    """Every empirical and oracle row already agrees with its p_any: nothing is rescaled."""
    rng = np.random.default_rng(3)
    counts = np.where(rng.random((40, 600)) < rng.random((40, 1)) * 0.4, rng.integers(1, 30, (40, 600)), 0)
    panel = CountPanel(ids=np.array([f"f{i}" for i in range(40)], dtype=object),
                       start=pd.Timestamp(T0) - pd.Timedelta(minutes=300), counts=counts.astype("float64"))
    ids = pd.Index(panel.ids.astype(str))
    for source in (EmpiricalForecast(panel), OracleForecast(panel)):
        for col in (10, 120, 300, 450):
            f = source.frame_at(col, 10)
            now = (panel.start + pd.Timedelta(minutes=col)).to_pydatetime()
            fa = forecast_arrays(f, ids, now, 10)
            assert fa.rescaled == 0
            raw = f[[f"q{lv:g}" for lv in LEVELS]].to_numpy().reshape(40, 10, len(LEVELS))
            np.testing.assert_array_equal(fa.values, raw)


@pytest.mark.parametrize("quantiles,p_any", [((0.0, 1.0, 4.0, 8.0), 0.05), ((1.0, 3.0, 10.0, 20.0), 0.3),
                                             ((0.0, 0.0, 0.0, 0.0), 0.4), ((0.0, 0.0, 3.0, 5.0), 0.97)])
def test_a_disagreeing_row_gets_p_any_mass_above_zero_and_keeps_its_shape(quantiles, p_any):
    levels = np.array(LEVELS)
    values = np.array(quantiles, dtype="float64")[None, None, :]
    p = np.array([[p_any]])
    assert incoherent_rows(levels, values, p).all()
    fixed, count = coherent_quantiles(levels, values, p)
    assert count == 1
    row = fixed[0, 0]
    assert not incoherent_rows(levels, fixed, p).any()
    np.testing.assert_array_equal(row[levels <= 1 - p_any], 0.0)
    assert (row[levels > 1 - p_any] >= 1.0).all()
    assert (np.diff(row) >= 0).all()


def test_rescaling_keeps_the_positive_part_of_a_row():
    """The unconditional quantiles of (p_q = 0.95 above zero, positive part P) rescaled to p_any = 0.2 read as the
    coherent row of (0.2 above zero, the same P): the same median given a request, the same P(count > 0)."""
    coherent = forecast_arrays(frame((0.0, 0.0, 1.0, 2.0), 0.2), pd.Index(["m"]), T0, 5)
    wide = forecast_arrays(frame((1.0, 1.0, 1.9, 2.0), 0.2), pd.Index(["m"]), T0, 5)
    assert coherent.rescaled == 0 and wide.rescaled == 5
    given_any = lambda fa: fa.quantile(1.0 - fa.p_any / 2.0)  # noqa: E731 (the positive part's median)
    np.testing.assert_allclose(given_any(wide.coherent()), given_any(coherent), atol=0.06)
    np.testing.assert_allclose(wide.coherent().exceed(np.full((1, 5), 0.5)), coherent.exceed(np.full((1, 5), 0.5)),
                               atol=0.02)
    np.testing.assert_allclose(wide.demand_given_any(), coherent.demand_given_any(), rtol=0.05)
    # the quantiles as forecast stay what sizing, pre-loads and the GPU budget read
    np.testing.assert_array_equal(wide.values[0, :, :], np.tile([1.0, 1.0, 1.9, 2.0], (5, 1)))
    assert coherent.coherent().values is coherent.values


def test_a_sparse_model_is_not_held_for_the_wide_quantiles_of_an_unconditional_forecast():
    """p_any = 0.2 and a lone request when called: not worth a warm replica at cold cost 1 (0.2 x 202 s of wait
    < 0.8 x 60 GPU-s). The same model forecast as unconditional quantiles with 95 % above zero (q0.9 = 1.9) made
    the planner read 1.9 requests per minute given any, a queued wait of 288 s, and hold it warm."""
    fleet = FleetState.build([model("m")], nodes(2))
    lat = latency(["m"])
    settings = PlannerSettings(tiers=False)
    coherent = plan(frame((0.0, 0.0, 1.0, 2.0), 0.2), lat, fleet, settings, T0)
    wide = plan(frame((1.0, 1.0, 1.9, 2.0), 0.2), lat, fleet, settings, T0)
    assert not [a for a in coherent.actions if a.kind is ActionKind.SCALE]
    assert not [a for a in wide.actions if a.kind is ActionKind.SCALE]
    assert wide.summary["forecast_rows_rescaled"] == 5
    # the same row with p_any = 0.3 is worth holding either way (0.3 x 202 >= 0.7 x 60)
    held = plan(frame((1.0, 1.0, 1.9, 2.0), 0.3), lat, fleet, settings, T0)
    assert [a for a in held.actions if a.kind is ActionKind.SCALE]


def test_mean_above_integrates_the_quantile_function_the_planner_reads():
    """Exact on a hand case (the tail above the last level held flat), and the mean of a dense sample elsewhere."""
    fa = forecast_arrays(frame((0.0, 0.0, 0.0, 10.0), 0.1), pd.Index(["m"]), T0, 5)
    # over [0.9, 1]: 0 -> 10 linearly up to 0.99 (0.09 x 5), then 10 (0.01 x 10); divided by 0.1
    np.testing.assert_allclose(fa.mean_above(np.full((1, 5), 0.9)), 5.5)
    np.testing.assert_allclose(fa.mean_above(np.full((1, 5), 0.0)), (0.09 * 5 + 0.1) / 1.0)
    rng = np.random.default_rng(5)
    values = np.sort(rng.gamma(1.0, 5.0, (30, 4, len(LEVELS))), axis=2)
    fa = ForecastArrays(levels=np.array(LEVELS), values=values, p_any=rng.uniform(0.01, 1.0, (30, 4)),
                        known=np.ones(30, dtype=bool))
    start = 1.0 - fa.p_any
    dense = np.mean([fa.quantile(start + (1.0 - start) * (j + 0.5) / 4000) for j in range(4000)], axis=0)
    np.testing.assert_allclose(fa.mean_above(start), dense, rtol=1e-4)


def test_a_bursty_model_is_held_for_the_mean_of_its_demand_given_a_request():
    """p_any = 0.1; when called, one request in the median minute but up to 60 in the top 1 %. A cold start's queued
    wait is linear in the requests that arrive during it, so its expected cost takes their mean (18.45 a minute:
    0.1 x about 1,900 s of wait > 0.9 x 60 GPU-s): held. Read at the median (one request a minute: 0.1 x 202 s),
    it was not; the same model whose top 1 % is one request is still not held."""
    levels = (0.1, 0.5, 0.9, 0.95, 0.99)
    fleet = FleetState.build([model("m")], nodes(2))
    lat = latency(["m"])
    settings = PlannerSettings(tiers=False)
    bursty = frame((0.0, 0.0, 0.0, 1.0, 60.0), 0.1, levels=levels)
    lone = frame((0.0, 0.0, 0.0, 1.0, 1.0), 0.1, levels=levels)
    fa = forecast_arrays(bursty, pd.Index(["m"]), T0, 5)
    assert fa.rescaled == 0
    np.testing.assert_allclose(fa.mean_above(1.0 - fa.p_any), (0.05 * 0.5 + 0.04 * 30.5 + 0.01 * 60) / 0.1)
    assert [a for a in plan(bursty, lat, fleet, settings, T0).actions if a.kind is ActionKind.SCALE]
    assert not [a for a in plan(lone, lat, fleet, settings, T0).actions if a.kind is ActionKind.SCALE]


def test_replicas_are_sized_on_the_quantiles_as_forecast_whatever_p_any_says():
    """Sizing asks a coverage question (the demand quantile at the newsvendor level), which the forecast's own
    quantiles answer (conformal, calibrated per level); p_any decides warm or not and the demand given a request.
    The same quantiles with a p_any that disagrees (0.6; their own mass above zero is 0.95) give the same replicas
    as with one that agrees. Rescaled for sizing too, they gave fewer: on the demo sample that doubled the
    cold-start requests (1,601 -> 3,447 over the 6-hour replay) for 8 % more GPU-seconds."""
    fleet = FleetState.build([model("m", replica_rpm=5.0, cold_cost=0.5)], nodes(2))
    lat = latency(["m"])
    settings = PlannerSettings(tiers=False)
    quantiles = (1.0, 5.0, 20.0, 100.0)

    def replicas(p_any: float) -> int:
        result = plan(frame(quantiles, p_any), lat, fleet, settings, T0)
        return max((a.replicas for a in result.actions if a.kind is ActionKind.SCALE), default=0)

    agreeing, disagreeing = replicas(0.95), replicas(0.6)
    assert agreeing > 1
    assert disagreeing == agreeing
    rows = forecast_arrays(frame(quantiles, 0.6), pd.Index(["m"]), T0, 5)
    assert rows.rescaled == 5
    assert (rows.coherent().quantile(0.69) < rows.quantile(0.69)).all()  # what sizing would have read rescaled
