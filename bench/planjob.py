"""Cost of the per-minute plan job at 10,000 models: read forecasts, read fleet, latency prediction, plan, actuate.

A fresh embedded PostgreSQL (or ``PREWARM_BENCH_ADMIN_URL``) is seeded with
``--models`` models (sizes, images from a few registries, weights URIs),
``--nodes`` nodes, node caches (images and weights on disk / in host memory
for a share of the models), ``--cold-starts`` observed cold starts over the
three days before, and one forecast run (60 minutes, quantiles 0.1 / 0.5 / 0.9
and ``p_any``, written with ``write_forecast_arrays`` as the forecast job
writes it). Then ``plan_job(engine, settings, now)`` runs for ``--minutes``
consecutive minutes (dry-run backend), and each stage is timed by wrapping
the plan job's own stage functions (``stored_forecast``, ``fleet_from_store``,
``predicted_latency``, ``plan``, ``Actuator.apply``): the median over the
minutes is printed per stage, with the first minute beside it.

Where the code has a saved latency model (``forecaster.coldstart.service``),
it is trained once before the minutes, as the nightly retrain would, and that
training time is reported apart (it is not a per-minute cost). The same script
runs on older checkouts (``PYTHONPATH`` at that checkout): it only uses what
both have.

``--start-minute 55 --minutes 7`` plans 12:55 .. 13:01 (the forecast run is seeded
from the first minute): the hour turns inside the run, so the first plan of
13:00 shows whether the next hour's latency table was built ahead of it (the
prefetch threads' log lines and which minutes ran beside one are reported).
``--paced`` starts each plan 60 s after the previous one began (at once after
one that ran over), as the scheduler's minute does, so a prefetch has the idle
rest of each minute; without it the minutes run back to back.

``--bursty-share 1`` gives every model a burst factor, so that the plan stage shows the cost of the planner's
burst-queue sizing beside a run without (``forecaster.planning.planner._burst_queue_sizes``).

``--processes N`` then starts N fresh processes that ask for one hour's table at the same moment (the plan job
and API workers at an hour turn), with the files off (each computes) and on (one computes, the others wait on its
lock and read): wall and CPU seconds, and the sum of the processes' peak memory.

``--action-history N`` seeds N finished actions over the 30 days before the first minute (nothing deletes
actions: at 100,000 models the plan job leaves about 360,000 a day), so that the stages show what reading the
actuator's history costs.

``--restarts N`` then plans the first minute again as a restarted process would (no latency table or champion
in memory), N times with the table computed and N times with it read from the file the earlier minutes wrote
(``PREWARM_LATENCY_TABLE_FILES_KEPT``), alternately.

Usage:
    python bench/planjob.py [--models 10000] [--minutes 5] [--start-minute 0] [--paced] [--bursty-share S]
                            [--restarts N] [--processes N]
                            [--action-history N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
from sqlalchemy import text

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import forecaster.jobs.planning as planning  # noqa: E402
from bench.benchdb import fresh_database, on_bench_server  # noqa: E402
from forecaster.actuation import actuator as actuation  # noqa: E402
from forecaster.ingest.service import push_cold_starts  # noqa: E402
from forecaster.settings import Settings  # noqa: E402
from forecaster.store.catalog import ServingModelSpec, upsert_models  # noqa: E402
from forecaster.store.db import make_engine  # noqa: E402
from forecaster.store.forecasts import write_forecast_arrays  # noqa: E402

STAGES = ("read_forecasts", "read_fleet", "latency_prediction", "plan", "write_actuate")
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
REGISTRIES = ("nvcr.io/nvidia", "ghcr.io/vllm", "registry.example.com/ml", "docker.io/library")


def seed(url: str, *, n_models: int, n_nodes: int, n_cold_starts: int, settings: Settings, seed: int = 0,
         forecast_from: datetime = NOW, bursty_share: float = 0.0) -> dict:
    """Fill a migrated database; returns counts of what was written (the forecast run starts at ``forecast_from``)."""
    engine = make_engine(url)
    rng = np.random.default_rng(seed)
    ids = [f"model-{i:05d}" for i in range(n_models)]
    images = [f"{REGISTRIES[k % len(REGISTRIES)]}/serve-{k}:1" for k in range(200)]
    image_of = rng.integers(0, len(images), n_models)
    image_bytes = rng.uniform(4e9, 15e9, len(images))
    weights_bytes = np.exp(rng.uniform(np.log(1e9), np.log(150e9), n_models))
    # --bursty-share: that share of the models has a burst factor (uniform 1.2-4), which sends the planner through
    # its burst-queue sizing; only then is the field passed, so that checkouts without it still run
    bursty = np.random.default_rng(seed + 1).random(n_models) < bursty_share
    factors = np.random.default_rng(seed + 2).uniform(1.2, 4.0, n_models)
    burst = [{"burst_factor": float(factors[i])} if bursty[i] else {} for i in range(n_models)]
    with engine.begin() as conn:
        for start in range(0, n_models, 2000):
            upsert_models(conn, [ServingModelSpec(
                id=ids[i], image_ref=images[image_of[i]], image_size_bytes=int(image_bytes[image_of[i]]),
                weights_uri=f"s3://weights/{ids[i]}", weights_size_bytes=int(weights_bytes[i]),
                gpus_per_replica=int(rng.choice([1, 1, 1, 2, 4, 8])), replica_rps=float(rng.uniform(0.5, 20)),
                cold_start_slo_s=None, **burst[i]) for i in range(start, min(n_models, start + 2000))])
        nodes = [f"node-{k:03d}" for k in range(n_nodes)]
        conn.execute(text("INSERT INTO nodes (id, gpus_total, gpus_free, disk_free_bytes, host_memory_free_bytes, "
                          "network_bytes_per_s) VALUES (:id, 8, :free, 4000000000000, 1000000000000, 3125000000)"),
                     [{"id": n, "free": int(rng.integers(0, 9))} for n in nodes])
        cache = set()
        for i in rng.choice(n_models, size=n_models // 5, replace=False):  # a fifth of the models cached somewhere
            for node in rng.choice(nodes, size=int(rng.integers(1, 4)), replace=False):
                tier = str(rng.choice(["disk", "disk", "host"]))
                cache.add((node, "weights", f"s3://weights/{ids[i]}", tier))
                cache.add((node, "image", images[image_of[i]], "image"))
        conn.execute(text("INSERT INTO node_cache (node_id, artefact_kind, ref, tier) VALUES (:n, :k, :r, :t)"),
                     [{"n": n, "k": k, "r": r, "t": t} for n, k, r, t in sorted(cache)])
    states = ("none", "image", "disk", "host")
    events = []
    for k in range(n_cold_starts):
        i = int(rng.integers(0, n_models))
        state = int(rng.integers(0, 4))
        pull = image_bytes[image_of[i]] / 0.2e9 if state == 0 else 0.0
        fetch = weights_bytes[i] / 0.6e9 if state < 2 else 0.0
        load = weights_bytes[i] / (12e9 if state == 3 else 2e9)
        phases = {"image_pull_s": pull, "weight_fetch_s": fetch, "weight_load_s": load, "runtime_init_s": 10.3,
                  "registration_s": 2.0}
        phases = {p: round(v * float(rng.lognormal(0.0, 0.15)), 3) for p, v in phases.items()}
        started = NOW - timedelta(days=3) + timedelta(seconds=float(rng.uniform(0, 3 * 86400 - 3600)))
        events.append({"model_id": ids[i], "node_id": str(rng.choice(nodes)), "started_at": started.isoformat(),
                       "total_seconds": round(sum(phases.values()), 3), **phases, "cache_state": states[state]})
    for start in range(0, len(events), 1000):
        push_cold_starts(engine, settings, events[start:start + 1000], now=NOW)
    minutes = 60
    base = rng.gamma(0.6, 40.0, n_models)[:, None]
    shape = 1 + 0.3 * np.sin(np.arange(minutes)[None, :] / 7.0 + rng.uniform(0, 6, (n_models, 1)))
    spike = (rng.random((n_models, 1)) < 0.05) & (np.arange(minutes)[None, :] >= rng.integers(3, 30, (n_models, 1)))
    point = base * shape * np.where(spike, 6.0, 1.0)
    p_any = 1.0 - np.exp(-point)
    rows = write_forecast_arrays(engine, ids, forecast_from, {"point": point, "p_any": p_any, "q0.1": point * 0.6,
                                                              "q0.5": point, "q0.9": point * 1.6},
                                 issued_at=forecast_from - timedelta(seconds=20), model_version_id=None)
    engine.dispose()
    return {"models": n_models, "nodes": n_nodes, "cache_entries": len(cache), "cold_starts": len(events),
            "forecast_rows": int(rows)}


def seed_action_history(url: str, *, n_models: int, n_nodes: int, n_actions: int, until: datetime,
                        days: int = 30) -> int:
    """``n_actions`` finished actions spread evenly over the ``days`` before ``until`` (half releases, a quarter
    each pre-pulls and pre-loads, every model and node in turn), as the actuator leaves them behind: nothing deletes
    actions, and at 100,000 models the plan job writes about 250 a minute (360,000 a day). Releases, so that every
    model's newest scale-or-release says 0 replicas and the plan starts from the fleet it has without a history
    (what is timed is reading the history, not other decisions). Then ANALYZE."""
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("""
            INSERT INTO actions (kind, model_id, node_id, target, spec, detail, status, backend, updated_at,
                                 finished_at, started_at, created_at)
            SELECT kind, model_id,
                   CASE WHEN kind IN ('prepull', 'preload') THEN 'node-' || lpad((g % :nodes)::text, 3, '0') END,
                   CASE kind WHEN 'prepull' THEN 'registry.example.com/ml/serve-' || (g % 200) || '\\:1'
                             WHEN 'preload' THEN 's3://weights/' || model_id END,
                   CASE kind WHEN 'release' THEN '{"replicas": 0}'::jsonb
                             WHEN 'preload' THEN '{"tier": "disk"}'::jsonb ELSE '{}'::jsonb END,
                   CASE kind WHEN 'release' THEN '{"ahead_gpus": 0}'::jsonb ELSE '{}'::jsonb END,
                   'succeeded', 'dry-run', t, t, t, t
            FROM (SELECT g, (ARRAY['release', 'release', 'prepull', 'preload'])[1 + g % 4] AS kind,
                         'model-' || lpad(((g::bigint * 7919) % :models)::text, 5, '0') AS model_id,
                         CAST(:until AS timestamptz) - make_interval(secs => :span * (1 - g::float8 / :n)) AS t
                  FROM generate_series(1, :n) AS g) a"""),
            {"n": n_actions, "models": n_models, "nodes": n_nodes, "until": until, "span": days * 86400.0})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE actions"))
    engine.dispose()
    return n_actions


class StageTimer:
    """Wraps the plan job's stage functions and keeps the seconds each took in the current run."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}

    def wrap(self, owner, name: str, stage: str) -> None:
        inner = getattr(owner, name)
        timer = self

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                timer.current[stage] = timer.current.get(stage, 0.0) + time.perf_counter() - started

        setattr(owner, name, timed)


