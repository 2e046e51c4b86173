"""``prewarm backtest``: the rolling-origin protocol of EVALUATION.md on whatever the store holds.

Reads every registered model's counts over the ingested window, applies the
"any other trace" protocol (fit on the first 80%, an origin every hour, 15
one-minute or 12 five-minute horizons, no refit), scores the ensemble and the
naive peers, and writes the per-series, per-horizon table to the store
(``backtest_runs``, ``backtest_results``) and to CSV.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import pandas as pd
from sqlalchemy import Engine

from forecaster.forecast.backtest import BacktestResult, evaluate, generic_protocol, run_backtest
from forecaster.forecast.ensemble import Ensemble
from forecaster.forecast.members import MovingAverage, Naive
from forecaster.forecast.panel import Panel
from forecaster.settings import MEMBER_FAMILIES, member_families
from forecaster.store.backtests import RESULT_COLUMNS, ingested_window, store_result
from forecaster.store.catalog import known_model_ids
from forecaster.store.invocations import read_counts

log = logging.getLogger(__name__)



def select_members(names: list[str] | None, horizon: int, settings=None) -> list:
    """The default members whose names are listed; the fallback is always added.

    ``None``: the families ``settings.forecast_members`` names (``PREWARM_FORECAST_MEMBERS``), all five without
    settings."""
    from forecaster.forecast.ensemble import default_members

    if names is None:
        return default_members(horizon, families=MEMBER_FAMILIES if settings is None
                               else member_families(settings.forecast_members))
    members = default_members(horizon)
    known = {m.name for m in members}
    unknown = sorted(set(names) - known - {"fallback"})
    if unknown:
        raise ValueError(f"unknown members {unknown}; choose from {sorted(known)} (the fallback is always in)")
    return [m for m in members if m.name in names]


def run_store_backtest(
    engine: Engine,
    *,
    start: datetime | None = None,
    end: datetime | None = None,
    step_seconds: int = 60,
    members: list[str] | None = None,
    progress=log.info,
    settings=None,
) -> tuple[int, BacktestResult]:
    """Backtest the ensemble (of ``members``; all by default) and the naive peers on stored data.

    With ``settings``, the ensemble is sharded (``shard_max_series``) and its
    shards run on the executor those settings name (Dask, a process pool, or
    in-process), exactly as in the nightly retrain.
    """
    lo, hi = ingested_window(engine, step_seconds)
    start, end = start or lo, end or hi
    step = pd.Timedelta(seconds=step_seconds)
    start = pd.Timestamp(start).tz_convert("UTC").ceil(step).to_pydatetime()
    end = pd.Timestamp(end).tz_convert("UTC").floor(step).to_pydatetime()
    ids = sorted(known_model_ids(engine))
    frame = read_counts(engine, ids, start, end, step_seconds=step_seconds)
    frame = frame[frame.groupby("unique_id")["y"].transform("count") > 0]
    panel = Panel.from_long(frame)
    protocol = generic_protocol(panel.n_steps, step_seconds / 60.0, name="store")
    progress(f"backtest: {panel.n_series} series x {panel.n_steps} steps, fit on {protocol.fit_steps}, "
             f"{len(protocol.origins)} origins, horizons 1..{protocol.horizon}")
    if settings is None:
        model = Ensemble(members=select_members(members, protocol.horizon), horizon=protocol.horizon,
                         progress=progress)
        forecasts = run_backtest(model, panel, protocol)
    else:
        from forecaster.distributed.executor import job_executor
        from forecaster.forecast.sharded import ShardedEnsemble

        with job_executor(settings) as executor:  # its pool's workers end with the backtest
            model = ShardedEnsemble(
                functools.partial(Ensemble, members=select_members(members, protocol.horizon, settings),
                                  horizon=protocol.horizon, weighting=settings.forecast_weighting),
                shard_max_series=settings.shard_max_series, executor=executor, progress=progress)
            forecasts = run_backtest(model, panel, protocol)
    for peer in (Naive(), MovingAverage(int(60 / (step_seconds / 60)) or 1)):
        peer_model = Ensemble(members=[peer], horizon=protocol.horizon, fallback=False)
        peer_forecasts = run_backtest(peer_model, panel, protocol)
        forecasts[peer.name] = peer_forecasts[peer_model.name]
    result = evaluate(panel, protocol, forecasts)
    run_id = store_result(engine, result.table.reindex(columns=RESULT_COLUMNS),
                          json.loads(result.summary.to_json(orient="records")), protocol=asdict(protocol),
                          start=start, end=end, step_seconds=step_seconds)
    return run_id, result


def write_csv(result: BacktestResult, path: Path) -> tuple[Path, Path]:
    """``PATH`` gets the per-series table, ``PATH`` with ``.summary.csv`` the aggregate rows."""
    path = Path(path)
    summary_path = path.with_suffix(".summary.csv")
    result.to_csv(str(path), str(summary_path))
    return path, summary_path
