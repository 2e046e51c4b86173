"""Cost of the retention job's history pruning (:mod:`forecaster.store.history_retention`), and what an actuator
writing beside it waits.

A fresh embedded PostgreSQL (or ``PREWARM_BENCH_ADMIN_URL``) gets ``--actions`` finished actions over the 60 days
before the bench's now (``bench/planjob.py``'s history: releases, pre-pulls and pre-loads of ``--models`` models;
about half older than the default 30 days), a plan a minute over those days and ``--job-runs`` runs of six jobs.
Then:

0. ``GET /v1/actions``' reads without a filter (its page of the newest updated, its count from the rows and from
   the kept counts), with and without the index ``actions_updated`` (migration 0016);
1. ``baseline``: for ``--probe-s`` seconds an actuator thread records and finishes one scale a session (the
   store ledger, as the actuator does), nothing else running: its session latencies, without ``actions_updated``
   and with it (what the index costs the writes);
2. ``backlog``: the first retention run on that store (:func:`apply_history_retention`, budget unlimited) with
   the same actuator thread running beside it: seconds per table, rows deleted and kept, the actuator's latencies;
3. ``hourly``: the run an hour later (what the scheduler then does every hour): its seconds;
4. rows, sizes and dead rows of the tables after (DELETE leaves dead rows for autovacuum to reuse; the files do not
   shrink), and the plan of a batch's read (``actions_finished_age``).

Usage:
    python bench/history_retention.py [--actions 2000000] [--models 100000] [--job-runs 500000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.benchdb import fresh_database, on_bench_server  # noqa: E402
from bench.planjob import NOW, seed_action_history  # noqa: E402
from api.routes.audit import ActionPublic  # noqa: E402
from forecaster.actuation.ledger import StoreLedger  # noqa: E402
from forecaster.contracts.actions import Action, ActionKind, ActionStatus, Plan, Reason  # noqa: E402
from forecaster.settings import Settings  # noqa: E402
from forecaster.store.actions import reconcile_action_state  # noqa: E402
from forecaster.store.db import make_engine  # noqa: E402
from forecaster.store.history_retention import ACTION_AGE, FINISHED_SQL, apply_history_retention  # noqa: E402

JOBS = ("ingest", "forecast", "plan", "partitions", "retention", "forecast_errors")
DAYS = 60


def seed(url: str, args) -> None:
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id, gpus_per_replica) SELECT 'model-' || lpad(g::text, 5, '0'), "
                          "1 FROM generate_series(0, :n - 1) g"), {"n": args.models})
        conn.execute(text("INSERT INTO plans (planned_at, summary) SELECT CAST(:t AS timestamptz) - "
                          "make_interval(mins => g), '{}'::jsonb FROM generate_series(0, :n - 1) g"),
                     {"t": NOW, "n": DAYS * 1440})
        conn.execute(text(
            "INSERT INTO job_runs (job_name, slot, started_at, finished_at, status, detail) "
            "SELECT (CAST(:jobs AS text[]))[1 + g % 6], CAST(:t AS timestamptz) - make_interval(secs => g * :step), "
            "now(), now() + interval '2 seconds', 'ok', '{}'::jsonb FROM generate_series(0, :n - 1) g"),
            {"jobs": list(JOBS), "t": NOW, "n": args.job_runs, "step": DAYS * 86400.0 / max(args.job_runs, 1)})
    seed_action_history(url, n_models=args.models, n_nodes=64, n_actions=args.actions, until=NOW, days=DAYS)
    reconcile_action_state(engine)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in ("actions", "plans", "job_runs"):
            conn.execute(text(f"VACUUM ANALYZE {table}"))
    engine.dispose()


class Actuator(threading.Thread):
    """Records and finishes one scale a session through the store ledger until stopped; keeps each session's
    seconds."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.engine = make_engine(url)
        self.ledger = StoreLedger(self.engine)
        self.stop = threading.Event()
        self.seconds: list[float] = []
        self.errors: list[str] = []

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            at = NOW + timedelta(seconds=i)
            model = f"model-{(i * 37) % 1000:05d}"
            started = time.perf_counter()
            try:
                with self.ledger.session() as s:
                    plan_id = s.record_plan(Plan(planned_at=at))
                    action_id, _ = s.submit_action(plan_id, Action(
                        kind=ActionKind.SCALE, model_id=model, reason=Reason.FORECAST_SPIKE, not_before=at,
                        deadline=at + timedelta(minutes=5), replicas=1 + i % 3), backend="dry-run", now=at)
                    s.mark(action_id, ActionStatus.SUCCEEDED, now=at, detail={"ahead_gpus": i % 3})
            except Exception as exc:  # noqa: BLE001 - reported in the figures
                self.errors.append(repr(exc))
            self.seconds.append(time.perf_counter() - started)
            i += 1
            time.sleep(0.01)
        self.engine.dispose()


