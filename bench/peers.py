"""Library peers of ``bench/accuracy.py``: statsforecast AutoARIMA / AutoETS and an mlforecast global LightGBM.

Installed only for benchmarks and their test (``pip install -e '.[peers]' && pip install --no-deps -r
bench/requirements-peers.txt``; see the README's Benchmarks section). All three
run the no-refit protocol of ``../shared/EVALUATION.md`` section 1:

* **AutoARIMA / AutoETS** (statsforecast, non-seasonal, ``season_length=1``): one
  model per series, fitted once on the fit window; at each origin the
  library's ``forward(y=history before the origin, h)`` applies the fitted
  model to the longer history (ARIMA: coefficients and sigma^2 fixed, only the
  state is filtered forward; ETS: smoothing parameters and initial states
  fixed, sigma^2 recomputed from the residuals of the history). AutoARIMA uses
  ``approximation=True`` when the fit window is longer than 150 steps (the rule
  of R's ``auto.arima``). q0.1 / q0.9 are the native 80% interval, q0.99 the
  upper end of the native 98% interval.
* **lightgbm_global** (mlforecast): one LightGBM across all series with lags
  1..15, 30, 60 (plus the season where the protocol has one) and rolling means
  of lag 1 over 15 and 60 steps, each series divided by its fit-window mean;
  untuned (300 trees, learning rate 0.05, 31 leaves, min_child_samples 50,
  bagging and feature fraction 0.8), recursive (mlforecast's default). Conformal
  intervals from the last ``10 x H`` training steps (``PredictionIntervals(
  n_windows=10, h=H)``, fitted once; 80% for q0.1 / q0.9, 98% for q0.99). At each origin ``MLForecast.update``
  appends the steps since the previous origin to the stored series (no refit,
  the conformity scores stay those of the fit window) and ``predict`` forecasts.

A series whose fit raises (or whose forecast at an origin raises or is not
finite) gets the naive peer's forecast and empirical intervals there; the
series are counted in ``extra["failed_series"]``. Unknown steps (``NaN``) are
given to the libraries as 0. Forecasts and quantiles are clipped at 0.

Long traces (``max_fit_steps``): on a fit window longer than ``max_fit_steps``
steps the peers are fitted on its last ``max_fit_steps`` steps only, and
AutoARIMA / AutoETS ``forward`` over the last ``max_fit_steps`` steps before each
origin (the approximation EVALUATION.md allows on long windows; the benchmark
prints and records the bound). ``None`` (the default) uses the whole window.

Time: the libraries' first calls (import, any JIT compilation) happen on a tiny
warm-up series before the clock starts, as the protocol says.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable

import numpy as np
import pandas as pd

from forecaster.forecast.backtest import MethodForecasts, Protocol
from forecaster.forecast.panel import Panel

PEER_NAMES = ("autoarima", "autoets", "lightgbm_global")


def missing_libraries() -> list[str]:
    """The peer libraries that cannot be imported, each as ``"name (why)"``; empty when both import.

    They are installed by ``bench/requirements-peers.txt`` (see the ``peers`` extra in ``pyproject.toml``); a
    missing dependency of theirs (``No module named 'fugue'``) shows up here as the reason.
    """
    missing = []
    for module in ("statsforecast", "mlforecast"):
        try:
            __import__(module)
        except ImportError as error:
            missing.append(f"{module} ({error})")
    return missing


def _history(panel: Panel) -> np.ndarray:
    return np.nan_to_num(panel.values, nan=0.0)


def _fill_failed(out: MethodForecasts, failed: np.ndarray, naive: MethodForecasts) -> None:
    """Use the naive peer (point and empirical intervals) where ``failed`` ``(N, O)`` is set."""
    mask = np.broadcast_to(failed[:, :, None], out.point.shape)
    out.point[mask] = naive.point[mask]
    out.q10[mask] = naive.q10[mask]
    out.q90[mask] = naive.q90[mask]
    if out.q99 is not None:  # a naive without q0.99 lends its q0.9
        out.q99[mask] = (naive.q99 if naive.q99 is not None else naive.q90)[mask]


# ---------------------------------------------------------------------------- statsforecast


def _statsforecast_model(kind: str, fit_steps: int):
    from statsforecast.models import AutoARIMA, AutoETS

    if kind == "autoarima":
        return AutoARIMA(season_length=1, approximation=fit_steps > 150)
    if kind == "autoets":
        return AutoETS(season_length=1, model="ZZN")
    raise ValueError(f"unknown statsforecast peer {kind!r}")


def _levels_out(n: int, o: int, h: int) -> MethodForecasts:
    blank = lambda: np.full((n, o, h), np.nan)  # noqa: E731
    return MethodForecasts(blank(), blank(), blank(), q99=blank())


def run_statsforecast(
    kind: str, panel: Panel, protocol: Protocol, naive: MethodForecasts, say: Callable[[str], None] = print,
    max_fit_steps: int | None = None,
) -> MethodForecasts:
    """AutoARIMA or AutoETS per series: fit once on the fit window, ``forward`` at every origin."""
    h, origins = protocol.horizon, list(protocol.origins)
    fit_from = 0 if max_fit_steps is None else max(0, protocol.fit_steps - int(max_fit_steps))
    fit_steps = protocol.fit_steps - fit_from
    y_all = _history(panel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warm = np.random.default_rng(0).poisson(3.0, 200).astype(np.float64)
        _statsforecast_model(kind, 200).fit(warm).forward(y=warm, h=h, level=[80, 98])

    n, o = panel.n_series, len(origins)
    out = _levels_out(n, o, h)
    failed = np.zeros((n, o), dtype=bool)
    fit_failures = 0
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "possible convergence problem" on most intermittent series
        logging.getLogger("statsforecast").setLevel(logging.ERROR)
        for i in range(n):
            try:
                model = _statsforecast_model(kind, fit_steps).fit(y_all[i, fit_from : protocol.fit_steps])
            except Exception:  # noqa: BLE001 - counted, naive instead
                fit_failures += 1
                failed[i] = True
                continue
            for k, origin in enumerate(origins):
                try:
                    lo = 0 if max_fit_steps is None else max(0, origin - int(max_fit_steps))
                    res = model.forward(y=y_all[i, lo:origin], h=h, level=[80, 98])
                    block = np.stack([res["mean"], res["lo-80"], res["hi-80"], res["hi-98"]])
                except Exception:  # noqa: BLE001
                    failed[i, k] = True
                    continue
                if not np.isfinite(block).all():
                    failed[i, k] = True
                    continue
                out.point[i, k], out.q10[i, k], out.q90[i, k], out.q99[i, k] = np.clip(block, 0.0, None)
            if (i + 1) % 200 == 0:
                say(f"{kind}: {i + 1}/{n} series, {time.perf_counter() - started:.0f} s")
    out.seconds = time.perf_counter() - started
    _fill_failed(out, failed, naive)
    failed_series = int(failed.any(axis=1).sum())
    out.extra.update(failed_series=failed_series, failed_fits=fit_failures,
                     failed_forecasts=int(failed.sum()) - fit_failures * o, protocol="no refit (forward)",
                     fit_steps=fit_steps)
    return out


# ---------------------------------------------------------------------------- mlforecast


def lightgbm_global_params() -> dict:
    """EVALUATION.md's untuned LightGBM (one thread: measured faster on the 2 shared cores)."""
    return dict(n_estimators=300, learning_rate=0.05, num_leaves=31, min_child_samples=50, subsample=0.8,
                subsample_freq=1, colsample_bytree=0.8, n_jobs=1, random_state=0, verbose=-1)


