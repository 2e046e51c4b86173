"""Scale benchmark: ingest, nightly retrain, per-minute forecast job and API at 10,000-100,000 models.

Everything runs on a generated fleet (:mod:`forecaster.simulation.fleetgen`:
real Azure / Huawei / LLM series resampled, deterministic with ``--seed``) in
fresh databases of an embedded PostgreSQL (or ``PREWARM_BENCH_ADMIN_URL``):

1. ``ingest``: one day of per-minute counts for ``--models`` models through
   the production write path (``write_count_batch``, 10,000 models a batch);
2. ``retrain``: the nightly retrain (``retrain_job``, default sharded
   ensemble) on the first ``--retrain-models`` models of the same fleet, for
   each of ``--retrain-runs``: without Dask (in this process, the "same code
   without Dask") or on a local Dask cluster of N worker processes;
3. ``forecast``: the per-minute forecast job (``forecast_job``) with the
   champion of step 2 for ``--retrain-models`` models, and for ``--models``
   models with a champion trained the same way on all of them
   (``--forecast-train-members`` says which members that champion has;
   training the full ensemble on 100,000 series does not fit on this machine's
   time budget, and the note says so);
4. ``api``: the recommendation endpoint's p50 / p99 at ``--models`` models,
   with the forecasts of step 3 in the store.

Peak memory is sampled (every 0.2 s) over this process and all its children
(pool processes, Dask workers, the API server), per stage. Run
``python bench/scale.py --json out.json``; see ``--help`` for smaller runs.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import psutil
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import forecaster.forecast.registry as registry  # noqa: E402
from forecaster.distributed.executor import close_executors  # noqa: E402
from forecaster.forecast.ensemble import Ensemble, default_members  # noqa: E402
from forecaster.forecast.sharded import ShardedEnsemble  # noqa: E402
from forecaster.jobs.forecasting import forecast_job, retrain_job  # noqa: E402
from forecaster.settings import Settings  # noqa: E402
from forecaster.simulation.fleetgen import DEFAULT_START, fleet_batches  # noqa: E402
from forecaster.store.db import embedded_server, make_engine, upgrade  # noqa: E402
from forecaster.store.invocations import write_count_batch  # noqa: E402

log = logging.getLogger("bench.scale")
DAY_MIN = 1440


class PeakRSS:
    """Peak resident memory (MB) of this process plus its children, sampled in a thread."""

    def __init__(self, interval_s: float = 0.2):
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self._stop = threading.Event()

    def _sample(self) -> float:
        me = psutil.Process()
        total = me.memory_info().rss
        for child in me.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:
                pass
        return total / 2**20

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, self._sample())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.peak_mb = self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = round(max(self.peak_mb, self._sample()), 1)


def ingest(engine, n_models: int, seed: int) -> dict:
    """One day of per-minute counts for ``n_models`` generated models, through the production write path."""
    rows = invocations = 0
    with PeakRSS() as rss:
        started = time.perf_counter()
        for batch in fleet_batches(n_models, seed=seed, minutes=DAY_MIN, chunk_models=10_000):
            result = write_count_batch(engine, batch, register_models=True)
            rows += result.rows_written
            invocations += result.invocations
            log.info("ingest: %d rows so far, %.0f s", rows, time.perf_counter() - started)
        seconds = time.perf_counter() - started
    return {"models": n_models, "minutes": DAY_MIN, "rows_written": rows, "invocations": invocations,
            "seconds": round(seconds, 1), "rows_per_s": round(rows / seconds), "peak_rss_mb": rss.peak_mb}


def _model(settings: Settings, members: str):
    """The retrain's challenger: the default ensemble (or a subset of its members), sharded."""
    h = settings.forecast_horizon_min
    if members == "default":
        factory = functools.partial(Ensemble, horizon=h)
    else:
        names = set(members.split(","))
        chosen = [m for m in default_members(h) if m.name in names]
        factory = functools.partial(Ensemble, members=chosen, horizon=h)
    return lambda: ShardedEnsemble(factory, shard_max_series=settings.shard_max_series)


