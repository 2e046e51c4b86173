"""Library peers of bench/accuracy.py (bench extra): no refit at origins, native intervals, naive fallback.

Needs statsforecast and mlforecast (``bench/requirements-peers.txt``, which ``scripts/test`` installs). Without
them the tests are skipped locally and fail under ``CI``, where a missing library is a broken set-up.
"""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest

from bench import peers
from forecaster.forecast.backtest import MethodForecasts, Protocol
from forecaster.forecast.panel import Panel


@pytest.fixture(autouse=True, scope="module")
def _peer_libraries() -> None:
    missing = peers.missing_libraries()  # an import that fails with anything but ImportError errors the tests
    if missing:
        message = (f"{', '.join(missing)} not importable: pip install -e '.[peers]' && "
                   "pip install --no-deps -r bench/requirements-peers.txt")
        if os.environ.get("CI"):
            pytest.fail(message)  # scripts/test installs them: missing under CI is a broken set-up, not a skip
        pytest.skip(message)


START = pd.Timestamp("2024-03-01 00:00", tz="UTC")
PROTOCOL = Protocol("small", 240, (240, 255, 270), 15, 1.0, None, (1, 5, 15))


def small_panel() -> Panel:
    rng = np.random.default_rng(2)
    t = np.arange(285)
    walk = np.clip(40 + np.cumsum(rng.normal(0, 2, 285)), 0, None).round()
    rows = [rng.poisson(r, 285).astype(float) for r in (1.0, 4.0)] + [np.where(t % 15 == 3, 6.0, 0.0), walk]
    return Panel.from_wide(["p1", "p4", "timer", "walk"], np.stack(rows), start=START, step="1min")  # sorted ids


def naive_forecasts(panel: Panel) -> MethodForecasts:
    last = np.stack([panel.values[:, o - 1] for o in PROTOCOL.origins], axis=1)[:, :, None]
    point = np.repeat(last, PROTOCOL.horizon, axis=2)
    return MethodForecasts(point, np.maximum(point - 1, 0), point + 1)


def check(out: MethodForecasts, panel: Panel) -> None:
    assert out.point.shape == (panel.n_series, len(PROTOCOL.origins), PROTOCOL.horizon)
    assert np.isfinite(out.point).all() and (out.q10 >= 0).all()
    assert (out.q10 <= out.point + 1e-9).all() and (out.point <= out.q90 + 1e-9).all()
    # q0.99 from the same machinery (native 98% interval / conformal 98%): finite and above q0.9
    assert out.q99 is not None and np.isfinite(out.q99).all() and (out.q90 <= out.q99 + 1e-9).all()
    assert (out.q99 > out.q90 + 1e-9).any()
    assert out.seconds > 0


@pytest.mark.parametrize("kind", ["autoarima", "autoets"])
def test_statsforecast_peer_fits_once_and_moves_forward(kind: str, monkeypatch) -> None:
    panel = small_panel()
    fits: list[int] = []
    make = peers._statsforecast_model

    def counting(kind_, fit_steps):
        model = make(kind_, fit_steps)
        original = model.fit
        model.fit = lambda y, *a, **k: fits.append(len(y)) or original(y, *a, **k)
        return model

    monkeypatch.setattr(peers, "_statsforecast_model", counting)
    out = peers.run_statsforecast(kind, panel, PROTOCOL, naive_forecasts(panel), say=lambda m: None)
    check(out, panel)
    # a warm-up fit outside the clock, then one fit per series on the fit window and none at the origins
    assert fits == [200] + [240] * panel.n_series
    assert out.extra["failed_series"] == 0
    # the random walk's forecasts follow the data before each origin
    assert not np.allclose(out.point[3, 0], out.point[3, 2])


def test_statsforecast_failed_fit_falls_back_to_naive_and_is_counted(monkeypatch) -> None:
    panel = small_panel()
    make = peers._statsforecast_model
    calls = iter(range(100))

    def flaky(kind_, fit_steps):
        if next(calls) == 2:  # the warm-up is call 0; series p4 (row 1) is call 2
            raise RuntimeError("no fit")
        return make(kind_, fit_steps)

    monkeypatch.setattr(peers, "_statsforecast_model", flaky)
    naive = naive_forecasts(panel)
    out = peers.run_statsforecast("autoets", panel, PROTOCOL, naive, say=lambda m: None)
    assert out.extra["failed_series"] == 1 and out.extra["failed_fits"] == 1
    np.testing.assert_array_equal(out.point[1], naive.point[1])
    np.testing.assert_array_equal(out.q90[1], naive.q90[1])
    np.testing.assert_array_equal(out.q99[1], naive.q90[1])  # a naive without q0.99 lends its q0.9


def test_statsforecast_peer_fit_window_bound(monkeypatch) -> None:
    panel = small_panel()
    fits: list[int] = []
    forwards: list[int] = []
    make = peers._statsforecast_model

    def counting(kind_, fit_steps):
        model = make(kind_, fit_steps)
        fit, forward = model.fit, model.forward
        model.fit = lambda y, *a, **k: fits.append(len(y)) or fit(y, *a, **k)
        model.forward = lambda y, *a, **k: forwards.append(len(y)) or forward(y, *a, **k)
        return model

    monkeypatch.setattr(peers, "_statsforecast_model", counting)
    out = peers.run_statsforecast("autoets", panel, PROTOCOL, naive_forecasts(panel), say=lambda m: None,
                                  max_fit_steps=100)
    check(out, panel)
    assert fits == [200] + [100] * panel.n_series and out.extra["fit_steps"] == 100
    assert set(forwards[1:]) == {100}  # after the warm-up: the last 100 steps before each origin


def test_mlforecast_peer_updates_without_refitting(monkeypatch) -> None:
    panel = small_panel()
    params = peers.lightgbm_global_params
    monkeypatch.setattr(peers, "lightgbm_global_params", lambda: params() | {"n_estimators": 30})
    out = peers.run_mlforecast(panel, PROTOCOL, naive_forecasts(panel), say=lambda m: None)
    check(out, panel)
    assert out.extra["failed_series"] == 0
    assert np.abs(out.point[2, 0] - panel.values[2, 240:255]).mean() < 2.0  # the timer is learned from lags
