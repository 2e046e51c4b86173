"""``prewarm demo``: the whole loop on a real trace, on the embedded database.

:func:`run_loop` ingests the first 18 hours of the shipped Azure Functions day
as history, trains the ensemble, then replays the rest minute by minute at an
accelerated clock while the forecast and plan jobs run and the actuator (dry-run)
records what it would do; the CLI serves the API and dashboard meanwhile.
:func:`run_demo` is the plain ingest-and-summarise mode (``--summary-only``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd
from sqlalchemy import Engine, text

from forecaster.data import AZURE2019_TOP100, sample_path
from forecaster.ingest.service import ingest_trace_file
from forecaster.settings import Settings
from forecaster.store.invocations import read_counts


def summarise(counts: pd.DataFrame) -> pd.DataFrame:
    """Per model: total, active share of known minutes, mean and peak per minute, peak-to-mean ratio."""
    known = counts.dropna(subset=["y"])
    grouped = known.groupby("unique_id")["y"]
    table = pd.DataFrame(
        {
            "total": grouped.sum().astype("int64"),
            "known_min": grouped.size(),
            "active_pct": grouped.apply(lambda s: 100.0 * float((s > 0).mean())),
            "mean_per_min": grouped.mean(),
            "peak_per_min": grouped.max().astype("int64"),
        }
    )
    table["peak_to_mean"] = table["peak_per_min"] / table["mean_per_min"].replace(0, np.nan)
    return table.sort_values("total", ascending=False)


def run_demo(
    engine: Engine,
    settings: Settings,
    *,
    now: datetime,
    trace: Path | None = None,
    top: int = 15,
    echo: Callable[[str], None] = print,
) -> pd.DataFrame:
    """Ingest ``trace`` (default: the shipped Azure 2019 top-100 sample) and print a summary."""
    path = trace or sample_path(AZURE2019_TOP100)
    result = ingest_trace_file(engine, settings, path, now=now, register=True)
    with engine.connect() as conn:
        window = conn.execute(
            text("SELECT window_start, window_end FROM ingest_batches WHERE id = :id"), {"id": result.batch_id}
        ).one()
        model_ids = conn.execute(
            text("SELECT model_id FROM coverage WHERE ranges && tstzmultirange(tstzrange(:s, :e))"),
            {"s": window[0], "e": window[1]},
        ).scalars().all()
    state = "already in the store (no change)" if result.duplicate else f"{result.rows_written:,} non-zero rows written"
    echo(f"ingested {path.name}: {result.models:,} models, {result.invocations:,} invocations, "
         f"{result.covered_steps:,} model-steps covered; {state}")
    echo(f"window {window[0]:%Y-%m-%d %H:%M} .. {window[1]:%Y-%m-%d %H:%M} UTC")
    counts = read_counts(engine, list(model_ids), window[0], window[1])
    table = summarise(counts)
    shown = table.head(top)
    echo(f"\n{'model':<18}{'total':>10}{'active%':>9}{'mean/min':>10}{'peak/min':>10}{'peak/mean':>10}")
    for row in shown.itertuples():
        model_id = row.Index
        name = model_id if len(model_id) <= 16 else model_id[:15] + "~"
        echo(f"{name:<18}{int(row.total):>10,}{row.active_pct:>9.1f}{row.mean_per_min:>10.1f}"
             f"{int(row.peak_per_min):>10,}{row.peak_to_mean:>10.1f}")
    if len(table) > top:
        echo(f"... and {len(table) - top} more models")
    echo(f"\nall models: {int(table.total.sum()):,} invocations; median model active "
         f"{table.active_pct.median():.1f}% of minutes; median peak/mean {table.peak_to_mean.median():.1f}")
    return table


# --------------------------------------------------------------------------- the whole loop


class SimClock:
    """The demo's clock: trace time, advanced by the replay loop (read by the API and dashboard)."""

    def __init__(self, start: datetime) -> None:
        self._now = start

    def __call__(self) -> datetime:
        return self._now

    def set(self, moment: datetime) -> None:
        self._now = moment


def register_fleet(engine: Engine, counts: pd.DataFrame, *, nodes: int, gpus_per_node: int) -> None:
    """Give each trace series a real open model from the catalogue (busiest get the biggest) and a GPU fleet."""
    from forecaster.simulation.catalog import assign_models
    from forecaster.store.catalog import ServingModelSpec, upsert_models

    totals = counts.groupby("unique_id")["y"].sum()
    table = assign_models(totals.index.to_numpy(), order_by=totals.to_numpy())
    specs = [ServingModelSpec(id=str(model_id), image_ref=row.image_ref, image_size_bytes=int(row.image_bytes),
                              weights_uri=row.weights_uri, weights_size_bytes=int(row.weights_bytes),
                              gpus_per_replica=int(row.gpus), replica_rps=float(row.replica_rps),
                              labels={"catalog": row.catalog_name, "registered_by": "demo"})
             for model_id, row in table.iterrows()]
    with engine.begin() as conn:
        upsert_models(conn, specs)
        for i in range(nodes):
            conn.execute(text(
                "INSERT INTO nodes (id, gpus_total, gpus_free, disk_free_bytes, host_memory_free_bytes) "
                "VALUES (:id, :g, :g, 2e12, 5e11) ON CONFLICT (id) DO NOTHING"),
                {"id": f"gpu-node-{i:02d}", "g": gpus_per_node})