def retrain(engine, settings: Settings, *, label: str, members: str) -> dict:
    """One nightly retrain; earlier versions are retired first so that every run does the same work."""
    now = DEFAULT_START + timedelta(minutes=DAY_MIN)
    with engine.begin() as conn:  # no champion: the run does not also forecast an older version's holdout
        conn.execute(text("UPDATE model_versions SET status = 'retired' "
                          "WHERE status = 'champion' AND kind = 'forecast'"))
    with PeakRSS() as rss:
        result = retrain_job(engine, settings, now, cache=registry.ChampionCache(),
                             ensemble_factory=_model(settings, members))
    return {"label": label, "models": result["series"], "seconds": result["seconds"],
            "backend": result["shards"]["backend"], "workers": result["shards"]["workers"],
            "shards": result["shards"]["shards"], "failed_shards": result["shards"]["failed_shards"],
            "members": members, "train_minutes": settings.train_window_min,
            "wql_holdout": result["scores"]["challenger"]["wql"], "promoted": result["promoted"],
            "version": result["version"], "peak_rss_mb": rss.peak_mb}


def forecast(engine, settings: Settings, *, runs: int) -> dict:
    """The per-minute job ``runs`` times (issued one minute apart) with the champion; the first run loads it."""
    now = DEFAULT_START + timedelta(minutes=DAY_MIN)
    cache = registry.ChampionCache()
    results = []
    with PeakRSS() as rss:
        for k in range(runs + 1):  # run 0 loads the champion (and warms pool processes): reported apart
            results.append(forecast_job(engine, settings, now + timedelta(seconds=k), cache=cache))
    steady = results[1:]
    seconds = [r["seconds"] for r in steady]
    models = steady[0]["models"]
    return {
        "models": models, "runs": runs, "seconds_median": round(statistics.median(seconds), 2),
        "seconds_runs": seconds, "first_run_seconds": results[0]["seconds"],
        "read_s_median": round(statistics.median(r["read_s"] for r in steady), 2),
        "forecast_s_median": round(statistics.median(r["forecast_s"] for r in steady), 2),
        "write_s_median": round(statistics.median(r["seconds"] - r["read_s"] - r["forecast_s"] for r in steady), 2),
        "ms_per_model": round(1000 * statistics.median(seconds) / models, 3),
        "backend": (steady[0]["shards"] or {}).get("backend", "in-process"),
        "workers": (steady[0]["shards"] or {}).get("workers", 1), "rows_per_run": steady[0]["rows"],
        "peak_rss_mb": rss.peak_mb,
    }


def _bench_module(name: str):
    """Another bench script as a module (``bench/`` is not a package, and ``api`` would shadow prewarm's)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def api_latency(url: str, seconds: float, clients: int) -> dict:
    """p50 / p99 of the recommendation endpoint with the store as the forecast job left it (bench/api.py's driver)."""
    import asyncio

    from forecaster.store.tokens import create_token

    bench_api = _bench_module("api")
    engine = make_engine(url)
    token = create_token(engine, name="bench-scale", scopes=["read"])
    with engine.connect() as conn:
        ids = list(conn.execute(text("SELECT DISTINCT model_id FROM forecasts")).scalars())
    engine.dispose()
    with PeakRSS() as rss:
        started = time.monotonic()
        with bench_api.serving(url, token, ids[0], timeout_s=300) as base:
            ready_s = time.monotonic() - started
            latencies, errors = asyncio.run(bench_api.drive(base, token, ids, clients, seconds, warmup_s=3.0))
    ms = sorted(x * 1000 for x in latencies)
    return {"models": len(ids), "clients": clients, "seconds": seconds, "requests": len(ms), "errors": errors,
            "p50_ms": round(statistics.median(ms), 2), "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 2),
            "requests_per_s": round(len(ms) / seconds, 1), "ready_s": round(ready_s, 1),
            "peak_rss_mb": rss.peak_mb}


@contextmanager
def dask_cluster(workers: int):
    from distributed import LocalCluster

    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None,
                           silence_logs=logging.ERROR)
    try:
        yield cluster.scheduler_address
    finally:
        close_executors()
        cluster.close()


