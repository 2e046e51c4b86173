"""The product's ensemble as a causal forecast source for replays: the simulator and the benchmarks.

:class:`EnsembleForecast` offers the
:class:`~forecaster.contracts.forecast.ForecastSource` contract over a
:class:`~forecaster.planning.forecasts.CountPanel`, like
:class:`~forecaster.planning.forecasts.EmpiricalForecast`, but its numbers
come from the model production runs: the sharded default ensemble built by
:func:`forecaster.forecast.sharded.production_model`, the factory of the
nightly retrain (``forecaster.jobs.forecasting.default_model``).

Time in a replay (minute ``m`` = column ``m`` of the panel):

* **Retrains.** The model is first fitted at ``train_until_min`` (the warm-up
  end / first scored minute), then every ``retrain_every_min`` simulated
  minutes (default 360: four fits on a one-day trace with a 240-minute
  warm-up, at minutes 240, 600, 960, 1320), mirroring production's nightly
  retrain on a day-long replay. The fit at minute ``r`` sees columns
  ``max(0, r - settings.train_window_min) .. r - 1`` only. Unlike production,
  there is no champion/challenger holdout: production fits the challenger on
  the minutes up to ``retrain_holdout_min`` before the retrain and promotes
  it only if it scores no worse there; here each fit uses every minute
  before ``r`` and simply replaces the last.
  A scheduled minute with fewer than ``min_train_min`` minutes behind it is
  skipped (counted in :attr:`skipped_retrains`).
* **Forecasts.** A call ``quantiles(now, H)`` at minute ``o`` uses the latest
  fit at or before ``o`` and conditions on columns ``< o`` (``o - 1`` and
  earlier, at most ``settings.forecast_lookback_min`` back, like the per-minute
  forecast job); parameters never see column ``o`` or later.
* **Before the first fit** (minutes before ``train_until_min``, or all of them
  when no fit is possible yet) the source answers with the causal
  :class:`~forecaster.planning.forecasts.EmpiricalForecast`, counted in
  :attr:`empirical_calls`.

Speed: forecasting one origin at a time costs one ensemble pass per minute.
Instead, origins are forecast in blocks of ``block_min`` consecutive minutes
(never across a retrain) with one ``forecast(panel, origins, h)`` call, and
served from a cache. Every member's origin ``o`` reads only columns ``< o``
of the panel it is given (the member contract; the leakage tests of
``tests/test_forecast_members.py`` and ``tests/test_ensemble_source.py``),
and the block's panel ends at column ``last origin - 1``, so a block is as
causal as single-origin calls and gives the same numbers. The cache keeps every
block computed (float32; ``N x H x (levels + 1) x 4`` bytes per minute: 324 KB
for 1,350 models at H = 10, 470 MB for a whole day), so several policies
replaying the same trace can share one source object and pay for the fits and
forecasts once. Measured on the Azure day (1,350 series, H = 10, 2 busy shared
cores; ``bench/ensemble_source.py``): the four fits took 225 to 690 s each,
forecasting the 1,200 scored minutes 153 s; about 39 minutes per trace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import datetime

import numpy as np
import pandas as pd

from forecaster.contracts.forecast import FORECAST_LEVELS, quantile_column
from forecaster.forecast.members import Member
from forecaster.forecast.panel import Panel
from forecaster.forecast.sharded import production_model
from forecaster.planning.forecasts import CountPanel, EmpiricalForecast
from forecaster.settings import Settings

log = logging.getLogger(__name__)

#: the attributes :meth:`EnsembleForecast.report` reads, carried across processes by ``counters`` / ``absorb``
COUNTERS = ("retrains", "retrain_minutes", "fit_seconds", "member_fit_seconds", "forecast_seconds",
            "forecast_origins", "failures")


class EnsembleForecast:
    """Causal quantile forecasts from the product's ensemble, retrained on a schedule in simulated time.

    Args:
        panel: per-minute counts of the replay (all of it; the source reads only
            what lies before each ``now``).
        train_until_min: minute of the first fit (columns before it are its
            training data), e.g. the end of the warm-up / the first scored minute.
        retrain_every_min: simulated minutes between fits (default 360).
        members: unfitted ensemble members instead of the default five (tests,
            quick replays); the fallback member is always added. ``None``: the
            product default (LightGBM, XGBoost, RandomForest, ARIMA, LSTM).
        settings: service settings the model is built with
            (``forecast_horizon_min``, ``shard_max_series``, ``train_window_min``,
            ``forecast_lookback_min``, the executor); ``None``: the defaults
            (no environment read).
        levels: quantile levels of the frames (default ``FORECAST_LEVELS``).
        horizon_min: most minutes ahead one call may ask for; the cache holds
            this many (a longer request recomputes the cache at the new length).
        block_min: origins forecast together per ensemble call (minutes).
        min_train_min: fewest minutes of history a fit needs; default four
            times the model's horizon (the retrain job's own minimum).
        progress: called with one line per fit and per forecast block.

    Attributes:
        name, forecaster: ``"ensemble"``.
        schedule: minutes of the fits this replay can do (each done on the first call it serves).
        retrains: fits done so far.
        retrain_minutes: the minute of each fit done, in order.
        fit_seconds: wall seconds of each fit, in order.
        member_fit_seconds: per fit, seconds per member and quantile head (summed over shards).
        forecast_seconds: wall seconds spent forecasting blocks, in total.
        forecast_origins: origins (minutes) forecast by the ensemble so far.
        empirical_calls: calls answered by the empirical fallback (before the first fit).
        skipped_retrains: scheduled minutes skipped for too short a history.
        failures: member failures per fit minute (``Ensemble.failures_``).
    """

    name = "ensemble"
    forecaster = "ensemble"

    def __init__(
        self,
        panel: CountPanel,
        *,
        train_until_min: int,
        retrain_every_min: int = 360,
        members: Sequence[Member] | None = None,
        settings: Settings | None = None,
        levels: Sequence[float] = FORECAST_LEVELS,
        horizon_min: int = 10,
        block_min: int = 60,
        min_train_min: int | None = None,
        progress: Callable[[str], None] | None = None,
    ):
        if retrain_every_min < 1 or block_min < 1 or horizon_min < 1:
            raise ValueError("retrain_every_min, block_min and horizon_min must be at least 1")
        self.panel = panel
        self.train_until_min = int(train_until_min)
        self.retrain_every_min = int(retrain_every_min)
        self.members = None if members is None else list(members)
        self.settings = settings or Settings.model_construct()
        self.levels = tuple(sorted(levels))
        self.horizon_min = int(horizon_min)
        self.block_min = int(block_min)
        self.min_train_min = 4 * self.settings.forecast_horizon_min if min_train_min is None else int(min_train_min)
        self.progress = progress
        self.empirical = EmpiricalForecast(panel, levels=self.levels)
        self.retrains = 0
        self.retrain_minutes: list[int] = []
        self.fit_seconds: list[float] = []
        self.member_fit_seconds: list[dict[str, float]] = []
        self.forecast_seconds = 0.0
        self.forecast_origins = 0
        self.empirical_calls = 0
        self.failures: dict[int, dict[str, str]] = {}
        least = max(1, self.min_train_min)  # a fit needs at least one minute behind it
        self.schedule = [r for r in self._planned() if r >= least]
        self.skipped_retrains = [r for r in self._planned() if r < least]
        self._models: dict[int, object] = {}
        self._blocks: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        self._receive: Callable[[], tuple[int, dict[str, np.ndarray]] | None] | None = None

    # ------------------------------------------------------------------ schedule
    def _planned(self) -> list[int]:
        """Scheduled fit minutes inside the panel: ``train_until_min`` then every ``retrain_every_min``."""
        return list(range(max(self.train_until_min, 0), self.panel.n_minutes, self.retrain_every_min))

    def fit_minute(self, col: int) -> int | None:
        """The fit that serves origin ``col``: the latest scheduled one at or before it (None: no fit yet)."""
        index = int(np.searchsorted(self.schedule, col, side="right")) - 1
        return self.schedule[index] if index >= 0 else None

    def _block(self, col: int, fit: int) -> tuple[int, int]:
        """Origins ``[first, end)`` of the block holding ``col``: ``block_min`` long, never across a retrain."""
        first = fit + (col - fit) // self.block_min * self.block_min
        later = [r for r in self.schedule if r > fit]
        end = min(first + self.block_min, later[0] if later else self.panel.n_minutes + 1, self.panel.n_minutes + 1)
        return first, end

    # ------------------------------------------------------------------ the contract
    def quantiles(self, now: datetime, horizon_min: int) -> pd.DataFrame:
        """The forecast frame ``unique_id, ds, q<level>..., p_any`` of ``now .. now + horizon_min - 1``, causally.

        Args:
            now: a minute boundary inside the replay (``panel.start`` .. its end).
            horizon_min: minutes ahead (1 = the minute starting at ``now``).
        """
        return self.frame_at(self.panel.minute_index(now), horizon_min)

    def frame_at(self, col: int, horizon_min: int) -> pd.DataFrame:
        """The frame at origin column ``col`` (0 .. ``panel.n_minutes``)."""
        if not 0 <= col <= self.panel.n_minutes:
            raise ValueError(f"minute {col} lies outside the replay (0..{self.panel.n_minutes})")
        fit = self.fit_minute(col)
        if fit is None:
            self.empirical_calls += 1
            return self.empirical.frame_at(col, horizon_min)
        if horizon_min > self.horizon_min:
            log.info("ensemble source: horizon %d > cached %d minutes; the cache restarts", horizon_min,
                     self.horizon_min)
            self.horizon_min = horizon_min
            self._blocks.clear()
        first, arrays = self._cached(col, fit)
        k = col - first
        values = {name: array[:, k, :horizon_min] for name, array in arrays.items()}
        return self.panel.frame(col, values)

    def precompute(self, until_min: int | None = None,
                   on_block: Callable[[int, dict[str, np.ndarray]], None] | None = None) -> dict:
        """Fit and forecast every block up to origin ``until_min`` (default: the whole replay); returns :meth:`report`.

        A benchmark calls this once before replaying several policies, so that
        the fit and forecast seconds are paid (and measured) once. ``on_block``
        is called with ``(first origin, arrays)`` of each block as soon as it is
        made, in origin order (:meth:`receive_blocks` serves them elsewhere).
        """
        until = self.panel.n_minutes if until_min is None else min(int(until_min), self.panel.n_minutes)
        col = self.schedule[0] if self.schedule else until
        while col < until:
            fit = self.fit_minute(col)
            _, end = self._block(col, fit)
            first, arrays = self._cached(col, fit)
            if on_block is not None:
                on_block(first, arrays)
            col = end
        return self.report()

    def receive_blocks(self, receive: Callable[[], tuple[int, dict[str, np.ndarray]] | None]) -> None:
        """Serve blocks made by another process instead of fitting and forecasting here.

        ``receive()`` blocks until the next ``(first origin, arrays)`` another
        process's :meth:`precompute` made (``on_block``), in origin order, or
        returns None when that process has no more. A block this source lacks
        is then awaited, never computed here: both sides run the same schedule on
        the same panel, so the numbers are those this process would have made.
        """
        self._receive = receive

    def __getstate__(self) -> dict:
        """What another process needs to fit and forecast the same blocks (a spawned forecasting process): the
        callables tied to this process (``progress``, a block receiver) stay here."""
        state = dict(self.__dict__)
        state["progress"] = None
        state["_receive"] = None
        return state

    def counters(self) -> dict:
        """What :meth:`report` counts, to carry from the process that fitted and forecast to the one that replays."""
        return {name: getattr(self, name) for name in COUNTERS}

    def absorb(self, counters: dict) -> None:
        """Take another process's :meth:`counters` (it did the fits and forecasts this source served)."""
        for name in COUNTERS:
            setattr(self, name, counters[name])

    def report(self) -> dict:
        """Counters for a benchmark row: fits, their minutes and seconds, forecast seconds, fallback calls."""
        return {"forecaster": self.forecaster, "retrains": self.retrains, "retrain_minutes": list(self.retrain_minutes),
                "fit_seconds": [round(s, 2) for s in self.fit_seconds], "member_fit_seconds": self.member_fit_seconds,
                "forecast_seconds": round(self.forecast_seconds, 2), "forecast_origins": self.forecast_origins,
                "empirical_calls": self.empirical_calls, "skipped_retrains": list(self.skipped_retrains),
                "failures": {str(k): v for k, v in self.failures.items() if v}}

    # ------------------------------------------------------------------ fits and blocks
    def _model(self, fit: int):
        """The model fitted on the columns before minute ``fit`` (fitted on first use)."""
        if fit not in self._models:
            lo = max(0, fit - self.settings.train_window_min)
            train = self._panel(lo, fit)
            say = self.progress or log.info
            say(f"ensemble source: fit at minute {fit} on minutes {lo}..{fit - 1} ({train.n_series} series)")
            started = time.perf_counter()
            model = production_model(self.settings, members=self.members, quantiles=self.levels,
                                     progress=lambda line: log.debug(line))
            model.fit_panel(train)
            self.fit_seconds.append(time.perf_counter() - started)
            self.retrains += 1
            self.retrain_minutes.append(fit)
            self.failures[fit] = dict(getattr(model, "failures_", {}))
            members: dict[str, float] = {}
            for shard in getattr(model, "shards_", {}).values():
                for name, seconds in getattr(shard, "fit_seconds_", {}).items():
                    members[name] = members.get(name, 0.0) + seconds
            self.member_fit_seconds.append({name: round(v, 2) for name, v in members.items()})
            self._models[fit] = model
        return self._models[fit]

    def _cached(self, col: int, fit: int) -> tuple[int, dict[str, np.ndarray]]:
        """(first origin, arrays ``(N, origins, horizon_min)`` per column) of the block holding ``col``."""
        first, end = self._block(col, fit)
        while first not in self._blocks and self._receive is not None:
            received = self._receive()
            if received is None:
                raise RuntimeError(f"the forecasting process ended without the block of minute {first}")
            self._blocks[received[0]] = received
        if first not in self._blocks:
            model = self._model(fit)
            lo = max(0, first - self.settings.forecast_lookback_min)
            # the block's panel ends before its last origin: no origin can read a later column
            context = self._panel(lo, end - 1)
            origins = [o - lo for o in range(first, end)]
            started = time.perf_counter()
            arrays = model.forecast(context, origins, self.horizon_min)
            self.forecast_seconds += time.perf_counter() - started
            self.forecast_origins += len(origins)
            wanted = {quantile_column(q) for q in self.levels} | {"p_any"}
            missing = wanted - set(arrays)
            if missing:
                raise RuntimeError(f"the ensemble gave no {sorted(missing)}; it has {sorted(arrays)}")
            self._blocks[first] = (first, {name: arrays[name].astype(np.float32) for name in sorted(wanted)})
            if self.progress is not None:
                self.progress(f"ensemble source: forecast minutes {first}..{end - 1}")
        return self._blocks[first]

    def _panel(self, lo: int, hi: int) -> Panel:
        """Columns ``lo .. hi - 1`` of the replay as a forecasting panel (1-minute steps)."""
        return Panel(np.asarray(self.panel.ids, dtype=object), self.panel.start + pd.Timedelta(minutes=lo),
                     pd.Timedelta(minutes=1), np.asarray(self.panel.counts[:, lo:hi], dtype=np.float64))