def run_loop(
    engine: Engine,
    settings: Settings,
    *,
    clock: SimClock | None = None,
    trace: Path | None = None,
    train_minutes: int = 1080,
    replay_minutes: int | None = None,
    speed: float = 60.0,
    members: list[str] | None = None,
    echo: Callable[[str], None] = print,
    on_ready: Callable[[SimClock], None] | None = None,
    stop: "threading.Event | None" = None,
) -> dict:
    """Ingest the first ``train_minutes`` of the trace, train, then replay the rest minute by minute.

    Each replayed minute: push that minute's counts (as a live source would),
    run the forecast job and the plan job (which carries the plan out through
    the configured actuator backend, dry-run by default) at the simulated
    ``now``. ``speed`` simulated seconds pass per wall second (0: as fast as
    the jobs run).
    """
    import threading
    import time as wall

    from forecaster.ingest.service import ingest_frame
    from forecaster.ingest.traces import read_trace
    from forecaster.jobs.backtesting import select_members
    from forecaster.jobs.forecasting import forecast_job, retrain_job
    from forecaster.jobs.planning import plan_job
    from forecaster.forecast.ensemble import Ensemble
    from forecaster.forecast.registry import ChampionCache, champion

    stop = stop or threading.Event()
    raw = read_trace(trace or sample_path(AZURE2019_TOP100))
    counts = pd.DataFrame({"unique_id": raw.raw["unique_id"].astype(str), "ds": raw.raw["ds"],
                           "y": raw.raw["y"].astype("int64")})
    start = counts["ds"].min()
    split = start + pd.Timedelta(minutes=train_minutes)
    end = counts["ds"].max() + pd.Timedelta(minutes=1)
    total_replay = int((end - split) / pd.Timedelta(minutes=1))
    replay_minutes = total_replay if replay_minutes is None else min(replay_minutes, total_replay)

    register_fleet(engine, counts, nodes=8, gpus_per_node=8)
    history = counts[counts["ds"] < split]
    windows = pd.DataFrame({"unique_id": sorted(counts["unique_id"].unique()), "start": start, "end": split})
    result = ingest_frame(engine, settings, history, source="demo-history", step_seconds=60, now=split,
                          windows=windows, register=False)
    echo(f"history: {result.models} models, {result.invocations:,} invocations over {train_minutes} minutes "
         f"({'already stored' if result.duplicate else f'{result.rows_written:,} rows written'})")

    clock = clock or SimClock(split.to_pydatetime())
    clock.set(split.to_pydatetime())
    cache = ChampionCache()
    if champion(engine) is None:
        echo("training the forecasting ensemble on the history (members: "
             f"{', '.join(members) if members else 'all'} + fallback) ...")
        began = wall.perf_counter()
        trained = retrain_job(engine, settings, split.to_pydatetime(), cache=cache,
                              ensemble_factory=lambda: Ensemble(members=select_members(members, 60), horizon=60,
                                                                progress=lambda line: echo(f"  {line}")))
        echo(f"trained {trained['version']} in {wall.perf_counter() - began:.0f} s; holdout wQL "
             f"{trained['scores']['challenger']['wql']:.3f}; champion: {trained['promoted']}")
    if on_ready is not None:
        on_ready(clock)

    echo(f"replaying {replay_minutes} minutes from {split:%Y-%m-%d %H:%M} UTC at "
         f"{'full speed' if speed <= 0 else f'{speed:g}x'}")
    replay = counts[(counts["ds"] >= split) & (counts["ds"] < split + pd.Timedelta(minutes=replay_minutes))]
    by_minute = dict(tuple(replay.groupby("ds")))
    ids = windows["unique_id"]
    began = wall.monotonic()
    totals = {"forecast_rows": 0, "actions": 0}
    for minute in range(replay_minutes):
        if stop.is_set():
            break
        at = split + pd.Timedelta(minutes=minute)
        now = (at + pd.Timedelta(minutes=1)).to_pydatetime()  # the minute is over: its counts arrive
        rows = by_minute.get(at, replay.iloc[0:0])
        ingest_frame(engine, settings, rows, source="demo-replay", step_seconds=60, now=now,
                     windows=pd.DataFrame({"unique_id": ids, "start": at, "end": at + pd.Timedelta(minutes=1)}),
                     register=False)
        clock.set(now)
        forecast = forecast_job(engine, settings, now, cache=cache)
        planned = plan_job(engine, settings, now)
        totals["forecast_rows"] += forecast.get("rows", 0)
        totals["actions"] += planned.get("actions", 0)
        if minute % 10 == 0 or minute == replay_minutes - 1:
            echo(f"  {now:%H:%M} sim: {int(rows['y'].sum()) if len(rows) else 0:>6,} invocations, forecast "
                 f"{forecast.get('models', 0)} models in {forecast.get('seconds', 0):.2f} s, "
                 f"{planned.get('actions', 0)} actions planned")
        if speed > 0:
            due = began + (minute + 1) * 60.0 / speed
            stop.wait(max(0.0, due - wall.monotonic()))
    return {"replayed_minutes": minute + 1 if replay_minutes else 0, **totals}