def markdown(figures: dict) -> str:
    """The figures as the tables of docs/scale.md."""
    lines = []
    for key in ("ingest_small", "ingest"):
        if key in figures:
            f = figures[key]
            lines.append(f"- ingest, {f['models']:,} models x {f['minutes']:,} minutes: {f['rows_written']:,} rows "
                         f"in {f['seconds']} s ({f['rows_per_s']:,} rows/s), peak RSS {f['peak_rss_mb']:,.0f} MB")
    if figures.get("retrain"):
        lines += ["", "| retrain | models | members | shards | seconds | peak RSS MB | holdout wQL |", "|---|---|---|---|---|---|---|"]
        for r in figures["retrain"] + ([figures["forecast_champion_big"]] if "forecast_champion_big" in figures else []):
            lines.append(f"| {r['label']} | {r['models']:,} | {r['members'] or 'fallback only'} | {r['shards']} | "
                         f"{r['seconds']} | {r['peak_rss_mb']:,.0f} | {r['wql_holdout']:.4f} |")
    if figures.get("forecast"):
        lines += ["", "| forecast job | models | backend | median s (steady) | first run s | read / forecast / write s "
                  "| ms per model | peak RSS MB |", "|---|---|---|---|---|---|---|---|"]
        for f in figures["forecast"]:
            lines.append(f"| per minute | {f['models']:,} | {f['backend']} x{f['workers']} | {f['seconds_median']} | "
                         f"{f['first_run_seconds']} | {f['read_s_median']} / {f['forecast_s_median']} / "
                         f"{f['write_s_median']} | {f['ms_per_model']} | {f['peak_rss_mb']:,.0f} |")
    if "api" in figures:
        a = figures["api"]
        lines += ["", f"- API recommendation at {a['models']:,} models, {a['clients']} clients, {a['seconds']:g} s: "
                  f"p50 {a['p50_ms']} ms, p99 {a['p99_ms']} ms, {a['requests_per_s']} requests/s, "
                  f"{a['errors']} errors (server ready after {a['ready_s']} s)"]
    return "\n".join(lines)


_json_path: Path | None = None


def save(figures: dict) -> None:
    """Write what is measured so far (a long run that is stopped keeps its finished stages)."""
    if _json_path is not None:
        _json_path.write_text(json.dumps(figures, indent=2) + "\n")


