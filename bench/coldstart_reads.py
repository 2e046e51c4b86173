"""Cost of the cold-start horizon reads at fleet scale: ``GET /v1/models/{id}/cold-start`` and the ``/metrics`` gauges.

Both answer from :func:`api.coldstart_horizon.predict_horizon` (the latency model's predicted start per tier, the
start tier a new replica would use, the lead time) and the rolling observed p90. A fresh embedded PostgreSQL (or
``PREWARM_BENCH_ADMIN_URL``) is seeded as ``bench/planjob.py`` seeds it (``--models`` models, ``--nodes`` nodes,
caches for a fifth of the models, ``--cold-starts`` observed cold starts, one forecast run) and the latency model
is trained once, as the nightly retrain would. Then, each ``--repeat`` times (the median is printed):

* ``one_model_fleet``: ``predict_horizon`` for one model over the fleet plus its observed p90, what the route
  answers without ``?node=`` (a different model each time);
* ``one_model_node``: the same on one node (``?node=``);
* ``metrics_gauges``: ``api.metrics.ColdStartHorizonCollector.collect()`` consumed whole, the cold-start part of a
  ``/metrics`` scrape (at most ``PREWARM_COLDSTART_METRICS_MAX_MODELS`` models, 1,000 by default), computed on
  every scrape (``PREWARM_COLDSTART_METRICS_MAX_AGE_S=0``);
* ``metrics_gauges_kept``: the same scrape within the default max age, served from the last computation;
* ``..._held``: the same three computed cases with the API snapshot's per-node table of the whole catalogue at
  hand (``ForecastSnapshot.held_latency``, made by the snapshot's own lead-time step before the timings): the
  asked models' rows are read from it instead of asking the latency model again.

The same script runs on older checkouts (``PYTHONPATH`` at that checkout), so a change is compared with the code
before it on the same seeded data: ``--keep-db DIR`` keeps the embedded server's data directory between runs.

Usage:
    python bench/coldstart_reads.py [--models 100000] [--nodes 160] [--repeat 9] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

# the checkout this file is in, before bench/ itself (whose api.py would shadow the package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.coldstart_horizon import observed_p90, predict_horizon  # noqa: E402
from api.metrics import ColdStartHorizonCollector  # noqa: E402
from bench.planjob import NOW, seed  # noqa: E402
from forecaster.settings import Settings  # noqa: E402
from forecaster.store.db import embedded_server, make_engine, upgrade  # noqa: E402

DATABASE = "bench_coldstart_reads"


class _Snapshot:
    """What the collector reads of the API's snapshot: every seeded model has a forecast."""

    def __init__(self, ids: list[str]) -> None:
        self.newest_issued_at = NOW
        view = type("View", (), {"forecast": object()})()
        self.models = {m: view for m in ids}
        self.prepared: dict = {}  # the real snapshot replaces it when a forecast lands; unchanged here

    def refresh_if_due(self) -> None:
        pass


def _seeded(admin_url: str, args, settings_for) -> tuple[str, bool]:
    """The database URL; seeds it unless it already holds ``--models`` models (a kept data directory)."""
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        exists = conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :d"), {"d": DATABASE}).first()
    url = make_url(admin_url).set(database=DATABASE).render_as_string(hide_password=False)
    if exists:
        engine = make_engine(url)
        with engine.connect() as conn:
            count = conn.execute(text("SELECT count(*) FROM serving_models")).scalar_one()
        engine.dispose()
        if count == args.models:
            admin.dispose()
            return url, False
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)"))
        conn.execute(text(f"CREATE DATABASE {DATABASE}"))
    admin.dispose()
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    seeded = seed(url, n_models=args.models, n_nodes=args.nodes, n_cold_starts=args.cold_starts,
                  settings=settings_for(url))
    print(f"seeded {seeded}", flush=True)
    from forecaster.coldstart.service import train_latency_model
    engine = make_engine(url)
    train_latency_model(engine, settings_for(url), NOW)
    engine.dispose()
    return url, True


