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
   models with a champion whose members are ``--forecast-train-members``
   (default: the production ensemble), trained on a sample of
   ``--forecast-train-sample`` models of the same fleet (default 10,000: the
   first models, which fleetgen draws independently, so a random sample) and
   serving all ``--models`` (:class:`SampleServedChampion`: every served
   series takes the per-series choices of the trained series of its shard
   with the nearest level, so its forecast costs what a trained series' does;
   ``0`` trains on all ``--models`` instead, which for the production ensemble
   at 100,000 series takes about 10 x the 10,000-series retrain);
4. ``api``: the recommendation endpoint's p50 / p99 at ``--models`` models,
   with the forecasts of step 3 in the store.

Peak memory is sampled (every 0.2 s) over this process and all its children
(pool processes, Dask workers, the API server), per stage. Run
``python bench/scale.py --json out.json``; see ``--help`` for smaller runs.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib.util
import io
import json
import logging
import math
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import psutil
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import forecaster.forecast.registry as registry  # noqa: E402
from forecaster.distributed.executor import close_executors  # noqa: E402
from forecaster.forecast.ensemble import Ensemble, default_members  # noqa: E402
from forecaster.forecast.panel import Panel  # noqa: E402
from forecaster.forecast.sharded import ShardedEnsemble, forecast_shard, series_levels  # noqa: E402
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


class SampleServedChampion(ShardedEnsemble):
    """Bench only: a sharded champion trained on a sample of the fleet, forecasting the whole fleet at full cost.

    The product's :class:`ShardedEnsemble` routes a series it never saw to the
    shard of its level, whose ensemble then forecasts it with the fallback
    member alone (weights, conformal offsets and heads are per series, and an
    unseen series has none). That is right for a model registered after the
    retrain, but a champion trained on 10,000 of 100,000 series would then
    forecast 90% of them with the cheapest member, and the job's time would
    say nothing about the production ensemble.

    Here every served series the champion did not see is given a *donor*: the
    trained series of its shard (the product's routing by level) whose level
    over the current window is nearest. The shard's ensemble forecasts the
    served series' own history under the donor's name, so it uses the
    donor's member choice, conformal offsets, heads and ARIMA parameters: the
    members' work per series is a trained series' work (the forecasts
    themselves are a timing device, not a forecast to score). Served series
    are cut into tasks of at most ``shard_max_series`` (what a champion
    trained on all of them would run); the routing and donors are computed
    once per set of ids (a production champion's routing is a lookup too).
    """

    def __init__(self, trained: ShardedEnsemble, shard_max_series: int):
        self.__dict__.update(trained.__dict__)
        self.serve_max_series = shard_max_series
        self._plan: tuple[np.ndarray, dict[str, tuple[str, np.ndarray]], np.ndarray] | None = None

    def _serving_plan(self, panel: Panel) -> tuple[dict[str, tuple[str, np.ndarray]], np.ndarray]:
        """Task key -> (trained shard key, rows of ``panel``), and the id each row is forecast under."""
        if self._plan is not None and np.array_equal(self._plan[0], panel.ids):
            return self._plan[1], self._plan[2]
        routes = self._route(panel)
        trained = self.shard_of_.reindex(panel.ids).notna().to_numpy()
        level, _ = series_levels(panel.values)
        names = panel.ids.copy()
        tasks: dict[str, tuple[str, np.ndarray]] = {}
        for key, rows in routes.items():
            own, new = rows[trained[rows]], rows[~trained[rows]]
            if len(own) and len(new):
                donors = own[np.argsort(level[own], kind="stable")]
                at = np.clip(np.searchsorted(level[donors], level[new]), 0, len(donors) - 1)
                names[new] = panel.ids[donors[at]]
            parts = max(1, math.ceil(len(rows) / self.serve_max_series))
            for k, part in enumerate(np.array_split(rows, parts)):
                tasks[f"{key}.{k:03d}"] = (key, part)
        self._plan = (panel.ids.copy(), tasks, names)
        return tasks, names

    def forecast(self, panel: Panel, origins, h: int, *, members: bool = False) -> dict[str, np.ndarray]:
        origins = list(origins)
        tasks, names = self._serving_plan(panel)
        run = self._executor().run(
            forecast_shard,
            {task: (self._shard_ref(key), Panel(names[rows], panel.start, panel.step, panel.values[rows]),
                    origins, h, members) for task, (key, rows) in tasks.items()},
            name="forecast-shard",
        )
        if run.failures:
            raise RuntimeError(f"bench: shard tasks failed: {run.failures}")
        self.forecast_run_ = run.summary()
        # the workers' own seconds (forecast_shard's timer): what the members cost, without transfers
        self.forecast_run_["task_seconds_sum"] = round(sum(r[2] for r in run.results.values()), 2)
        self.forecast_run_["task_seconds_max"] = round(max(r[2] for r in run.results.values()), 2)
        outputs: dict[str, np.ndarray] = {}
        for task, (_, rows) in tasks.items():
            arrays, _, _ = run.results[task]
            for column, values in arrays.items():
                if column not in outputs:
                    outputs[column] = np.full((panel.n_series, len(origins), h), np.nan)
                outputs[column][rows] = values
        return outputs