def probe(url: str, seconds: float) -> Actuator:
    """The actuator thread alone for ``seconds``."""
    actuator = Actuator(url)
    actuator.start()
    time.sleep(seconds)
    actuator.stop.set()
    actuator.join()
    return actuator


def audit_reads(engine, repeat: int = 5) -> dict:
    """Median ms of ``GET /v1/actions``' reads without a filter: its page (the 100 newest updated) and its count,
    from every row and from the kept counts."""
    columns = ", ".join(ActionPublic.model_fields)
    cases = {"page": f"SELECT {columns} FROM actions ORDER BY updated_at DESC, id DESC LIMIT 100",
             "count_rows": "SELECT count(*) FROM actions",
             "count_kept": "SELECT coalesce(sum(n), 0) FROM action_counts"}
    times: dict[str, list[float]] = {name: [] for name in cases}
    with engine.connect() as conn:
        for _ in range(repeat):
            for name, sql in cases.items():
                started = time.perf_counter()
                conn.execute(text(sql)).all()
                times[name].append(time.perf_counter() - started)
    return {name: round(1e3 * statistics.median(v), 2) for name, v in times.items()}


def latencies(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    return {"sessions": len(ordered), "p50_ms": round(1e3 * statistics.median(ordered), 2),
            "p99_ms": round(1e3 * ordered[int(0.99 * (len(ordered) - 1))], 2),
            "max_ms": round(1e3 * ordered[-1], 2)}


def table_stats(engine) -> dict:
    """Rows (counted), dead rows (the statistics' estimate) and size on disk with indexes, per table."""
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT relname, n_dead_tup, pg_total_relation_size(relid) FROM pg_stat_user_tables "
            "WHERE relname IN ('actions', 'plans', 'job_runs') ORDER BY relname")).all()
        return {name: {"rows": conn.execute(text(f"SELECT count(*) FROM {name}")).scalar_one(), "dead": dead,
                       "mb": round(size / 2**20, 1)} for name, dead, size in rows}


