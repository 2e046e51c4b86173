"""The report's forecasts made in a second process and streamed to the replay give the numbers made in one process.

``replay(parallel=True)`` forks one process for the baselines and spawns one that fits and forecasts the ensemble,
streaming each block to the process that replays prewarm (:class:`forecaster.report.replay.BlockStream`);
``parallel=False`` does everything in turn. Same history, same settings: every figure and every recorded forecast
must be equal, and a failure in the forecasting process must surface as an error, not a hang.
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import pandas as pd
import pytest

from forecaster.contracts.fleetconfig import FleetConfig
from forecaster.forecast.members import MovingAverage
from forecaster.report.history import History
from forecaster.report.replay import SHOWN_LEVELS, replay
from forecaster.settings import Settings
from forecaster.simulation.catalog import assign_models

pytestmark = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                                reason="the baselines' process is forked")

START = pd.Timestamp("2026-01-05", tz="UTC")


def _history(minutes: int = 420, since_col: int = 300, n: int = 5, seed: int = 3) -> History:
    rng = np.random.default_rng(seed)
    t = np.arange(minutes)
    level = np.array([4.0, 1.0, 0.3, 0.05, 8.0])[:n, None] * (1.2 + np.sin(2 * np.pi * t / 120.0))[None, :]
    counts = rng.poisson(level).astype("float64")
    counts[1, ::15] += 6  # a timer
    ids = np.array([f"m{k}" for k in range(n)], dtype=object)
    return History(ids=ids, start=START, counts=counts, unknown=np.zeros_like(counts, dtype=bool),
                   since_col=since_col, models=assign_models(ids, order_by=counts.sum(axis=1)),
                   cold_cost=np.ones(n), fleet=FleetConfig(n_nodes=3, phase_noise_sigma=0.0))


def _settings() -> Settings:
    return Settings(forecast_horizon_min=30)


def _figures(table: dict) -> dict:
    """The summary rows without what measures this machine's time (wall seconds, fit and forecast seconds)."""
    out = {}
    for policy, row in table.items():
        row = {k: v for k, v in row.items() if k != "wall_s"}
        if "forecaster_report" in row:
            row["forecaster_report"] = {k: v for k, v in row["forecaster_report"].items()
                                        if k not in ("fit_seconds", "member_fit_seconds", "forecast_seconds")}
        out[policy] = row
    return out


@pytest.mark.slow
def test_streamed_forecasts_replay_exactly_what_one_process_replays():
    history = _history()
    members = [MovingAverage(window=15)]
    together = replay(history, _settings(), history_min=240, retrain_every_min=60, members=members, parallel=False)
    streamed = replay(history, _settings(), history_min=240, retrain_every_min=60, members=members, parallel=True)
    # the child did the fits (one per hour of the window, after the first at its start) and the main served them
    report = streamed.results["prewarm"].extra["forecaster_report"]
    assert report["retrains"] == together.results["prewarm"].extra["forecaster_report"]["retrains"] == 2
    assert report["forecast_origins"] > 0 and report["retrain_minutes"] == [300, 360]
    assert "wait_for_forecasts_s" in streamed.stage_seconds and "forecast_s" in streamed.stage_seconds
    assert _figures(together.table) == _figures(streamed.table)
    for level in SHOWN_LEVELS:
        np.testing.assert_array_equal(together.forecasts.values[level], streamed.forecasts.values[level])
    np.testing.assert_array_equal(together.forecasts.by_ensemble, streamed.forecasts.by_ensemble)
    assert together.forecasts.by_ensemble.sum() > 100
    for name in together.results:
        np.testing.assert_array_equal(together.results[name].cold_requests, streamed.results[name].cold_requests)


class Fatal(BaseException):
    """Not an ``Exception``: the ensemble does not take it for a member failure, so it ends the fit."""


class Failing(MovingAverage):
    """A member whose fit raises :class:`Fatal` (in the forecasting process: the member is pickled to it)."""

    def fit(self, *args, **kwargs):
        raise Fatal("the member refused to fit")

    def fit_panel(self, *args, **kwargs):
        raise Fatal("the member refused to fit")


class Killed(MovingAverage):
    """A member whose process dies mid-fit (as one killed for memory would)."""

    def fit_panel(self, *args, **kwargs):
        import os

        os._exit(9)


@pytest.mark.slow
def test_a_failure_in_the_forecasting_process_is_raised_in_the_replay():
    with pytest.raises(RuntimeError, match="failed in the forecasting process") as caught:
        replay(_history(), _settings(), history_min=240, members=[Failing(window=15)], parallel=True)
    assert "Fatal: the member refused to fit" in str(caught.value)  # the child's traceback


@pytest.mark.slow
def test_a_forecasting_process_that_dies_is_an_error_not_a_hang():
    with pytest.raises(RuntimeError, match="ended without a result .exit code 9"):
        replay(_history(), _settings(), history_min=240, members=[Killed(window=15)], parallel=True)
