"""Cost of a ``/metrics`` scrape's store reads as the history grows: the newest run per job and the action counts.

Nothing deletes job runs (about 4,300 a day: three jobs a minute and a few hourly ones) or actions (at 100,000
models about 360,000 a day). A fresh embedded PostgreSQL (or ``PREWARM_BENCH_ADMIN_URL``) gets ``--job-runs`` runs
of six jobs, one a minute each, and ``--actions`` finished actions (``bench/planjob.py``'s history; the counts table
is filled as migration 0015 and the scheduler's start fill it). Then, median of ``--repeat`` each:

* ``job_runs_every_run``: the ``DISTINCT ON (job_name)`` the scrape read before (every run);
* ``job_runs_newest``: :data:`forecaster.store.job_runs.LATEST_JOB_RUNS_SQL` (a loose index scan);
* ``actions_group_by``: ``SELECT kind, status, count(*) FROM actions GROUP BY 1, 2`` (what the scrape read before);
* ``actions_counts``: :func:`forecaster.store.actions.action_counts` (the kept counts).

Usage:
    python bench/metrics_history.py [--job-runs 2000000] [--actions 2000000] [--repeat 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.benchdb import fresh_database, on_bench_server  # noqa: E402
from bench.planjob import NOW, seed_action_history  # noqa: E402
from forecaster.store.actions import action_counts, reconcile_action_state  # noqa: E402
from forecaster.store.db import make_engine  # noqa: E402
from forecaster.store.job_runs import LATEST_JOB_RUNS_SQL  # noqa: E402

EVERY_RUN = ("SELECT DISTINCT ON (job_name) job_name, status, EXTRACT(EPOCH FROM finished_at - started_at) "
             "FROM job_runs WHERE finished_at IS NOT NULL ORDER BY job_name, slot DESC")
GROUP_BY = "SELECT kind, status, count(*) FROM actions GROUP BY 1, 2"
JOBS = ("ingest", "forecast", "plan", "partitions", "retention", "forecast_errors")


def run(admin_url: str, args) -> dict:
    url = fresh_database(admin_url, "bench_metrics_history")
    engine = make_engine(url)
    started = time.perf_counter()
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO job_runs (job_name, slot, started_at, finished_at, status, detail) "
            "SELECT (CAST(:jobs AS text[]))[1 + g % 6], CAST(:t AS timestamptz) - make_interval(mins => g / 6), "
            "now(), now() + interval '2 seconds', 'ok', '{}'::jsonb FROM generate_series(0, :n - 1) g"),
            {"jobs": list(JOBS), "t": NOW, "n": args.job_runs})
    if args.actions:
        seed_action_history(url, n_models=100_000, n_nodes=64, n_actions=args.actions, until=NOW)
    reconcile_action_state(engine)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE job_runs"))
        conn.execute(text("VACUUM ANALYZE actions"))
    seeded_s = time.perf_counter() - started
    cases = {
        "job_runs_every_run": lambda c: c.execute(text(EVERY_RUN)).all(),
        "job_runs_newest": lambda c: c.execute(text(LATEST_JOB_RUNS_SQL)).all(),
        "actions_group_by": lambda c: c.execute(text(GROUP_BY)).all(),
        "actions_counts": action_counts,
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    answers = {}
    with engine.connect() as conn:
        for _ in range(args.repeat):
            for name, case in cases.items():  # interleaved
                t = time.perf_counter()
                answers[name] = case(conn)
                times[name].append(time.perf_counter() - t)
    engine.dispose()
    same_jobs = sorted(answers["job_runs_every_run"]) == sorted(answers["job_runs_newest"])
    same_counts = sorted(map(tuple, answers["actions_group_by"])) == sorted(
        (kind, status, n) for kind, status, n, _ in answers["actions_counts"])  # nothing pruned here
    return {"job_runs": args.job_runs, "actions": args.actions, "seed_s": round(seeded_s, 1),
            "repeat": args.repeat, "same_answers": same_jobs and same_counts,
            "median_ms": {k: round(1e3 * statistics.median(v), 2) for k, v in times.items()},
            "load_avg": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job-runs", type=int, default=2_000_000)
    parser.add_argument("--actions", type=int, default=2_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    figures = on_bench_server(lambda url: run(url, args), prefix="prewarm-bench-metrics-")
    print(f"/metrics store reads, {figures['job_runs']:,} job runs and {figures['actions']:,} actions, median of "
          f"{figures['repeat']} (same answers: {figures['same_answers']}), load {figures['load_avg'][0]:.2f}:")
    for name, ms in figures["median_ms"].items():
        print(f"  {name:<20} {ms:10.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