class SampleServedCache(registry.ChampionCache):
    """The forecast job's champion cache, handing out the champion as a :class:`SampleServedChampion`."""

    def __init__(self, shard_max_series: int):
        super().__init__()
        self.shard_max_series = shard_max_series
        self._served: tuple[str | None, SampleServedChampion | None] = (None, None)

    def get(self, engine):
        version, model = super().get(engine)
        if model is None or not isinstance(model, ShardedEnsemble):
            return version, model
        if self._served[0] != version:
            self._served = (version, SampleServedChampion(model, self.shard_max_series))
        return version, self._served[1]


def forecast(engine, settings: Settings, *, runs: int, cache: registry.ChampionCache | None = None,
             profile: Path | None = None) -> dict:
    """The per-minute job ``runs`` times (issued one minute apart) with the champion; the first run loads it.

    With ``profile``, one more run (not in the figures) under cProfile: its
    stats go to that file and the 25 costliest functions (cumulative) are
    printed.
    """
    now = DEFAULT_START + timedelta(minutes=DAY_MIN)
    cache = cache or registry.ChampionCache()
    results = []
    with PeakRSS() as rss:
        for k in range(runs + 1):  # run 0 loads the champion (and warms pool processes): reported apart
            results.append(forecast_job(engine, settings, now + timedelta(minutes=k), cache=cache))
            log.warning("forecast run %d: %s", k, {key: results[-1].get(key) for key in
                                                   ("models", "seconds", "read_s", "forecast_s", "read")})
    if profile is not None:
        profiler = cProfile.Profile()
        profiled = profiler.runcall(forecast_job, engine, settings, now + timedelta(minutes=runs + 1), cache=cache)
        profiler.dump_stats(str(profile))
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
        print(f"profiled forecast run ({profiled['seconds']} s under cProfile):\n{out.getvalue()}", flush=True)
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
        "tasks": (steady[0]["shards"] or {}).get("shards"),
        "task_seconds_sum_median": (round(statistics.median(r["shards"]["task_seconds_sum"] for r in steady), 2)
                                    if "task_seconds_sum" in (steady[0]["shards"] or {}) else None),
        "load_average_1min": round(os.getloadavg()[0], 2),
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
            rss = "-" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:,.0f}"
            lines.append(f"| {r['label']} | {r['models']:,} | {r['members'] or 'fallback only'} | {r['shards']} | "
                         f"{r['seconds']} | {rss} | {r['wql_holdout']:.4f} |")
    if figures.get("forecast"):
        lines += ["", "| forecast job | models | champion | backend | median s (steady) | first run s "
                  "| read / forecast / write s | ms per model | peak RSS MB |", "|---|---|---|---|---|---|---|---|---|"]
        for f in figures["forecast"]:
            lines.append(f"| per minute | {f['models']:,} | {f.get('champion', 'the retrain above')} | "
                         f"{f['backend']} x{f['workers']} | {f['seconds_median']} | "
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
    fresh_database = _bench_module("benchdb").fresh_database
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
            with _backend(base, workers, args.forecast_backend[0]) as settings:
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
        if "forecast" in args.stages and args.forecast_train_sample:
            figures["forecast_champion_big"] = _sample_champion(small, big, base, args, figures)
            print("champion (sample)", figures["forecast_champion_big"], flush=True)
            save(figures)
            big_base = base.model_copy(update={"shard_max_series": args.big_shard_max_series})
            for kind in args.forecast_backend:  # several: one after the other on the same store and champion
                with _backend(big_base, max(args.forecast_workers), kind) as settings:
                    result = forecast(big, settings, runs=args.forecast_runs,
                                      cache=SampleServedCache(args.big_shard_max_series),
                                      profile=args.forecast_profile)
                result["champion"] = (f"trained on a {figures['forecast_champion_big']['models']:,}-series sample, "
                                      f"serving {result['models']:,}")
                figures["forecast"].append(result)
                print("forecast", figures["forecast"][-1], flush=True)
                save(figures)
        elif "forecast" in args.stages:
            big_base = base.model_copy(update={"shard_max_series": args.big_shard_max_series})
            with _backend(big_base, max(args.forecast_workers), args.forecast_backend[0]) as settings:
                trained = retrain(big, settings, label=f"champion for {args.models} models",
                                  members=args.forecast_train_members)
                figures["forecast_champion_big"] = trained
                print("retrain (big)", trained, flush=True)
                save(figures)
                result = forecast(big, settings, runs=args.forecast_runs, profile=args.forecast_profile)
                result["champion"] = f"trained on all {trained['models']:,} series"
                figures["forecast"].append(result)
                print("forecast", figures["forecast"][-1], flush=True)
                save(figures)
        big.dispose()
        if "api" in args.stages:
            figures["api"] = api_latency(big_url, args.api_seconds, args.api_clients)
            print("api", figures["api"], flush=True)
    small.dispose()
    return figures


def _sample_champion(small, big, base: Settings, args, figures: dict) -> dict:
    """The champion for the ``--models`` forecast run, trained on the first ``--forecast-train-sample`` models.

    It is the small fleet's last retrain when that one trained these members on
    as many models (fleetgen's first models are the same in both fleets), a
    saved version given by ``--forecast-champion``, or else a retrain on the
    small fleet now. The version is registered as champion in the big fleet's
    database, with the path the small one saved it at.
    """
    last = (figures.get("retrain") or [None])[-1]
    if args.forecast_champion is not None:
        path = args.forecast_champion.resolve()
        metadata = json.loads((path / registry.METADATA_FILE).read_text())
        trained = {"label": f"saved version {path.name}", "models": args.forecast_train_sample,
                   "members": args.forecast_train_members, "shards": None, "seconds": None, "peak_rss_mb": None,
                   "wql_holdout": (metadata["scores"].get("challenger") or {}).get("wql"), "version": path.name}
        version_id = path.name
    else:
        if not (last and last["members"] == args.forecast_train_members
                and last["models"] == args.forecast_train_sample):
            if args.forecast_train_sample != args.retrain_models or "retrain" not in args.stages:
                raise SystemExit("--forecast-train-sample must equal --retrain-models (the small fleet is the "
                                 "sample), with the retrain stage, unless --forecast-champion names a saved version")
            with _backend(base, max(args.forecast_workers), args.forecast_backend[0]) as settings:
                last = retrain(small, settings, label=f"champion for {args.models} models (sample)",
                               members=args.forecast_train_members)
        trained = dict(last, label=f"champion for {args.models:,} models, trained on a "
                                   f"{last['models']:,}-series sample")
        version_id = last["version"]
        path = registry.champion(small).path
        metadata = json.loads((path / registry.METADATA_FILE).read_text())
    when = {key: metadata.get(key) and datetime.fromisoformat(metadata[key]) for key in ("train_start", "train_end")}
    registry.register(big, version_id=version_id, path=path, status="challenger", **when,
                      members=[m["name"] for m in metadata.get("members", [])], scores=metadata.get("scores", {}))
    registry.promote(big, version_id)
    trained["path"] = str(path)
    return trained


@contextmanager
def _backend(base: Settings, workers: int, kind: str = "dask"):
    """Settings for the forecast job: in-process for 1 worker; otherwise a local Dask cluster (``kind="dask"``)
    or the product's own pool of spawned worker processes (``kind="pool"``: ``PREWARM_SHARD_WORKERS``, what a
    single machine runs without a Dask cluster)."""
    if workers <= 1 or kind == "pool":
        yield base.model_copy(update={"shard_workers": max(1, workers)})
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
    parser.add_argument("--forecast-train-sample", type=int, default=10_000,
                        help="train the --models champion on this many models of the fleet (the small fleet, so "
                             "equal to --retrain-models) and serve all --models with it (SampleServedChampion); "
                             "0: train it on all --models")
    parser.add_argument("--forecast-champion", type=Path,
                        help="a saved version folder (models/<version>) to use as the sample champion instead "
                             "of training one (e.g. from an earlier run's --models-dir)")
    parser.add_argument("--forecast-profile", type=Path,
                        help="after the timed runs at --models, one more run under cProfile, stats to this file")
    parser.add_argument("--models-dir", type=Path,
                        help="keep the trained versions here (default: a temporary folder, removed at the end)")
    parser.add_argument("--lookback-minutes", type=int, default=DAY_MIN, help="history the forecast job reads")
    parser.add_argument("--shard-max-series", type=int, default=5000)
    parser.add_argument("--big-shard-max-series", type=int, default=10_000,
                        help="shard size of the champion trained for --models (fewer, larger shards)")
    parser.add_argument("--forecast-workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--forecast-backend", choices=("dask", "pool"), nargs="+", default=["dask"],
                        help="with more than one worker: a local Dask cluster, or the product's local process pool "
                             "(PREWARM_SHARD_WORKERS, no Dask); several: the --models forecast runs once per "
                             "backend, in this order, on the same store and sample champion (the first backend "
                             "serves every other stage)")
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
        models_dir = args.models_dir.resolve() if args.models_dir else Path(tmp) / "models"
        if admin_url:
            figures = run(admin_url, args, models_dir)
        else:
            with embedded_server(Path(tmp) / "pgdata") as url:
                figures = run(url, args, models_dir)
    print(json.dumps(figures, indent=2))
    print(markdown(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
