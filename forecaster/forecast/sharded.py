"""One ensemble per shard of similar series, fitted and forecast shard by shard on an executor.

Why shards of whole ensembles, and not LightGBM's / XGBoost's own Dask
interfaces: those distribute the training of *one* model over all workers,
which covers two of the five member families (RandomForest, ARIMA and the LSTM
have no such interface), needs every worker to take part in every boosting
round (one dead worker fails the whole fit, where a shard is simply run
again), and on this 2-core machine has no cores to gain. A shard is an
independent unit of work: fit, validation, conformal quantiles and forecasts
of a few thousand series, with the same code as on one machine.

Shards group *similar* series: series are sorted by their level (log of the
mean count) and then by their share of non-zero steps, and cut into
``ceil(N / shard_max_series)`` equal parts, so that each global tree model
learns from series of comparable scale and intermittency. Measured on the
Azure day (docs/scale.md): four shards instead of one cost about 0.5% of wQL
and a point of spike recall.

Series the shards never saw (registered after the retrain) are routed to the
shard whose level range contains their recent level; the shard's ensemble
forecasts them with its fallback member, as an unsharded ensemble would.

A saved sharded ensemble keeps each shard in its own file
(``models/<version>/shards/<key>.pkl``), so that a worker loads only the
shards it is given, once per process (:func:`load_shard`). The model records
each file's size when it saves it; :meth:`ShardedEnsemble.verify_shards`
(run by :func:`~forecaster.forecast.registry.load_ensemble`) checks that every
shard file is there, has that size and is a whole pickle, so that a version
whose shard files are missing or cut short is never taken for a champion.

A shard that fails at forecast time on every attempt is forecast by a
fallback-only ensemble fitted in the calling process on that shard's series.
That fit is what costs (about 70 s for a 5,000-series shard), so it is kept
and refitted at most hourly (:data:`FALLBACK_REFIT`, data time) while the
shard keeps failing. Its series are listed in ``fallback_rows_`` and
``fallback_shards_``, and the failure is logged at WARNING, rate-limited as the
members' failures are (:data:`~forecaster.forecast.ensemble.member_failure_log`).
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from forecaster.contracts.forecast import FORECAST_LEVELS
from forecaster.forecast.ensemble import Ensemble, failures_reported_by_caller, member_failure_log
from forecaster.forecast.members import Member
from forecaster.forecast.panel import Panel, forecast_frame
from forecaster.settings import member_families

log = logging.getLogger(__name__)

SHARDS_DIR = "shards"
#: A failed shard's fallback model is refitted at most this often (data time), as the forecast job's own
#: no-champion fallback is (:func:`forecaster.jobs.forecasting._fallback_model`).
FALLBACK_REFIT = pd.Timedelta(hours=1)


class ShardFilesError(RuntimeError):
    """A saved sharded ensemble whose shard files are missing or damaged (see :meth:`ShardedEnsemble.verify_shards`)."""


def series_levels(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per series: ``log1p`` of the mean known count, and the share of known steps that are non-zero."""
    known = ~np.isnan(values)
    n_known = np.maximum(known.sum(axis=1), 1)
    filled = np.where(known, values, 0.0)
    level = np.log1p(filled.sum(axis=1) / n_known)
    busy = (filled > 0).sum(axis=1) / n_known
    return level, busy