def _held_latency(engine, settings: Settings):
    """The per-node table the API's snapshot holds for its lead times, made by the snapshot's own step (None on a
    checkout whose snapshot holds none)."""
    from api.snapshot import ForecastSnapshot
    from forecaster.store.catalog import read_catalogue_sizes
    from forecaster.store.nodecache import warmest_cached_states

    snapshot = ForecastSnapshot(engine, settings=settings, clock=lambda: NOW)
    if not hasattr(snapshot, "held_latency"):
        return None
    with engine.connect() as conn:
        catalogue, states = read_catalogue_sizes(conn), warmest_cached_states(conn)
    started = time.perf_counter()
    snapshot._lead_times(catalogue, states)
    print(f"the snapshot's lead times (its latency table included) in {time.perf_counter() - started:.1f} s",
          flush=True)
    return snapshot.held_latency


def run(admin_url: str, args) -> dict:
    models_dir = Path(args.models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)

    def settings_for(url: str) -> Settings:
        return Settings(database_url=url, models_dir=models_dir)

    url, fresh = _seeded(admin_url, args, settings_for)
    settings = settings_for(url)
    engine = make_engine(url)
    with engine.connect() as conn:
        ids = [r[0] for r in conn.execute(text("SELECT id FROM serving_models ORDER BY id"))]
        nodes = [r[0] for r in conn.execute(text("SELECT id FROM nodes ORDER BY id"))]
    rng = np.random.default_rng(1)
    snapshot = _Snapshot(ids)
    every_scrape = settings.model_copy(update={"coldstart_metrics_max_age_s": 0.0})
    collector = ColdStartHorizonCollector(engine, snapshot, every_scrape, lambda: NOW)
    kept = ColdStartHorizonCollector(engine, snapshot, settings, lambda: NOW)
    held = _held_latency(engine, settings)
    with_held = _Snapshot(ids)
    with_held.held_latency = held
    collector_held = ColdStartHorizonCollector(engine, with_held, every_scrape, lambda: NOW)

    def one_model(node, **held_kw):
        model_id = ids[int(rng.integers(0, len(ids)))]
        horizon = predict_horizon(engine, settings, NOW, [model_id], node=node, **held_kw)
        observed_p90(engine, [model_id])
        return horizon

    cases = {
        "one_model_fleet": lambda: one_model(None),
        "one_model_node": lambda: one_model(nodes[int(rng.integers(0, len(nodes)))]),
        "metrics_gauges": lambda: sum(len(family.samples) for family in collector.collect()),
        "metrics_gauges_kept": lambda: sum(len(family.samples) for family in kept.collect()),
    }
    if held is not None:
        cases.update({
            "one_model_fleet_held": lambda: one_model(None, held=held),
            "one_model_node_held": lambda: one_model(nodes[int(rng.integers(0, len(nodes)))], held=held),
            "metrics_gauges_held": lambda: sum(len(family.samples) for family in collector_held.collect()),
        })
    for case in cases.values():  # warm-up: the latency model's load, the connection pool
        case()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeat):
        for name, case in cases.items():  # interleaved, so a change in the machine's load touches every case
            started = time.perf_counter()
            case()
            times[name].append(time.perf_counter() - started)
    engine.dispose()
    return {"models": len(ids), "nodes": len(nodes), "seeded_now": fresh, "repeat": args.repeat,
            "load_avg": os.getloadavg(),
            "median_ms": {k: round(1e3 * statistics.median(v), 1) for k, v in times.items()},
            "max_ms": {k: round(1e3 * max(v), 1) for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=100_000)
    parser.add_argument("--nodes", type=int, default=160)
    parser.add_argument("--cold-starts", type=int, default=3_000)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--keep-db", type=Path, help="embedded server data directory kept between runs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    admin_url = os.environ.get("PREWARM_BENCH_ADMIN_URL")
    with tempfile.TemporaryDirectory(prefix="prewarm-bench-csreads-") as tmp:
        args.models_dir = str((args.keep_db or Path(tmp)) / "models")
        if admin_url:
            figures = run(admin_url, args)
        else:
            pgdata = args.keep_db / "pgdata" if args.keep_db else Path(tmp) / "pgdata"
            os.chmod(tmp, 0o755)
            with embedded_server(pgdata) as url:
                figures = run(url, args)
    print(f"cold-start horizon reads, {figures['models']:,} models on {figures['nodes']} nodes, median of "
          f"{args.repeat} (max), load {figures['load_avg'][0]:.2f}:")
    for name, ms in figures["median_ms"].items():
        print(f"  {name:<18} {ms:9.1f} ms  ({figures['max_ms'][name]:.1f} ms)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
