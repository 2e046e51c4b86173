"""The latency retrain's window and cap, and the retention of cold starts, on a store that has kept months of them.

A fresh embedded PostgreSQL (or ``PREWARM_BENCH_ADMIN_URL``) gets ``--events`` cold starts over ``--days`` days
(``bench/coldstart.py``'s per-node replay: the catalogue's models on 100 heterogeneous, drifting nodes) and as
many transfers. Then, each in a fresh process (its peak memory is its own):

1. ``train_latency_model`` reading every event (what it did before: ``PREWARM_LATENCY_TRAIN_DAYS`` and
   ``_MAX_EVENTS`` set past the store);
2. ``train_latency_model`` with the defaults (30 days, at most 200,000 of the newest);

seconds, peak resident memory (MB) and the events fitted; then the retention job's first run over the cold starts
and transfers older than 90 days (``cold_starts_retention_days``): seconds and rows. ``--accuracy`` adds what the
window costs or gains in MAE on the same later events (:func:`accuracy`).

Usage:
    python bench/latency_window.py [--events 1200000] [--days 120] [--accuracy] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import resource
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.coldstart import node_replay_events  # noqa: E402
from bench.benchdb import fresh_database, on_bench_server  # noqa: E402
from bench.planjob import NOW  # noqa: E402
from forecaster.contracts.phases import PHASES  # noqa: E402
from forecaster.settings import Settings  # noqa: E402
from forecaster.simulation.catalog import load_catalog  # noqa: E402
from forecaster.store.db import make_engine  # noqa: E402

CS_COLUMNS = ("model_id", "node_id", "started_at", "total_seconds", *PHASES, "cache_state", "source")
TRANSFER_COLUMNS = ("model_id", "node_id", "kind", "tier", "ref", "bytes", "started_at", "seconds", "image_pull_s",
                    "source")


def seed(url: str, n_events: int, days: float) -> None:
    """The catalogue, ``n_events`` cold starts ending at the bench's now, and as many image pre-pulls."""
    from sqlalchemy import text

    catalog = load_catalog()
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id, image_ref, image_size_bytes, weights_uri, "
                          "weights_size_bytes) VALUES (:id, :image, :ib, :weights, :wb)"),
                     [{"id": name, "image": row.image_ref, "ib": int(row.image_bytes), "weights": row.weights_uri,
                       "wb": int(row.weights_bytes)} for name, row in catalog.iterrows()])
    events = node_replay_events(n_events=n_events, days=days)
    started = NOW - timedelta(days=days)
    at = [started + timedelta(seconds=float(s)) for s in events["started_s"]]
    rng = np.random.default_rng(1)
    raw = engine.raw_connection()
    conn = raw.driver_connection  # psycopg's COPY
    with conn.cursor().copy(f"COPY cold_starts ({', '.join(CS_COLUMNS)}) FROM STDIN") as copy:
        for i, row in enumerate(events.itertuples(index=False)):
            copy.write_row((row.model_id, row.node_id, at[i], row.total_seconds,
                            *(getattr(row, p) for p in PHASES), row.cache_state, "bench"))
    with conn.cursor().copy(f"COPY transfers ({', '.join(TRANSFER_COLUMNS)}) FROM STDIN") as copy:
        for i, row in enumerate(events.itertuples(index=False)):
            seconds = float(row.image_pull_s) * rng.uniform(0.8, 1.2)
            copy.write_row((row.model_id, row.node_id, "prepull", "image", "r", int(row.image_bytes),
                            at[i] + timedelta(microseconds=1), seconds, seconds, "bench"))
    conn.commit()
    conn.execute("ANALYZE cold_starts")
    conn.execute("ANALYZE transfers")
    conn.commit()
    raw.close()
    engine.dispose()


def _train(url: str, models_dir: str, overrides: dict, out) -> None:
    from forecaster.coldstart.service import train_latency_model
    from forecaster.store.registry import champion_version

    settings = Settings(database_url=url, models_dir=models_dir, **overrides)
    engine = make_engine(url)
    started = time.perf_counter()
    train_latency_model(engine, settings, NOW)
    seconds = time.perf_counter() - started
    scores = champion_version(engine, kind="latency").scores
    engine.dispose()
    out.put({"seconds": round(seconds, 1), "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
             "n_events": scores["n_events"], "n_transfers": scores["n_transfers"],
             "validation_mae_s": round(scores["validation"]["mae_s"]["chosen"], 3)})


