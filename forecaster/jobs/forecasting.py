"""The forecast job (every minute) and the nightly retrain job.

* :func:`forecast_job` loads the champion once per version, conditions it on
  the latest history from the store (no refit) and writes 1..60-minute
  quantile forecasts for every registered model. Without a champion yet, a
  fallback-only ensemble fitted on the same history keeps forecasts flowing.
* :func:`retrain_job` trains a challenger on the history up to a held-out
  tail, scores challenger and champion on the same held-out origins, saves the
  challenger under ``models/<version>/`` and promotes it only if its weighted
  quantile loss is not worse.
"""

from __future__ import annotations

import logging
import time
import uuid
from datetime import datetime, timedelta, timezone

import pandas as pd
from sqlalchemy import Engine, text

from forecaster.forecast.backtest import MethodForecasts, Protocol, evaluate
from forecaster.forecast.ensemble import Ensemble
from forecaster.forecast.panel import Panel
from forecaster.forecast.registry import ChampionCache, promote, register, save_version, set_status
from forecaster.settings import Settings
from forecaster.store.forecasts import write_forecasts
from forecaster.store.invocations import read_counts

log = logging.getLogger(__name__)

_champions = ChampionCache()


def _minute(now: datetime) -> datetime:
    return now.astimezone(timezone.utc).replace(second=0, microsecond=0)


def model_ids(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT id FROM serving_models ORDER BY id")).scalars())


def history(engine: Engine, ids: list[str], *, end: datetime, minutes: int) -> pd.DataFrame:
    """Per-minute counts of ``ids`` over the ``minutes`` before ``end`` (NaN = unknown)."""
    return read_counts(engine, ids, end - timedelta(minutes=minutes), end)


def _to_store_frame(predicted: pd.DataFrame, name: str) -> pd.DataFrame:
    frame = predicted.rename(columns={name: "point"})
    keep = ["unique_id", "ds", "point", "p_any"] + [c for c in frame.columns if c.startswith("q")]
    return frame[keep]


def forecast_job(engine: Engine, settings: Settings, now: datetime, *, cache: ChampionCache = _champions) -> dict:
    """Forecast every registered model ``settings.forecast_horizon_min`` minutes ahead and store it."""
    started = time.perf_counter()
    ids = model_ids(engine)
    if not ids:
        return {"models": 0, "skipped": "no models registered"}
    end = _minute(now)
    frame = history(engine, ids, end=end, minutes=settings.forecast_lookback_min)
    known = frame.groupby("unique_id")["y"].count()
    without_data = sorted(known[known == 0].index)
    frame = frame[~frame["unique_id"].isin(without_data)]
    if frame.empty:
        return {"models": 0, "skipped": f"no known history for any of {len(ids)} models"}
    read_s = time.perf_counter() - started
    version, ensemble = cache.get(engine)
    if ensemble is None:
        # No champion yet (first day): the fallback member alone, fitted on what we have.
        ensemble = Ensemble(members=[], horizon=settings.forecast_horizon_min,
                            progress=lambda line: log.debug(line)).fit(frame)
    predicted = ensemble.predict(settings.forecast_horizon_min, frame)
    rows = write_forecasts(engine, _to_store_frame(predicted, ensemble.name), issued_at=now,
                           model_version_id=version)
    return {"models": int(predicted["unique_id"].nunique()), "rows": rows, "model_version": version,
            "no_history": len(without_data), "read_s": round(read_s, 3),
            "seconds": round(time.perf_counter() - started, 3)}


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

    Args:
        ensemble_factory: builds the unfitted challenger (tests pass small ones);
            default: the full default ensemble.
    """
    started = time.perf_counter()
    ids = model_ids(engine)
    end = _minute(now)
    frame = history(engine, ids, end=end, minutes=settings.train_window_min)
    frame = frame[frame.groupby("unique_id")["y"].transform("count") > 0]
    if frame.empty:
        return {"skipped": "no history to train on"}
    first_known = frame.loc[frame["y"].notna(), "ds"].min()
    frame = frame[frame["ds"] >= first_known]  # no point learning from days before any data
    panel = Panel.from_long(frame)
    protocol = _holdout_protocol(panel.n_steps, settings.retrain_holdout_min, horizon=15)
    factory = ensemble_factory or (lambda: Ensemble(horizon=settings.forecast_horizon_min,
                                                    progress=lambda line: log.info("retrain: %s", line)))
    challenger = factory().fit_panel(panel.head(protocol.fit_steps))
    arrays = challenger.forecast(panel, protocol.origins, protocol.horizon)
    candidates = {"challenger": MethodForecasts(arrays[challenger.name], arrays.get("q0.1"), arrays.get("q0.9"))}
    champion_id, champion = cache.get(engine)
    if champion is not None:
        try:
            theirs = champion.forecast(panel, protocol.origins, protocol.horizon)
            candidates["champion"] = MethodForecasts(theirs[champion.name], theirs.get("q0.1"), theirs.get("q0.9"))
        except Exception as error:  # a champion that cannot forecast these series loses by default
            log.warning("champion %s could not forecast the holdout: %s", champion_id, error)
    result = evaluate(panel, protocol, candidates)
    scores = {name: _scores(result, name) for name in candidates}
    version_id = f"{end:%Y%m%dT%H%M}-{uuid.uuid4().hex[:6]}"  # data time + a suffix: reruns never collide
    path = save_version(challenger, settings.models_dir, version_id=version_id,
                        train_start=panel.start.to_pydatetime(),
                        train_end=(panel.start + protocol.fit_steps * panel.step).to_pydatetime(), scores=scores)
    register(engine, version_id=version_id, path=path, status="challenger", train_start=panel.start.to_pydatetime(),
             train_end=(panel.start + protocol.fit_steps * panel.step).to_pydatetime(),
             members=[m["name"] for m in _members(challenger)], scores=scores)
    ours = scores["challenger"]["wql"]
    theirs = scores.get("champion", {}).get("wql")
    promoted = theirs is None or (ours is not None and ours <= theirs)
    if promoted:
        promote(engine, version_id)
    else:
        set_status(engine, version_id, "retired")
    return {"version": version_id, "promoted": promoted, "previous_champion": champion_id, "scores": scores,
            "failures": dict(getattr(challenger, "failures_", {})), "series": panel.n_series,
            "seconds": round(time.perf_counter() - started, 1)}


def _members(ensemble) -> list[dict]:
    from forecaster.forecast.registry import member_report

    return member_report(ensemble)