def run(admin_url: str, args) -> dict:
    url = fresh_database(admin_url, "bench_history_retention")
    started = time.perf_counter()
    seed(url, args)
    figures: dict = {"actions": args.actions, "models": args.models, "job_runs": args.job_runs,
                     "plans": DAYS * 1440, "seed_s": round(time.perf_counter() - started, 1)}
    engine = make_engine(url)
    figures["before"] = table_stats(engine)
    with engine.connect() as conn:
        figures["batch_read_plan"] = [r[0] for r in conn.execute(text(
            f"EXPLAIN SELECT id, kind, model_id, {ACTION_AGE} FROM actions WHERE {FINISHED_SQL} "
            f"AND {ACTION_AGE} < :before AND ({ACTION_AGE}, id) > (:age, 0) ORDER BY {ACTION_AGE}, id LIMIT 5000"),
            {"before": NOW - timedelta(days=30), "age": NOW - timedelta(days=DAYS + 1)})][:3]
    settings = Settings(database_url=url)

    figures["audit_reads_ms"] = audit_reads(engine)
    with engine.begin() as conn:
        conn.execute(text("DROP INDEX actions_updated"))
    figures["audit_reads_without_index_ms"] = audit_reads(engine)
    without_index = probe(url, args.probe_s)
    with engine.begin() as conn:
        conn.execute(text("CREATE INDEX actions_updated ON actions (updated_at DESC, id DESC)"))
    baseline = probe(url, args.probe_s)
    figures["baseline_without_actions_updated"] = latencies(without_index.seconds)
    figures["baseline"] = latencies(baseline.seconds)

    beside = Actuator(url)
    beside.start()
    t = time.perf_counter()
    figures["backlog_detail"] = apply_history_retention(engine, now=NOW, settings=settings, budget_s=1e9)
    figures["backlog_s"] = round(time.perf_counter() - t, 2)
    beside.stop.set()
    beside.join()
    figures["beside_backlog"] = latencies(beside.seconds)
    figures["actuator_errors"] = baseline.errors + beside.errors

    with engine.begin() as conn:  # the plan job planned through the hour (ages count from the newest plan)
        conn.execute(text("INSERT INTO plans (planned_at, summary) VALUES (:t, '{}'::jsonb)"),
                     {"t": NOW + timedelta(hours=1)})
    t = time.perf_counter()
    figures["hourly_detail"] = apply_history_retention(engine, now=NOW + timedelta(hours=1), settings=settings)
    figures["hourly_s"] = round(time.perf_counter() - t, 3)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE actions, plans, job_runs"))
    figures["after"] = table_stats(engine)
    engine.dispose()
    figures["load_avg"] = os.getloadavg()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--actions", type=int, default=2_000_000)
    parser.add_argument("--models", type=int, default=100_000)
    parser.add_argument("--job-runs", type=int, default=500_000)
    parser.add_argument("--probe-s", type=float, default=20.0, help="seconds of the actuator's baseline")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    f = on_bench_server(lambda url: run(url, args), prefix="prewarm-bench-retention-")
    print(f"history retention: {f['actions']:,} actions of {f['models']:,} models, {f['plans']:,} plans, "
          f"{f['job_runs']:,} job runs over {DAYS} days (seeded in {f['seed_s']} s), load {f['load_avg'][0]:.2f}")
    print(f"  batch read: {' / '.join(line.strip() for line in f['batch_read_plan'][:2])}")
    for table, d in f["backlog_detail"].items():
        print(f"  first run  {table:<9} deleted {d.get('deleted', 0):>9,}  kept {d.get('kept', 0):>7,}")
    print(f"  first run total {f['backlog_s']} s; the run an hour later {f['hourly_s']} s "
          f"({sum(d.get('deleted', 0) for d in f['hourly_detail'].values()):,} rows)")
    for name in ("audit_reads_without_index_ms", "audit_reads_ms"):
        print(f"  GET /v1/actions reads, {name}: " + ", ".join(f"{k} {v} ms" for k, v in f[name].items()))
    for name in ("baseline_without_actions_updated", "baseline", "beside_backlog"):
        d = f[name]
        print(f"  actuator session {name:<32} n={d['sessions']:>5}  p50 {d['p50_ms']:7.2f} ms  p99 {d['p99_ms']:7.2f} ms"
              f"  max {d['max_ms']:8.2f} ms")
    print(f"  actuator errors: {len(f['actuator_errors'])}")
    for table in f["before"]:
        b, a = f["before"][table], f["after"][table]
        print(f"  {table:<9} rows {b['rows']:>9,} -> {a['rows']:>9,}  dead {a['dead']:>9,}  {b['mb']} -> {a['mb']} MB")
    if args.json:
        args.json.write_text(json.dumps(f, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
