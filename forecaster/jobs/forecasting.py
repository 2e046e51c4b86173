"""The forecast job (every minute) and the nightly retrain job.

* :func:`forecast_job` loads the champion once per version, conditions it on
  the latest history from the store (no refit) and writes 1..60-minute
  quantile forecasts for every registered model. Without a champion yet, a
  fallback-only ensemble fitted on the same history keeps forecasts flowing.
  Rows forecast by a fallback model (that one, or a failed shard's) are stored
  without a model version; the summary says which shards fell back and which
  members failed in this run (each also logged at WARNING, rate-limited).
* :func:`retrain_job` trains a challenger on the history up to a held-out
  tail, scores challenger and champion on the same held-out origins, saves the
  challenger under ``models/<version>/`` and promotes it only if its weighted
  quantile loss is not worse (a holdout that cannot score the champion, with
  no known minute or only zeros, keeps the champion: :func:`_promotion`).
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import time
import uuid
from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from forecaster.contracts.forecast import history_request_rate_rpm
from forecaster.distributed.executor import (BATCH, FORECAST, ExecutorUnavailable, InlineExecutor, executor_for,
                                             job_executor)
from forecaster.forecast.backtest import MethodForecasts, Protocol, evaluate
from forecaster.forecast.ensemble import Ensemble
from forecaster.forecast.panel import Panel
from forecaster.forecast.registry import ChampionCache, promote, register, save_version, set_status
from forecaster.forecast.sharded import ShardedEnsemble, production_model
from forecaster.jobs.history import HistoryCache
from forecaster.settings import Settings
from forecaster.store.catalog import known_model_ids
from forecaster.store.forecasts import MAX_FORECAST_VALUE, write_forecast_arrays
from forecaster.store.invocations import read_grid

log = logging.getLogger(__name__)

_champions = ChampionCache()
_history = HistoryCache()


def _minute(now: datetime) -> datetime:
    return now.astimezone(timezone.utc).replace(second=0, microsecond=0)


def model_ids(engine: Engine) -> list[str]:
    return sorted(known_model_ids(engine))


def history(engine: Engine, ids: list[str], *, end: datetime, minutes: int) -> Panel:
    """Per-minute counts of ``ids`` over the ``minutes`` before ``end`` as a panel (NaN = unknown).

    Models with no known minute in the window are left out.
    """
    ids, grid_ds, grid = read_grid(engine, ids, end - timedelta(minutes=minutes), end)
    known = ~np.isnan(grid).all(axis=1)
    return Panel(np.asarray(ids, dtype=object)[known], grid_ds[0], pd.Timedelta(minutes=1), grid[known])


def _with_executor(model, settings: Settings, purpose: str = BATCH, *, executor=None):
    """``model``, a sharded one on ``executor`` or else the executor of these settings for ``purpose`` (Dask, pool
    or inline; see :func:`~forecaster.distributed.executor.executor_for`).

    A sharded model comes back as a shallow copy that holds the executor: the cached champion is shared by the
    forecast job (its own executor, see :func:`~forecaster.distributed.executor.executor_for`) and the retrain
    (which forecasts it on the holdout on the batch executor), and setting the executor on the shared object
    would let one job's run land on the other's executor.

    The forecast job's copies share the shared object's ``fallbacks_`` (failed shards' fallback models, each kept
    for :data:`~forecaster.forecast.sharded.FALLBACK_REFIT`): on a copy of its own each run would fit them again.
    Any other purpose's copy gets an empty one of its own (the retrain's holdout forecasts past origins; its
    fallbacks would only displace the forecast job's).
    """
    if isinstance(model, ShardedEnsemble):
        shared, model = model, object.__new__(type(model))
        fallbacks = shared.__dict__.setdefault("fallbacks_", {}) if purpose == FORECAST else {}
        # not copy.copy: that goes through __getstate__, which drops the loaded shards and the model's folder
        model.__dict__.update(shared.__dict__)
        model.fallbacks_ = fallbacks
        model.executor = executor if executor is not None else executor_for(settings, purpose)
    return model


def default_model(settings: Settings, *, progress=None, executor=None) -> ShardedEnsemble:
    """The production challenger: the default ensemble on shards of <= ``shard_max_series`` similar series.

    Built by :func:`forecaster.forecast.sharded.production_model`, the one factory
    the replays' :class:`~forecaster.planning.ensemble_source.EnsembleForecast`
    uses too; its output has every level of ``FORECAST_LEVELS`` and ``p_any``.
    """
    return production_model(settings, progress=progress, executor=executor)


_fallbacks: dict[str, tuple[datetime, Ensemble]] = {}  # database#horizon -> (fitted at, model)
FALLBACK_REFIT = timedelta(hours=1)


def _fallback_model(engine: Engine, panel: Panel, end: datetime, horizon: int) -> Ensemble:
    """The no-champion model: the fallback member alone, refitted hourly (its fit is what costs)."""
    key = f"{engine.url.render_as_string(hide_password=True)}#{horizon}"
    fitted_at, model = _fallbacks.get(key, (None, None))
    if model is None or not timedelta(0) <= end - fitted_at < FALLBACK_REFIT:
        model = Ensemble(members=[], horizon=horizon, progress=lambda line: log.debug(line)).fit_panel(panel)
        _fallbacks[key] = (end, model)
    return model


def forecast_job(engine: Engine, settings: Settings, now: datetime, *, cache: ChampionCache = _champions,
                 history_cache: HistoryCache = _history) -> dict:
    """Forecast every registered model ``settings.forecast_horizon_min`` minutes ahead and store it.

    The history comes from ``history_cache`` (re-read incrementally, see
    :mod:`forecaster.jobs.history`); a sharded champion forecasts its shards on
    the executor of ``settings`` (Dask, a local pool, or in this process).

    The summary's ``member_failures`` are this run's members (and quantile heads) that failed at forecast time:
    member -> series affected (their forecast went on without it), the first error text, and for a sharded
    champion the shards. ``fallback_shards`` are the shards that failed on every attempt (shard -> series, error)
    and were forecast by a fallback-only model; those rows are stored without a model version (NULL, as the
    no-champion fallback's are), the other rows under the champion's, and ``fallback_series`` counts them.

    A champion that loads but raises when it forecasts does not stop the job: the error is logged and reported as
    ``champion_error``, the cache drops that version (:meth:`~forecaster.forecast.registry.ChampionCache.failed`,
    retried ``retry_after_s`` later) and the run forecasts again with the newest former champion that loads, else
    with the fallback model, and stores those rows. A failure of the executor itself (no worker process could start,
    no temporary folder: :class:`~forecaster.distributed.executor.ExecutorUnavailable`) is not the champion's: that
    run forecasts the same champion in this process, logged and reported as ``executor_error``.
    """
    started = time.perf_counter()
    ids = model_ids(engine)
    if not ids:
        return {"models": 0, "skipped": "no models registered"}
    end = _minute(now)
    panel = history_cache.panel(engine, ids, end=end, minutes=settings.forecast_lookback_min)
    if not panel.n_series:
        return {"models": 0, "skipped": f"no known history for any of {len(ids)} models"}
    read_s = time.perf_counter() - started
    h = settings.forecast_horizon_min
    executor_error = None
    while True:
        version, ensemble = cache.get(engine)
        if ensemble is None:
            # No champion yet (first day), or none that forecasts: the fallback member alone, fitted on what we
            # have, once an hour.
            ensemble = _with_executor(_fallback_model(engine, panel, end, h), settings, FORECAST)
            arrays = ensemble.forecast(panel, [panel.n_steps], h)
            break
        ensemble = _with_executor(ensemble, settings, FORECAST)
        try:
            try:
                arrays = ensemble.forecast(panel, [panel.n_steps], h)
            except ExecutorUnavailable as error:
                # where the shards run failed (no worker process could start, no temporary folder...), not the
                # model: this run forecasts the same champion in this process (its deadline cannot be kept here)
                executor_error = str(error)
                log.error("forecast job: %s; this run forecasts in this process", error)
                ensemble = _with_executor(ensemble, settings, FORECAST,
                                          executor=InlineExecutor(retries=settings.shard_retries))
                arrays = ensemble.forecast(panel, [panel.n_steps], h)
            break
        except Exception as error:  # a version that loads but cannot forecast (code it was not pickled for...)
            # dropped for retry_after_s; forecast again with the newest former champion that loads, or the
            # fallback model. Each failed version is left out of the next get(), so this ends.
            cache.failed(version, error)
    forecast_s = time.perf_counter() - started - read_s
    columns = {("point" if k == ensemble.name else k): v[:, 0, :] for k, v in arrays.items()
               if k in (ensemble.name, "p_any") or k.startswith("q")}
    first_target = (panel.start + panel.n_steps * panel.step).to_pydatetime()
    rates = history_request_rate_rpm(panel.values)
    fallback = np.ones(panel.n_series, dtype=bool) if version is None else getattr(ensemble, "fallback_rows_", None)
    labels = version
    if version is not None and fallback is not None and fallback.any():
        # a failed shard's series were forecast by the fallback model, not by this version: stored without one.
        # One write all the same: the API snapshot loads only runs issued after the newest it has seen, so a
        # run committed in two parts with one issued_at would lose the second part for good to a poll between
        labels = [None if fell else version for fell in fallback]
    ids_out, columns, rates, labels, unusable = usable_series(list(panel.ids), columns, rates, labels)
    rows = write_forecast_arrays(engine, ids_out, first_target, columns, issued_at=now,
                                 model_version_id=labels, request_rate_rpm=rates) if ids_out else 0
    return {"models": panel.n_series, "rows": rows, **unusable, "model_version": version,
            "no_history": len(ids) - panel.n_series, "read_s": round(read_s, 3), "read": history_cache.last_read,
            "forecast_s": round(forecast_s, 3), "shards": getattr(ensemble, "forecast_run_", None),
            "member_failures": dict(getattr(ensemble, "forecast_failures_", {})),
            "fallback_shards": dict(getattr(ensemble, "fallback_shards_", {})),
            "fallback_series": int(fallback.sum()) if fallback is not None else 0,
            "champion_error": cache.last_error, "executor_error": executor_error,
            "seconds": round(time.perf_counter() - started, 3)}


def usable_series(ids: list[str], columns: dict[str, np.ndarray], rates: np.ndarray | None, labels
                  ) -> tuple[list[str], dict[str, np.ndarray], np.ndarray | None, object, dict]:
    """The forecast's series as the store takes them: a series with a NaN, infinite or too large value (a member's
    output gone wrong) is dropped, its model keeping its previous run (which ages into ``forecast_stale``, and the
    plan job holds the model's level), and negative values are clipped to 0, each logged and counted
    (``dropped_series``, ``clipped_series``), so that one bad series never fails the whole run.
    ``p_any`` is clipped to [0, 1]. Returns ``(ids, columns, rates, labels, counts)``."""
    values = [k for k in columns if k != "p_any"]
    bad = np.zeros(len(ids), dtype=bool)
    negative = np.zeros(len(ids), dtype=bool)
    for k in values:
        v = np.asarray(columns[k], dtype="float64")
        bad |= ~(np.isfinite(v) & (v <= MAX_FORECAST_VALUE)).all(axis=1)
        negative |= (v < 0).any(axis=1)
    negative &= ~bad
    out = dict(columns)
    if negative.any():
        log.warning("forecast job: %d series had negative values, clipped to 0 (e.g. %s)", int(negative.sum()),
                    ", ".join(str(ids[i]) for i in np.flatnonzero(negative)[:5]))
        for k in values:
            out[k] = np.maximum(np.asarray(out[k], dtype="float64"), 0.0)
    if "p_any" in out and out["p_any"] is not None:
        p = np.asarray(out["p_any"], dtype="float64")
        out["p_any"] = np.where(np.isnan(p), p, np.clip(p, 0.0, 1.0))
    if bad.any():
        log.warning("forecast job: %d series had NaN, infinite or too large values and are not stored this run "
                    "(their models keep their previous run): %s", int(bad.sum()),
                    ", ".join(str(ids[i]) for i in np.flatnonzero(bad)[:5]))
        keep = ~bad
        ids = [m for m, k in zip(ids, keep) if k]
        out = {k: np.asarray(v)[keep] for k, v in out.items()}
        rates = None if rates is None else np.asarray(rates)[keep]
        if isinstance(labels, list):
            labels = [label for label, k in zip(labels, keep) if k]
    return ids, out, rates, labels, {"dropped_series": int(bad.sum()), "clipped_series": int(negative.sum())}


def _holdout_protocol(n_steps: int, holdout: int, horizon: int) -> Protocol:
    fit_steps = n_steps - holdout
    origins = tuple(range(fit_steps, n_steps - horizon + 1, horizon))
    if fit_steps < 4 * horizon or not origins:
        raise ValueError(f"{n_steps} minutes of history are too few for a {holdout}-minute holdout")
    return Protocol("retrain-holdout", fit_steps, origins, horizon, 1.0, None, (1, 5, horizon))


def _scores(result, method: str) -> dict:
    row = result.summary[(result.summary["method"] == method) & (result.summary["subset"] == "all")].iloc[0]
    return {k: (None if pd.isna(row[k]) else float(row[k]))
            for k in ("wql", "mase_median", "mase", "coverage_q90", "spike_recall")}


def retrain_job(engine: Engine, settings: Settings, now: datetime, *, cache: ChampionCache = _champions,
                ensemble_factory=None) -> dict:
    """Train a challenger, compare it with the champion on held-out origins, promote if not worse.

    The summary's ``decision`` says why it was promoted or not (:func:`_promotion`).

    Args:
        ensemble_factory: builds the unfitted challenger (tests pass small ones);
            default: the full default ensemble.
    """
    started = time.perf_counter()
    _check_models_dir(settings.models_dir)  # before hours of fitting, not at the save after them
    latency_model = _retrain_latency_model(engine, settings, now)
    ids = model_ids(engine)
    end = _minute(now)
    panel = history(engine, ids, end=end, minutes=settings.train_window_min)
    if not panel.n_series:
        return {"skipped": "no history to train on", "latency_model": latency_model}
    first_known = int(np.flatnonzero(~np.isnan(panel.values).all(axis=0))[0])
    # no point learning from days before any data
    panel = Panel(panel.ids, panel.start + first_known * panel.step, panel.step, panel.values[:, first_known:])
    protocol = _holdout_protocol(panel.n_steps, settings.retrain_holdout_min, horizon=15)
    # a batch executor of this run's own, closed when it ends: its pool's workers hold the challenger's shards
    # and, after the holdout forecast, the champion's; kept for the process lifetime they doubled the memory of
    # the forecast job's own pool, which holds the champion's shards too
    with job_executor(settings, BATCH) as executor:
        factory = ensemble_factory or functools.partial(
            default_model, settings, progress=lambda line: log.info("retrain: %s", line), executor=executor)
        challenger = _with_executor(factory(), settings, executor=executor).fit_panel(panel.head(protocol.fit_steps))
        arrays = challenger.forecast(panel, protocol.origins, protocol.horizon)
        candidates = {"challenger": MethodForecasts(arrays[challenger.name], arrays.get("q0.1"), arrays.get("q0.9"))}
        champion_id, champion = cache.get(engine)
        unusable = None
        if cache.champion_id is not None and not cache.champion_loaded:
            # the champion row's own version does not load or failed to forecast (the cache may hold a former
            # champion in its place): the challenger is not compared with that one, it replaces the champion
            unusable = cache.last_error or f"champion {cache.champion_id} could not be loaded"
            log.warning("retrain: %s; the challenger is compared with no champion", unusable)
            champion_id, champion = cache.champion_id, None
        if champion is not None:
            try:
                theirs = _with_executor(champion, settings, executor=executor).forecast(
                    panel, protocol.origins, protocol.horizon)
                candidates["champion"] = MethodForecasts(theirs[champion.name], theirs.get("q0.1"),
                                                         theirs.get("q0.9"))
            except Exception as error:  # a champion that cannot forecast these series loses by default
                log.warning("champion %s could not forecast the holdout: %s", champion_id, error)
    result = evaluate(panel, protocol, candidates)
    scores = {name: _scores(result, name) for name in candidates}
    version_id = f"{end:%Y%m%dT%H%M}-{uuid.uuid4().hex[:6]}"  # data time + a suffix: reruns never collide
    path = save_version(challenger, settings.models_dir, version_id=version_id,
                        train_start=panel.start.to_pydatetime(),
                        train_end=(panel.start + protocol.fit_steps * panel.step).to_pydatetime(), scores=scores)
    try:
        register(engine, version_id=version_id, path=path, status="challenger",
                 train_start=panel.start.to_pydatetime(),
                 train_end=(panel.start + protocol.fit_steps * panel.step).to_pydatetime(),
                 members=[m["name"] for m in _members(challenger)], scores=scores)
    except BaseException:
        # a database outage (or an interrupt) before the row exists: no row will ever name this folder, and a
        # rerun saves a version of its own; a folder left by a kill here goes with the retention job's sweep
        shutil.rmtree(path, ignore_errors=True)
        raise
    promoted, decision = _promotion(scores, champion_id=champion_id, unusable=unusable)
    log.info("retrain: challenger %s %s: %s", version_id, "promoted" if promoted else "not promoted", decision)
    if promoted:
        promote(engine, version_id)
    else:
        set_status(engine, version_id, "rejected")  # never champion; "retired" is a former champion
    return {"version": version_id, "promoted": promoted, "decision": decision, "previous_champion": champion_id,
            "champion_error": unusable, "scores": scores, "failures": dict(getattr(challenger, "failures_", {})),
            "series": panel.n_series,
            "shards": getattr(challenger, "fit_run_", None), "latency_model": latency_model,
            "seconds": round(time.perf_counter() - started, 1)}


def _promotion(scores: dict, *, champion_id: str | None, unusable: str | None = None) -> tuple[bool, str]:
    """Whether the challenger replaces the champion, and why (the retrain's ``decision``).

    Without a champion, with one that the cache could not use (``unusable``: its files do not load, or it failed
    to forecast) or with one that could not forecast the holdout (no ``champion`` scores), the challenger is
    promoted whatever it scored: something must forecast. Otherwise only a finite challenger wQL not above a
    finite champion wQL promotes it. A missing or infinite score is no comparison: a holdout with no known minute
    (an ingest outage before the retrain) scores both None, one whose actuals are all 0 scores NaN (None) for a
    perfect forecast and inf for any other; the champion, which already forecast well enough to be kept, stays.

    Args:
        scores: :func:`_scores` per candidate (``challenger``, and ``champion`` when it forecast the holdout).
        champion_id: the champion row's version, None when there is none.
        unusable: why the champion itself cannot forecast (its files do not load, or it failed to forecast in the
            forecast job: ``ChampionCache.last_error``); None when the retrain holds it.
    """
    ours = scores["challenger"]["wql"]
    if champion_id is None:
        return True, "no champion to compare with"
    if unusable is not None:
        return True, f"champion {champion_id} is unusable: {unusable}"
    if "champion" not in scores:
        return True, f"champion {champion_id} could not forecast the holdout"
    theirs = scores["champion"]["wql"]
    if ours is None or theirs is None or not (np.isfinite(ours) and np.isfinite(theirs)):
        return False, (f"holdout wQL not comparable (challenger {ours}, champion {theirs}: no known minute in the "
                       f"holdout, or its actuals sum to 0); champion {champion_id} kept")
    if ours <= theirs:
        return True, f"challenger wQL {ours:.4f} <= champion {champion_id}'s {theirs:.4f}"
    return False, f"challenger wQL {ours:.4f} > champion {champion_id}'s {theirs:.4f}"


def _check_models_dir(models_dir) -> None:
    """Raise ``PermissionError``/``OSError`` naming ``models_dir`` unless a file can be created in it (created
    when missing): the retrain saves its challenger there only after the fit."""
    from pathlib import Path

    try:
        Path(models_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=models_dir, prefix=".write-probe-") as probe:  # unnamed where it can be
            probe.write(b"x")
    except OSError as error:
        # OSError(errno, ...) comes back as its subclass (PermissionError, FileNotFoundError...), as the error was
        raise OSError(error.errno, f"models_dir is not writable, so no challenger could be saved; not fitting one "
                                   f"({error.strerror or error})", str(models_dir)) from error


def _retrain_latency_model(engine: Engine, settings: Settings, now: datetime) -> str | None:
    """Nightly: refit the cold-start latency model on cold starts + transfers (see forecaster.coldstart.service).

    A failure is logged and leaves the previous latency model in place; it never stops the forecast retrain.
    """
    from forecaster.coldstart.service import train_latency_model

    try:
        return train_latency_model(engine, settings, now)
    except Exception:  # noqa: BLE001 - the forecast retrain must still run
        log.exception("latency model retrain failed; keeping the previous one")
        return None


def _members(ensemble) -> list[dict]:
    from forecaster.forecast.registry import member_report

    return member_report(ensemble)
