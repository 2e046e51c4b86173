"""What observing new cold starts between refits costs the plan path (forecaster.coldstart.service._observed).

A fleet-sized store: ``--models`` models with sizes, ``--nodes`` nodes, ``--events`` cold starts over 30 days, a
champion trained on them; then a day of new starts (``--new``) stored after its training. Measured, on one
process:

* the per-plan probe (the count/max range scan of the primary key), with nothing new to observe: what every plan
  and snapshot refresh pays;
* the hourly observation (read the rows since training, observe them on a copy of the champion);
* the per-node table build (what the hour's first plan or the prefetch pays), before and after observing.

Run: ``PYTHONPATH=. python bench/coldstart_observe.py`` (an embedded PostgreSQL unless PREWARM_BENCH_ADMIN_URL).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pandas as pd
from sqlalchemy import text

from bench.benchdb import fresh_database, on_bench_server
from forecaster.coldstart import service
from forecaster.settings import Settings
from forecaster.store.db import make_engine

NOW = datetime(2026, 11, 29, 12, 30, tzinfo=timezone.utc)


def _fill(engine, *, models: int, nodes: int, events: int, first: datetime, last: datetime) -> None:
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO serving_models (id, image_size_bytes, weights_size_bytes, replica_rps) "
            "SELECT 'm' || g, 9e9 + (g % 7) * 1e9, 1e9 + (g % 11) * 4e9, 1.0 FROM generate_series(0, :m - 1) g"),
            {"m": models})
        conn.execute(text("INSERT INTO nodes (id, gpus_total, gpus_free) SELECT 'n' || g, 8, 8 "
                          "FROM generate_series(0, :n - 1) g"), {"n": nodes})
    _starts(engine, models=models, nodes=nodes, events=events, first=first, last=last)


def _starts(engine, *, models: int, nodes: int, events: int, first: datetime, last: datetime) -> None:
    span = (last - first).total_seconds()
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO cold_starts (model_id, node_id, started_at, total_seconds, cache_state, source) "
            "SELECT 'm' || (g * 7919 % :m), 'n' || (g % :n), "
            "  CAST(:first AS timestamptz) + make_interval(secs => g * CAST(:span AS float8) / :e), "
            "  (ARRAY[150.0, 110.0, 60.0, 20.0])[g % 4 + 1] * (1 + (g % 13) / 20.0), "
            "  (ARRAY['none', 'image', 'disk', 'host'])[g % 4 + 1], 'bench' "
            "FROM generate_series(0, :e - 1) g"),
            {"m": models, "n": nodes, "e": events, "first": first, "span": span})


def run(admin_url: str, args) -> dict:
    url = fresh_database(admin_url, "prewarm_bench_observe")
    engine = make_engine(url)
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(database_url=url, models_dir=Path(tmp) / "models", latency_table_files_kept=0)
        trained_at = NOW - timedelta(days=1)
        _fill(engine, models=args.models, nodes=args.nodes, events=args.events,
              first=trained_at - timedelta(days=30), last=trained_at - timedelta(minutes=1))
        t = time.perf_counter()
        service.train_latency_model(engine, settings, trained_at, tree_params={"n_estimators": 100})
        fit_s = time.perf_counter() - t
        _starts(engine, models=args.models, nodes=args.nodes, events=args.new, first=trained_at,
                last=NOW - timedelta(minutes=40))
        sizes = pd.read_sql("SELECT id AS model_id, image_size_bytes AS image_bytes, "
                            "weights_size_bytes AS weights_bytes FROM serving_models ORDER BY id", engine) \
            .set_index("model_id").astype("float64")
        node_ids = [f"n{k}" for k in range(args.nodes)]
        version, champion = service._current(engine, settings, service.FleetConfig())
        cutoff = service.observation_cutoff(NOW, NOW.hour)
        t = time.perf_counter()
        _, observed = service._observed(engine, settings, version, champion, cutoff)
        observe_s = time.perf_counter() - t
        probes = []
        for _ in range(20):
            t = time.perf_counter()
            service._observed(engine, settings, version, champion, cutoff)
            probes.append(time.perf_counter() - t)
        builds = {}
        for name, model in (("champion", champion), ("observed", observed)):
            t = time.perf_counter()
            model.node_latency_table(sizes, hour=NOW.hour, nodes=node_ids, default_s=45.0)
            builds[name] = time.perf_counter() - t
    engine.dispose()
    return {"models": args.models, "nodes": args.nodes, "events": args.events, "new": args.new,
            "fit_s": round(fit_s, 2), "hourly_observe_s": round(observe_s, 3),
            "per_plan_probe_ms_median": round(1000 * float(np.median(probes)), 2),
            "table_build_s": {k: round(v, 2) for k, v in builds.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--new", type=int, default=2_000)
    args = parser.parse_args()
    print(on_bench_server(lambda url: run(url, args), prefix="prewarm-bench-observe-"))


if __name__ == "__main__":
    main()