def run(admin_url: str, args) -> dict:
    url = fresh_database(admin_url, "bench_planjob")
    engine = make_engine(url)
    models_dir = Path(tempfile.mkdtemp(prefix="prewarm-bench-models-"))
    settings = Settings(database_url=url, models_dir=models_dir, actuator_backend="dry-run")
    started = time.perf_counter()
    first_minute = NOW + timedelta(minutes=args.start_minute)
    seeded = seed(url, n_models=args.models, n_nodes=args.nodes, n_cold_starts=args.cold_starts, settings=settings,
                  forecast_from=first_minute, bursty_share=args.bursty_share)
    if args.action_history:
        started = time.perf_counter()
        seeded["action_history"] = seed_action_history(url, n_models=args.models, n_nodes=args.nodes,
                                                        n_actions=args.action_history, until=first_minute)
        seeded["action_history_s"] = round(time.perf_counter() - started, 2)
    seeded["seed_s"] = round(time.perf_counter() - started, 2)
    print(f"seeded {seeded} ", flush=True)
    out: dict = {"seeded": seeded, "minutes": args.minutes}
    try:
        from forecaster.coldstart.service import train_latency_model  # the saved latency model, where it exists
    except ImportError:
        out["latency_model"] = "refit every minute (no saved latency model in this code)"
    else:
        started = time.perf_counter()
        version = train_latency_model(engine, settings, NOW)
        out["latency_model"] = {"version": version, "nightly_train_s": round(time.perf_counter() - started, 2)}
    timer = StageTimer()
    # the plan itself: plan_step (the one plan step every driver calls) where the job has it, else the older plan
    plan_name = "plan_step" if hasattr(planning, "plan_step") else "plan"
    for name, stage in (("stored_forecast", "read_forecasts"), ("fleet_from_store", "read_fleet"),
                        ("predicted_latency", "latency_prediction"), (plan_name, "plan")):
        timer.wrap(planning, name, stage)
    timer.wrap(actuation.Actuator, "apply", "write_actuate")
    prefetch_log = PrefetchLog.attach()
    runs = []
    started = float("-inf")
    for minute in range(args.minutes):
        if args.paced:  # a plan 60 s after the previous one began, at once after one that ran over its minute
            time.sleep(max(0.0, started + 60.0 - time.perf_counter()))
        timer.current = {}
        at = first_minute + timedelta(minutes=minute)
        prefetching = prefetch_running()
        started = time.perf_counter()
        summary = planning.plan_job(engine, settings, at)
        total = time.perf_counter() - started
        # beside a prefetch: one ran when the minute began, or one started before it and still runs
        prefetching = prefetching or (prefetch_running() and not summary.get("latency_prefetch_started"))
        runs.append({"at": f"{at:%H:%M}", **{s: timer.current.get(s, 0.0) for s in STAGES}, "total": total,
                     "actions": summary.get("actions"), "skipped": summary.get("skipped"),
                     "prefetch_running": prefetching,
                     "prefetch_started": summary.get("latency_prefetch_started")})
        print(f"minute {at:%H:%M}: " + ", ".join(f"{k} {v:.3f} s" for k, v in runs[-1].items()
                                                 if isinstance(v, float))
              + f", {summary.get('actions')} actions"
              + (", prefetch running" if runs[-1]["prefetch_running"] else "")
              + (", prefetch started" if runs[-1]["prefetch_started"] else ""), flush=True)
    for thread in threading.enumerate():
        if thread.name.startswith(PREFETCH_THREAD):
            thread.join()
    if args.restarts:
        out["restarts"] = restarts(engine, settings, first_minute, timer, args.restarts)
    if args.processes:
        out["processes"] = processes_at_once(settings, first_minute, args.processes)
    out["runs"] = runs
    out["prefetches"] = prefetch_log.lines
    out["median_s"] = {k: round(statistics.median(r[k] for r in runs), 4) for k in (*STAGES, "total")}
    out["first_minute_s"] = {k: round(runs[0][k], 4) for k in (*STAGES, "total")}
    turns = [r for r in runs[1:] if r["at"].endswith(":00")]
    if turns:
        out["hour_turn_s"] = {k: round(turns[0][k], 4) for k in (*STAGES, "total")}
    engine.dispose()
    shutil.rmtree(models_dir, ignore_errors=True)  # the champion and its latency tables (100 MB at 100,000 models)
    return out