def plan_shards(panel: Panel, shard_max_series: int) -> dict[str, np.ndarray]:
    """Shard key -> row indices of ``panel``: similar series together, shards of equal size."""
    if shard_max_series < 1:
        raise ValueError(f"shard_max_series must be at least 1, got {shard_max_series}")
    n_shards = max(1, -(-panel.n_series // shard_max_series))
    level, busy = series_levels(panel.values)
    order = np.lexsort((panel.ids.astype(str), busy, level))  # by level, then intermittency, then name
    width = len(str(n_shards - 1))
    return {f"s{k:0{width}d}": np.sort(rows) for k, rows in enumerate(np.array_split(order, n_shards))}


def _sub(panel: Panel, rows: np.ndarray) -> Panel:
    return Panel(panel.ids[rows], panel.start, panel.step, panel.values[rows])


# ------------------------------------------------------------------ worker-side functions
# Top-level functions: they are pickled by reference and run in pool processes or Dask workers.

_loaded: OrderedDict[str, Ensemble] = OrderedDict()
_loaded_lock = threading.Lock()
LOADED_SHARDS_MAX = 64


def load_shard(path: str) -> Ensemble:
    """The shard ensemble saved at ``path``, loaded once per process (small LRU; version files never change)."""
    with _loaded_lock:
        if path in _loaded:
            _loaded.move_to_end(path)
            return _loaded[path]
    with open(path, "rb") as handle:
        ensemble = pickle.load(handle)
    with _loaded_lock:
        _loaded[path] = ensemble
        while len(_loaded) > LOADED_SHARDS_MAX:
            _loaded.popitem(last=False)
    return ensemble


def fit_shard(factory: Callable[[], Ensemble], panel: Panel) -> tuple[Ensemble, float]:
    """Fit one shard's ensemble; returns it (without its progress callback) and the seconds taken."""
    started = time.perf_counter()
    ensemble = factory()
    ensemble.progress = None
    ensemble.fit_panel(panel)
    return ensemble, time.perf_counter() - started


def forecast_shard(shard: Ensemble | str, panel: Panel, origins: Sequence[int], h: int,
                   members: bool = False) -> tuple[dict[str, np.ndarray], dict[str, dict], float]:
    """Forecast one shard: its arrays, this call's member failures (member -> ``{"series", "error"}``; a shard
    cached in this process that fails as it did on the last run reports it again) and the seconds taken.

    The failures are not logged here (a worker's log may go nowhere): the caller logs them.
    """
    started = time.perf_counter()
    ensemble = load_shard(shard) if isinstance(shard, str) else shard
    with failures_reported_by_caller():
        arrays = ensemble.forecast(panel, origins, h, members=members)
    failures = {name: dict(failure) for name, failure in getattr(ensemble, "forecast_failures_", {}).items()}
    return arrays, failures, time.perf_counter() - started


# ------------------------------------------------------------------ the model


class ShardedEnsemble:
    """Ensembles on shards of similar series, with the :class:`Ensemble` contract (fit / forecast / predict).

    Args:
        factory: builds one shard's unfitted ensemble (must pickle: a
            ``functools.partial(Ensemble, ...)`` does).
        shard_max_series: most series per shard.
        executor: a :class:`forecaster.distributed.executor.Executor`; ``None``
            runs shards in this process. Not saved with the model: the job that
            loads a model sets the executor of its own settings.
    """

    name = "ensemble"

    def __init__(self, factory: Callable[[], Ensemble], *, shard_max_series: int = 5000, executor=None,
                 progress: Callable[[str], None] | None = None):
        self.factory = factory
        self.shard_max_series = shard_max_series
        self.executor = executor
        self.progress = progress

    def _executor(self):
        if self.executor is None:
            from forecaster.distributed.executor import InlineExecutor

            self.executor = InlineExecutor()
        return self.executor

    # ------------------------------------------------------------------ fit
    def fit(self, df: pd.DataFrame) -> ShardedEnsemble:
        return self.fit_panel(Panel.from_long(df))

    def fit_panel(self, panel: Panel) -> ShardedEnsemble:
        say = self.progress or log.info
        plan = plan_shards(panel, self.shard_max_series)
        executor = self._executor()
        say(f"sharded: {panel.n_series} series in {len(plan)} shards of <= {self.shard_max_series}, "
            f"{executor.backend} with {executor.workers} worker(s)")
        run = executor.run(fit_shard, {key: (self.factory, _sub(panel, rows)) for key, rows in plan.items()},
                           name="fit-shard")
        self.shards_: dict[str, Ensemble | None] = {}
        self.shard_files_: dict[str, str] = {}
        self.fit_seconds_: dict[str, float] = {}
        self.failures_: dict[str, str] = {}
        for key, rows in plan.items():
            if key in run.results:
                self.shards_[key], self.fit_seconds_[key] = run.results[key]
                for member, error in getattr(self.shards_[key], "failures_", {}).items():
                    self.failures_[f"{key}/{member}"] = error
            else:  # every attempt failed: this shard's series get the fallback alone, fitted here
                self.failures_[f"{key} (fit)"] = run.failures[key]
                say(f"sharded: shard {key} failed on every attempt ({run.failures[key]}); fallback only")
                self.shards_[key] = Ensemble(members=[], horizon=getattr(self.factory(), "horizon", 60)).fit_panel(
                    _sub(panel, rows))
        self.fit_run_ = run.summary()
        self.shard_ids_ = {key: panel.ids[rows] for key, rows in plan.items()}
        self.shard_of_ = pd.Series(np.concatenate([[k] * len(r) for k, r in plan.items()]),
                                   index=np.concatenate([panel.ids[r] for r in plan.values()]))
        level, _ = series_levels(panel.values)
        keys = list(plan)
        self.route_keys_ = keys
        self.route_upper_ = np.array([level[plan[k]].max() if len(plan[k]) else -np.inf for k in keys])
        self.step_ = panel.step
        return self

    # ------------------------------------------------------------------ forecast
    def _route(self, panel: Panel) -> dict[str, np.ndarray]:
        """Shard key -> rows of ``panel``: known series to their shard, new ones by level."""
        keys = self.shard_of_.reindex(panel.ids).to_numpy(dtype=object)
        unseen = pd.isna(keys)
        if unseen.any():
            level, _ = series_levels(panel.values[unseen])
            position = np.minimum(np.searchsorted(self.route_upper_, level), len(self.route_keys_) - 1)
            keys[unseen] = np.asarray(self.route_keys_, dtype=object)[position]
        return {key: np.flatnonzero(keys == key) for key in self.route_keys_ if (keys == key).any()}

    def _shard_ref(self, key: str) -> Ensemble | str:
        shard = self.shards_.get(key)
        return shard if shard is not None else str(self.base_path_ / self.shard_files_[key])

    def forecast(self, panel: Panel, origins: Sequence[int], h: int, *, members: bool = False) -> dict[str, np.ndarray]:
        """Arrays ``(N, len(origins), h)`` per output column, as :meth:`Ensemble.forecast`.

        What this call met is in ``forecast_failures_`` (member -> series affected over all shards, the first error
        text, the shards), ``fallback_shards_`` (shard -> series, error: shards that failed on every attempt and
        were forecast by the fallback model) and ``fallback_rows_`` (bool per row of ``panel``: forecast by that
        fallback, not by this model's members).
        """
        if not hasattr(self, "route_keys_"):
            raise RuntimeError("ShardedEnsemble is not fitted; call fit() first")
        origins = list(origins)
        routes = self._route(panel)
        run = self._executor().run(
            forecast_shard,
            {key: (self._shard_ref(key), _sub(panel, rows), origins, h, members) for key, rows in routes.items()},
            name="forecast-shard",
        )
        self.forecast_run_ = run.summary()
        self.forecast_seconds_ = {}
        self.forecast_failures_: dict[str, dict] = {}
        self.fallback_shards_: dict[str, dict] = {}
        self.fallback_rows_ = np.zeros(panel.n_series, dtype=bool)
        outputs: dict[str, np.ndarray] = {}
        for key, rows in routes.items():
            if key in run.results:
                arrays, failures, self.forecast_seconds_[key] = run.results[key]
                for member, failure in failures.items():
                    self.failures_[f"{key}/{member} (forecast)"] = failure["error"]
                    total = self.forecast_failures_.setdefault(
                        member, {"series": 0, "error": failure["error"], "shards": []})
                    total["series"] += failure["series"]
                    total["shards"].append(key)
                    member_failure_log.warn(f"shard {key}", member, failure["error"], failure["series"])
            else:  # the fallback alone, fitted here on what precedes the first origin (kept for an hour)
                error = run.failures[key]
                self.failures_[f"{key} (forecast)"] = error
                sub = _sub(panel, rows)
                arrays = self._fallback(key, sub, origins, h).forecast(sub, origins, h)
                self.fallback_shards_[key] = {"series": len(rows), "error": error}
                self.fallback_rows_[rows] = True
                member_failure_log.warn(f"shard {key}", "the whole shard", error, len(rows),
                                        action="forecast by the fallback model")
            for column, values in arrays.items():
                if column not in outputs:
                    outputs[column] = np.full((panel.n_series, len(origins), h), np.nan)
                outputs[column][rows] = values
        return outputs

    def _fallback(self, key: str, sub: Panel, origins: list[int], h: int) -> Ensemble:
        """The fallback-only ensemble of failed shard ``key``, fitted on ``sub`` before its first origin; the one
        fitted before is reused while its fit is under :data:`FALLBACK_REFIT` older (data time) than this one's
        would be: a shard that keeps failing must not cost a fit on every forecast run."""
        end = sub.start + max(1, min(origins)) * sub.step
        cache = self.__dict__.setdefault("fallbacks_", {})
        fitted_end, horizon, model = cache.get(key, (None, None, None))
        if model is None or horizon != h or not pd.Timedelta(0) <= end - fitted_end < FALLBACK_REFIT:
            model = Ensemble(members=[], horizon=h).fit_panel(sub.head(max(1, min(origins))))
            cache[key] = (end, h, model)
        return model

    def predict(self, h: int, history: pd.DataFrame, *, members: bool = False) -> pd.DataFrame:
        """Forecast ``h`` steps after the end of ``history`` (no refit); columns as :meth:`Ensemble.predict`."""
        panel = Panel.from_long(history, step=self.step_)
        arrays = self.forecast(panel, [panel.n_steps], h, members=members)
        return forecast_frame(panel, panel.n_steps, {k: v[:, 0, :] for k, v in arrays.items()})

    # ------------------------------------------------------------------ reports and storage
    def member_report(self) -> list[dict]:
        """Each member's share of series over all shards (series-weighted)."""
        from forecaster.forecast.registry import member_report

        total = sum(len(ids) for ids in self.shard_ids_.values()) or 1
        shares: dict[str, float] = {}
        for key, ids in self.shard_ids_.items():
            shard = self.shards_.get(key) or load_shard(self._shard_ref(key))
            for row in member_report(shard):
                shares[row["name"]] = shares.get(row["name"], 0.0) + (row["series_share"] or 0.0) * len(ids) / total
        return [{"name": name, "series_share": round(share, 4)} for name, share in shares.items()]

    def save_shards(self, folder: Path) -> None:
        """Write each shard to ``folder/shards/<key>.pkl``; the pickled model then refers to them by name and
        records their sizes (``shard_bytes_``, checked by :meth:`verify_shards`)."""
        (folder / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        sizes = self.__dict__.setdefault("shard_bytes_", {})
        for key, shard in self.shards_.items():
            if shard is None:
                continue
            name = f"{SHARDS_DIR}/{key}.pkl"
            shard.progress = None
            with open(folder / name, "wb") as handle:
                pickle.dump(shard, handle, protocol=pickle.HIGHEST_PROTOCOL)
            self.shard_files_[key] = name
            sizes[key] = (folder / name).stat().st_size

    def attach(self, folder: Path) -> None:
        """After loading from ``folder``: shards are read from there (lazily, by whoever forecasts them)."""
        self.base_path_ = Path(folder).resolve()

    def verify_shards(self) -> None:
        """Raise :class:`ShardFilesError` unless every shard file of this attached model is there and whole.

        Cheap, whatever the shards' size: each file must exist, have the size recorded when it was saved (a model
        saved before sizes were recorded: be non-empty), start as a pickle of protocol 2 or later does and end
        with the pickle STOP opcode. A file cut short, emptied, or missing (a volume partly synced or not
        mounted) fails; damage inside a file of the right size is met only when a worker unpickles it.
        """
        if not getattr(self, "shard_files_", None):
            return  # shards held in the model itself
        base = getattr(self, "base_path_", None)
        if base is None:
            raise RuntimeError("ShardedEnsemble.verify_shards needs attach(folder) first")
        sizes = getattr(self, "shard_bytes_", {})
        problems = []
        for key in self.shards_:
            if self.shards_[key] is not None:
                continue
            name = self.shard_files_.get(key)
            if name is None:
                problems.append(f"{key}: no file recorded")
                continue
            path = base / name
            try:
                size = path.stat().st_size
                with open(path, "rb") as handle:
                    head = handle.read(2)
                    if size:
                        handle.seek(size - 1)
                    tail = handle.read(1)
            except OSError as error:
                problems.append(f"{name}: {type(error).__name__}: {error.strerror or error}")
                continue
            if key in sizes and size != sizes[key]:
                problems.append(f"{name}: {size} bytes, saved as {sizes[key]}")
            elif not size or head[:1] != pickle.PROTO or head[1:2] < b"\x02" or tail != pickle.STOP:
                problems.append(f"{name}: not a whole pickle ({size} bytes)")
        if problems:
            raise ShardFilesError(f"{len(problems)} of {len(self.shards_)} shard files unusable in {base}: "
                                  + "; ".join(problems))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["executor"] = None  # a Dask client or a process pool is not part of the model
        state["progress"] = None
        state.pop("fallbacks_", None)  # failed shards' fallbacks of this process's forecasts
        if state.get("shard_files_"):
            # saved shards live in their own files; the model itself keeps only their names
            state["shards_"] = {key: None for key in state["shards_"]}
        state.pop("base_path_", None)
        return state


def production_model(settings, *, members: Sequence[Member] | None = None, quantiles: Sequence[float] = FORECAST_LEVELS,
                     progress: Callable[[str], None] | None = None, executor=None) -> ShardedEnsemble:
    """The product's forecaster, unfitted: what the nightly retrain trains and the replays' ensemble source uses.

    The default ensemble (:func:`~forecaster.forecast.ensemble.default_members`
    of ``settings.forecast_members`` plus the fallback, ``settings.forecast_horizon_min`` horizons, the
    :data:`~forecaster.contracts.forecast.FORECAST_LEVELS`) on shards of at most
    ``settings.shard_max_series`` similar series, run on the executor of
    ``settings`` (Dask, a local pool, or in this process).

    Args:
        settings: a :class:`forecaster.settings.Settings`.
        members: unfitted members instead of the default ones (tests, quick replays); the fallback is added.
        quantiles: quantile levels of the output.
        progress: called with one line per stage.
        executor: the executor to run on; default: the settings' batch executor
            (:func:`~forecaster.distributed.executor.executor_for`).
    """
    import functools

    from forecaster.distributed.executor import executor_for

    factory = functools.partial(Ensemble, members=None if members is None else list(members),
                                families=member_families(settings.forecast_members),
                                horizon=settings.forecast_horizon_min, quantiles=tuple(quantiles),
                                fit_threads=settings.forecast_fit_threads,
                                weighting=settings.forecast_weighting)
    return ShardedEnsemble(factory, shard_max_series=settings.shard_max_series,
                           executor=executor or executor_for(settings), progress=progress)