def run(admin_url: str, args, models_dir: Path) -> dict:
    figures: dict = {"machine": {"cpus": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30, 1)},
                     "seed": args.seed, "fleet": "forecaster.simulation.fleetgen (real series resampled)"}
    base = Settings(models_dir=models_dir, train_window_min=args.retrain_minutes, retrain_holdout_min=120,
                    forecast_lookback_min=args.lookback_minutes, shard_max_series=args.shard_max_series)
    fresh_database = _bench_module("ingest").fresh_database
    small_url = fresh_database(admin_url, "bench_scale_small")
    small = make_engine(small_url)
    upgrade(small)
    if "retrain" in args.stages:
        figures["ingest_small"] = ingest(small, args.retrain_models, args.seed)
        print("ingest", figures["ingest_small"], flush=True)
        save(figures)

    if "retrain" in args.stages:
        figures["retrain"] = []
        for spec in args.retrain_runs:
            backend, _, members = spec.partition("=")
            if backend == "inline":
                label, dask_workers = "without dask (in-process)", None
            elif backend.startswith("dask") and backend[4:].isdigit():
                label, dask_workers = f"dask {int(backend[4:])} worker(s)", int(backend[4:])
            else:
                raise SystemExit(f"--retrain-runs: {spec!r} is not inline=MEMBERS or daskN=MEMBERS")
            if dask_workers is None:
                settings = base.model_copy(update={"shard_workers": 1})
                figures["retrain"].append(retrain(small, settings, label=label, members=members or "default"))
            else:
                with dask_cluster(dask_workers) as address:
                    settings = base.model_copy(update={"dask_scheduler_address": address})
                    figures["retrain"].append(retrain(small, settings, label=label, members=members or "default"))
            print("retrain", figures["retrain"][-1], flush=True)
            close_executors()
            save(figures)

    figures["forecast"] = []
    if "forecast" in args.stages and "retrain" in args.stages:  # the small fleet's champion comes from the retrains
        for workers in args.forecast_workers:
            with _backend(base, workers) as settings:
                figures["forecast"].append(forecast(small, settings, runs=args.forecast_runs))
            print("forecast", figures["forecast"][-1], flush=True)
            save(figures)

    if args.models > args.retrain_models and ({"ingest", "forecast", "api"} & set(args.stages)):
        big_url = fresh_database(admin_url, "bench_scale_big")
        big = make_engine(big_url)
        upgrade(big)
        figures["ingest"] = ingest(big, args.models, args.seed)
        print("ingest", figures["ingest"], flush=True)
        save(figures)
        if "forecast" in args.stages:
            big_base = base.model_copy(update={"shard_max_series": args.big_shard_max_series})
            with _backend(big_base, max(args.forecast_workers)) as settings:
                trained = retrain(big, settings, label=f"champion for {args.models} models",
                                  members=args.forecast_train_members)
                figures["forecast_champion_big"] = trained
                print("retrain (big)", trained, flush=True)
                save(figures)
                figures["forecast"].append(forecast(big, settings, runs=args.forecast_runs))
                print("forecast", figures["forecast"][-1], flush=True)
                save(figures)
        big.dispose()
        if "api" in args.stages:
            figures["api"] = api_latency(big_url, args.api_seconds, args.api_clients)
            print("api", figures["api"], flush=True)
    small.dispose()
    return figures


@contextmanager
def _backend(base: Settings, workers: int):
    """Settings for the forecast job: in-process for 1 worker, a local Dask cluster otherwise."""
    if workers <= 1:
        yield base.model_copy(update={"shard_workers": 1})
        close_executors()
        return
    with dask_cluster(workers) as address:
        yield base.model_copy(update={"dask_scheduler_address": address})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=100_000, help="fleet size for ingest, forecast and API")
    parser.add_argument("--retrain-models", type=int, default=10_000, help="fleet size for the retrain comparison")
    parser.add_argument("--retrain-minutes", type=int, default=DAY_MIN, help="train window (the whole day)")
    parser.add_argument("--retrain-runs", nargs="+",
                        default=["inline=default", "dask1=default", "dask2=default"],
                        help="BACKEND=MEMBERS per retrain, BACKEND inline or daskN, MEMBERS 'default' (all five "
                             "families) or a comma list of member names; the last run's model is the champion "
                             "the 10,000-model forecast job uses")
    parser.add_argument("--forecast-train-members", default="default",
                        help="members of the champion trained for the --models forecast run")
    parser.add_argument("--lookback-minutes", type=int, default=DAY_MIN, help="history the forecast job reads")
    parser.add_argument("--shard-max-series", type=int, default=5000)
    parser.add_argument("--big-shard-max-series", type=int, default=10_000,
                        help="shard size of the champion trained for --models (fewer, larger shards)")
    parser.add_argument("--forecast-workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--forecast-runs", type=int, default=3)
    parser.add_argument("--api-seconds", type=float, default=20.0)
    parser.add_argument("--api-clients", type=int, default=50)
    parser.add_argument("--stages", nargs="+", default=["ingest", "retrain", "forecast", "api"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    global _json_path
    _json_path = args.json
    with tempfile.TemporaryDirectory(prefix="prewarm-bench-scale-") as tmp:
        os.chmod(tmp, 0o755)
        admin_url = os.environ.get("PREWARM_BENCH_ADMIN_URL")
        if admin_url:
            figures = run(admin_url, args, Path(tmp) / "models")
        else:
            with embedded_server(Path(tmp) / "pgdata") as url:
                figures = run(url, args, Path(tmp) / "models")
    print(json.dumps(figures, indent=2))
    print(markdown(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
