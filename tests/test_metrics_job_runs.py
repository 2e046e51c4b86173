"""``/metrics``' newest finished run per job (``prewarm_job_last_duration_seconds``) read by a loose index scan:
the same rows as reading every run, on a real PostgreSQL."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import text

from forecaster.store.job_runs import LATEST_JOB_RUNS_SQL

#: What the scrape read before: every run, the newest finished one per job kept.
EVERY_RUN = ("SELECT DISTINCT ON (job_name) job_name, status, EXTRACT(EPOCH FROM finished_at - started_at) "
             "FROM job_runs WHERE finished_at IS NOT NULL ORDER BY job_name, slot DESC")
T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)


@pytest.mark.parametrize("seed", range(4))
def test_newest_finished_run_per_job_equals_reading_every_run(engine, seed):
    rng = random.Random(seed)
    names = ["ingest", "plan", "forecast", "job with spaces", "\u00e9t\u00e9", "a", "z" * 60][:rng.randint(1, 7)]
    with engine.begin() as conn:
        assert conn.execute(text(LATEST_JOB_RUNS_SQL)).all() == []  # no runs yet
        for i in range(rng.randint(1, 300)):
            name = rng.choice(names)
            slot = T0 + timedelta(minutes=rng.randint(0, 500))
            started = slot + timedelta(seconds=rng.randint(0, 5))
            finished = None if rng.random() < 0.2 else started + timedelta(seconds=rng.uniform(0, 90))
            conn.execute(text("INSERT INTO job_runs (job_name, slot, started_at, finished_at, status, detail) "
                              "VALUES (:n, :s, :st, :f, :status, '{}'::jsonb) ON CONFLICT DO NOTHING"),
                         {"n": name, "s": slot, "st": started, "f": finished,
                          "status": "running" if finished is None else rng.choice(["ok", "failed"])})
    with engine.connect() as conn:
        newest = conn.execute(text(LATEST_JOB_RUNS_SQL)).all()
        assert sorted(newest) == sorted(conn.execute(text(EVERY_RUN)).all())
        assert len(newest) == len({row[0] for row in newest})  # one per job