def restarts(engine, settings: Settings, at: datetime, timer: StageTimer, repeat: int) -> dict:
    """The first minute's plan again, as a restarted process plans it: no latency table and no champion in memory.

    Alternately with the table files turned off (the process computes its table, as every start did before
    ``forecaster.coldstart.table_files``) and on (it reads the file the earlier minutes wrote), ``repeat`` times
    each; the medians of both, measured in this one run. What a real restart also pays (imports, the first
    connections) is the same for both and not in these figures.
    """
    from forecaster.coldstart import service

    figures: dict[str, list[dict]] = {"computed": [], "file_read": []}
    files = file_costs(engine, settings, at, repeat)
    for _ in range(repeat):
        for case, kept in (("computed", 0), ("file_read", settings.latency_table_files_kept)):
            with service._lock:
                service._tables.clear()
                service._models.clear()
            timer.current = {}
            started = time.perf_counter()
            planning.plan_job(engine, settings.model_copy(update={"latency_table_files_kept": kept}), at)
            figures[case].append({**{s: timer.current.get(s, 0.0) for s in STAGES},
                                  "total": time.perf_counter() - started})
            print(f"restart at {at:%H:%M}, table {case}: " + ", ".join(
                f"{k} {v:.3f} s" for k, v in figures[case][-1].items()), flush=True)
    return {**{case: {k: round(statistics.median(r[k] for r in runs), 4) for k in (*STAGES, "total")}
               for case, runs in figures.items()}, "files": files}