def _mlforecast(protocol: Protocol):
    import lightgbm
    from mlforecast import MLForecast
    from mlforecast.lag_transforms import RollingMean

    lags = [*range(1, 16), 30, 60] + ([protocol.season] if protocol.season else [])
    return MLForecast(
        models={"lgbm": lightgbm.LGBMRegressor(**lightgbm_global_params())},
        freq=1,
        lags=lags,
        lag_transforms={1: [RollingMean(window_size=15), RollingMean(window_size=60)]},
        num_threads=1,
    )


def _long(ids: np.ndarray, values: np.ndarray, first: int) -> pd.DataFrame:
    n, t = values.shape
    return pd.DataFrame({"unique_id": np.repeat(ids, t), "ds": np.tile(np.arange(first, first + t), n),
                         "y": values.ravel()})


def run_mlforecast(
    panel: Panel, protocol: Protocol, naive: MethodForecasts, say: Callable[[str], None] = print,
    max_fit_steps: int | None = None,
) -> MethodForecasts:
    """Global LightGBM through mlforecast: fit once (with conformal scores), ``update`` + ``predict`` per origin."""
    from mlforecast.utils import PredictionIntervals

    h, origins = protocol.horizon, list(protocol.origins)
    ids = np.array([str(u) for u in panel.ids], dtype=object)
    y_all = _history(panel)
    # warm-up on a tiny panel: imports and first calls outside the clock
    warm = np.random.default_rng(0).poisson(3.0, (3, 150 + (protocol.season or 0))).astype(np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny = _mlforecast(protocol)
        tiny.models["lgbm"].set_params(n_estimators=5)
        tiny.fit(_long(np.array(["a", "b", "c"], dtype=object), warm, 0),
                 prediction_intervals=PredictionIntervals(n_windows=2, h=h))
        tiny.predict(h, level=[80, 98])

    n, o = panel.n_series, len(origins)
    out = _levels_out(n, o, h)
    started = time.perf_counter()
    fit_from = 0 if max_fit_steps is None else max(0, protocol.fit_steps - int(max_fit_steps))
    fit = y_all[:, fit_from : protocol.fit_steps]
    with np.errstate(invalid="ignore"):
        scale = fit.mean(axis=1)
    scale = np.where(scale > 0, scale, 1.0)  # all-zero fit windows stay as they are
    scaled = y_all / scale[:, None]
    model = _mlforecast(protocol)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(_long(ids, scaled[:, fit_from : protocol.fit_steps], fit_from),
                  prediction_intervals=PredictionIntervals(n_windows=10, h=h))
        say(f"lightgbm_global: fitted in {time.perf_counter() - started:.0f} s")
        position = pd.Index(ids)
        known = protocol.fit_steps
        for k, origin in enumerate(origins):
            if origin > known:
                model.update(_long(ids, scaled[:, known:origin], known))
                known = origin
            frame = model.predict(h, level=[80, 98])
            rows = position.get_indexer(frame["unique_id"].astype(str))
            step = frame["ds"].to_numpy() - origin
            for column, target in (("lgbm", out.point), ("lgbm-lo-80", out.q10), ("lgbm-hi-80", out.q90),
                                   ("lgbm-hi-98", out.q99)):
                target[rows, k, step] = frame[column].to_numpy() * scale[rows]
    out.seconds = time.perf_counter() - started
    for array in (out.point, out.q10, out.q90, out.q99):
        np.clip(array, 0.0, None, out=array)
    failed = np.zeros(out.point.shape[:2], dtype=bool)
    for array in (out.point, out.q10, out.q90, out.q99):
        failed |= ~np.isfinite(array).all(axis=2)
    _fill_failed(out, failed, naive)
    out.extra.update(failed_series=int(failed.any(axis=1).sum()), protocol="no refit (update + predict)",
                     fit_steps=protocol.fit_steps - fit_from)
    return out


def run_peers(
    panel: Panel, protocol: Protocol, naive: MethodForecasts, say: Callable[[str], None] = print,
    max_fit_steps: int | dict[str, int | None] | None = None,
) -> dict[str, MethodForecasts]:
    """The three library peers; a peer whose run raises as a whole is reported and left out.

    ``max_fit_steps`` bounds their fit window (and AutoARIMA / AutoETS's
    ``forward`` history) on long traces: one bound for all, or one per peer
    name (a missing name: no bound); ``None`` = the whole fit window.
    """
    bound = max_fit_steps if isinstance(max_fit_steps, dict) else dict.fromkeys(PEER_NAMES, max_fit_steps)
    out: dict[str, MethodForecasts] = {}
    runs = {
        "autoarima": lambda: run_statsforecast("autoarima", panel, protocol, naive, say, bound.get("autoarima")),
        "autoets": lambda: run_statsforecast("autoets", panel, protocol, naive, say, bound.get("autoets")),
        "lightgbm_global": lambda: run_mlforecast(panel, protocol, naive, say, bound.get("lightgbm_global")),
    }
    for name, run in runs.items():
        started = time.perf_counter()
        try:
            out[name] = run()
        except Exception as error:  # noqa: BLE001 - one peer failing must not sink the benchmark
            say(f"peer {name} failed: {type(error).__name__}: {error}")
            continue
        extra = out[name].extra
        say(f"peer {name}: {time.perf_counter() - started:.1f} s ({out[name].seconds:.1f} s timed), "
            f"{extra.get('failed_series', 0)} series fell back to naive")
    return out