def train_in_child(url: str, overrides: dict) -> dict:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory(prefix="prewarm-bench-latency-models-") as models_dir:
        child = context.Process(target=_train, args=(url, models_dir, overrides, out))
        child.start()
        while True:
            try:
                result = out.get(timeout=5)
                break
            except queue.Empty:
                if not child.is_alive():
                    raise RuntimeError(f"the training process ended with {child.exitcode} (its error is above)")
        child.join()
    return result


def accuracy(n_events: int, days: float, *, test_days: float = 3.0, test_events: int = 20_000) -> dict:
    """The same replay in memory: fit on every event before the last ``test_days`` and on the defaults' window
    of them (30 days, the newest 200,000), then forecast the first ``test_events`` after, walking forward in ten
    chunks (each observed after it is forecast, no refit), as ``bench/coldstart.py`` does; MAE of each."""
    from forecaster.coldstart.model import ColdStartModel

    defaults = Settings()
    events = node_replay_events(n_events=n_events, days=days).drop(columns="_slow_node")
    cut = (days - test_days) * 86400.0
    train, test = events[events["started_s"] < cut], events[events["started_s"] >= cut].iloc[:test_events]
    window = train[train["started_s"] >= cut - defaults.latency_train_days * 86400.0]
    window = window.iloc[-defaults.latency_train_max_events:]
    out = {"test_events": int(len(test))}
    for name, fit_on in (("every_event", train), ("defaults", window)):
        started = time.perf_counter()
        model = ColdStartModel(tree_params={"n_jobs": 1}).fit(fit_on)
        fit_s = time.perf_counter() - started
        predicted = []
        for part in np.array_split(np.arange(len(test)), 10):
            piece = test.iloc[part]
            predicted.append(model.predict(piece)["total_seconds"].to_numpy())
            model.observe(piece)
        error = np.abs(np.concatenate(predicted) - test["total_seconds"].to_numpy())
        out[name] = {"events_fit": int(len(fit_on)), "fit_s": round(fit_s, 1), "mae_s": round(float(error.mean()), 3)}
    return out


def run(admin_url: str, args) -> dict:
    url = fresh_database(admin_url, "bench_latency_window")
    started = time.perf_counter()
    seed(url, args.events, args.days)
    figures: dict = {"events": args.events, "days": args.days, "seed_s": round(time.perf_counter() - started, 1)}
    figures["every_event"] = train_in_child(url, {"latency_train_days": 3650, "latency_train_max_events": 10_000_000,
                                                  "cold_starts_retention_days": 0})
    figures["defaults"] = train_in_child(url, {})
    from forecaster.store.history_retention import apply_history_retention

    engine = make_engine(url)
    started = time.perf_counter()
    detail = apply_history_retention(engine, now=NOW, settings=Settings(database_url=url), budget_s=1e9)
    figures["retention_s"] = round(time.perf_counter() - started, 2)
    figures["retention"] = {k: detail[k] for k in ("cold_starts", "transfers")}
    engine.dispose()
    if args.accuracy:
        figures["accuracy"] = accuracy(args.events, args.days)
    figures["load_avg"] = os.getloadavg()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=1_200_000)
    parser.add_argument("--days", type=float, default=120.0)
    parser.add_argument("--accuracy", action="store_true",
                        help="also forecast the last 3 days' first 20,000 cold starts from both fits (in memory)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    f = on_bench_server(lambda url: run(url, args), prefix="prewarm-bench-latency-")
    print(f"latency retrain on {f['events']:,} cold starts and as many transfers over {f['days']:g} days "
          f"(seeded in {f['seed_s']} s), load {f['load_avg'][0]:.2f}")
    for name in ("every_event", "defaults"):
        d = f[name]
        print(f"  {name:<12} {d['seconds']:7.1f} s  peak {d['peak_mb']:>6,} MB  {d['n_events']:>8,} events  "
              f"{d['n_transfers']:>8,} transfers  (validation MAE {d['validation_mae_s']} s, on its own tail)")
    for table, d in f["retention"].items():
        print(f"  retention  {table:<12} deleted {d['deleted']:>8,}  kept {d['kept']:>6,}")
    print(f"  retention first run {f['retention_s']} s (plans, actions and job runs: none here)")
    if "accuracy" in f:
        a = f["accuracy"]
        for name in ("every_event", "defaults"):
            print(f"  accuracy   {name:<12} fit on {a[name]['events_fit']:>9,} events in {a[name]['fit_s']:6.1f} s: "
                  f"MAE {a[name]['mae_s']:.3f} s on the next {a['test_events']:,}")
    if args.json:
        args.json.write_text(json.dumps(f, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