#: a process of :func:`processes_at_once`: reads the fleet, says it is ready, waits for the word, asks for a table
_ONE_PROCESS = """
import json, sys, time
from datetime import datetime
from forecaster.coldstart import service
from forecaster.jobs.planning import fleet_from_store
from forecaster.settings import Settings
from forecaster.store.db import make_engine
settings = Settings(database_url=sys.argv[1], models_dir=sys.argv[2], latency_table_files_kept=int(sys.argv[3]))
engine = make_engine(settings.database_url)
fleet = fleet_from_store(engine, now=datetime.fromisoformat(sys.argv[4]))
service.load_latency_model(engine, settings)
print("ready", flush=True)
sys.stdin.readline()
started = time.perf_counter()
service.latency_table(engine, settings, fleet.models, hour=int(sys.argv[5]), nodes=list(fleet.nodes.index.astype(str)))
# VmHWM, not ru_maxrss: Linux carries the parent's peak across fork and exec into the latter
peak_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": time.perf_counter() - started, **service.latency_table_stats(),
                  "peak_rss_mb": peak_kb / 1024}), flush=True)
"""


def processes_at_once(settings: Settings, at: datetime, n: int) -> dict:
    """``n`` fresh processes (the plan job and API workers at an hour turn) ask for one hour's latency table at
    the same moment: with the table files off, each computes it; on, one computes it and the others wait on its
    lock and read it. Wall seconds from the word to the last answer, CPU seconds of the processes (user + system,
    their imports and fleet reads included, the same in both cases), and the sum of their peak RSS."""
    import resource
    import subprocess

    out = {}
    for case, kept, hour in (("files_off", 0, (at.hour + 2) % 24), ("files_on", settings.latency_table_files_kept,
                                                                   (at.hour + 3) % 24)):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        procs = [subprocess.Popen([sys.executable, "-c", _ONE_PROCESS, settings.database_url,
                                   str(settings.models_dir), str(kept), at.isoformat(), str(hour)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
                 for _ in range(n)]
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a table process did not start")
        started = time.perf_counter()
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        answers = [json.loads(proc.communicate(timeout=3600)[0].strip().splitlines()[-1]) for proc in procs]
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        out[case] = {"wall_s": round(wall, 2),
                     "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
                     "peak_rss_mb_sum": round(sum(a["peak_rss_mb"] for a in answers)),
                     "builds": sum(a["builds"] for a in answers), "files_read": sum(a["files_read"] for a in answers),
                     "seconds_each": sorted(round(a["seconds"], 2) for a in answers)}
        print(f"{n} processes at once, {case}: {out[case]}", flush=True)
    return out


def file_costs(engine, settings: Settings, at: datetime, repeat: int) -> dict:
    """Seconds to write the first minute's latency table to its file and to read it back (median of ``repeat``),
    the read also with the page cache dropped first where this process may (root on Linux; else None)."""
    from forecaster.coldstart import service, table_files

    fleet = planning.fleet_from_store(engine, now=at)
    request = service._request(engine, settings, fleet.models, hour=at.hour,
                               nodes=list(fleet.nodes.index.astype(str)))
    table = service._cached_or_built(request)
    root = Path(tempfile.mkdtemp(prefix="prewarm-bench-tables-"))
    write, warm, cold = [], [], []
    try:
        for _ in range(repeat):
            shutil.rmtree(root / table_files.DIRNAME, ignore_errors=True)
            started = time.perf_counter()
            table_files.write_table(root, request.file_key, table, kept=1)
            write.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert table_files.read_table(root, request.file_key) is not None
            warm.append(time.perf_counter() - started)
            try:
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("1\n")
            except OSError:
                continue
            started = time.perf_counter()
            assert table_files.read_table(root, request.file_key) is not None
            cold.append(time.perf_counter() - started)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {"table_mb": round(table.nbytes / 2**20, 1), "write_s": round(statistics.median(write), 3),
           "read_warm_s": round(statistics.median(warm), 3),
           "read_cold_s": round(statistics.median(cold), 3) if cold else None}
    print(f"latency table file ({out['table_mb']} MB): write {out['write_s']} s, read {out['read_warm_s']} s, "
          f"read with the page cache dropped {out['read_cold_s']} s (median of {repeat})", flush=True)
    return out


#: the name the service gives its prefetch threads (``latency-prefetch-<hour>h``), where the code has them
PREFETCH_THREAD = "latency-prefetch"


def prefetch_running() -> bool:
    """Whether a latency-table prefetch thread is running now (always False on code without them)."""
    return any(t.name.startswith(PREFETCH_THREAD) and t.is_alive() for t in threading.enumerate())


class PrefetchLog(logging.Handler):
    """Keeps the service's "prefetched in ..." and "prefetch ... failed" log lines (they say how long it took)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    @classmethod
    def attach(cls) -> "PrefetchLog":
        handler = cls()
        service_log = logging.getLogger("forecaster.coldstart.service")
        service_log.setLevel(logging.INFO)
        service_log.addHandler(handler)
        return handler

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "prefetch" in message:
            self.lines.append(message)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--cold-starts", type=int, default=3_000)
    parser.add_argument("--minutes", type=int, default=5)
    parser.add_argument("--start-minute", type=int, default=0,
                        help="minute past 12:00 of the first plan (55: minutes 12:55, 12:56, ... cross the hour)")
    parser.add_argument("--paced", action="store_true",
                        help="start a plan every 60 s as the scheduler does (default: back to back)")
    parser.add_argument("--bursty-share", type=float, default=0.0,
                        help="share of the models with a burst factor (1.2-4): the planner's burst-queue sizing")
    parser.add_argument("--restarts", type=int, default=0,
                        help="after the minutes, plan the first minute again N times as a restarted process, with "
                             "the latency table computed and read from its file (alternately)")
    parser.add_argument("--processes", type=int, default=0,
                        help="after the minutes, N fresh processes ask for one hour's latency table at once, "
                             "with the table files off and on")
    parser.add_argument("--action-history", type=int, default=0,
                        help="finished actions over the 30 days before the first minute (the actuator's history: "
                             "about 360,000 a day at 100,000 models)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    figures = on_bench_server(lambda url: run(url, args), prefix="prewarm-bench-planjob-")
    turn = figures.get("hour_turn_s")
    print(f"plan job, {args.models:,} models, median of {args.minutes} minutes (first minute in brackets"
          + (", then the first minute of the next hour)" if turn else "):"))
    for stage in (*STAGES, "total"):
        print(f"  {stage:<20} {figures['median_s'][stage]:8.3f} s  ({figures['first_minute_s'][stage]:.3f} s"
              + (f", {turn[stage]:.3f} s)" if turn else ")"))
    for case, medians in figures.get("restarts", {}).items():
        if case == "files":
            continue
        print(f"  restarted process, table {case}: latency_prediction {medians['latency_prediction']:.3f} s, "
              f"total {medians['total']:.3f} s (median of {args.restarts})")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
