"""``/metrics``' newest run per job that is over (``prewarm_job_last_duration_seconds``) read by a loose index scan:
the same rows as reading every run, on a real PostgreSQL. A run is over when it finished, or when it is still
``running`` past its lease (its process died): that one reads ``abandoned``."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import text

from forecaster.store.job_runs import LATEST_JOB_RUNS_SQL

#: The same answer from every run, the newest one over per job kept.
EVERY_RUN = ("SELECT DISTINCT ON (job_name) job_name, CASE WHEN finished_at IS NULL THEN 'abandoned' ELSE status END, "
             "EXTRACT(EPOCH FROM coalesce(finished_at, lease_expires_at) - started_at) FROM job_runs "
             "WHERE finished_at IS NOT NULL OR lease_expires_at < now() ORDER BY job_name, slot DESC")
T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)


@pytest.mark.parametrize("seed", range(4))
def test_newest_run_over_per_job_equals_reading_every_run(engine, seed):
    rng = random.Random(seed)
    names = ["ingest", "plan", "forecast", "job with spaces", "\u00e9t\u00e9", "a", "z" * 60][:rng.randint(1, 7)]
    with engine.begin() as conn:
        assert conn.execute(text(LATEST_JOB_RUNS_SQL)).all() == []  # no runs yet
        for i in range(rng.randint(1, 300)):
            name = rng.choice(names)
            slot = T0 + timedelta(minutes=rng.randint(0, 500))
            started = slot + timedelta(seconds=rng.randint(0, 5))
            finished = None if rng.random() < 0.2 else started + timedelta(seconds=rng.uniform(0, 90))
            # a running claim's lease: out long ago (its process died), or ahead (it runs)
            lease = started + timedelta(seconds=rng.uniform(1, 120)) if rng.random() < 0.5 else None
            conn.execute(text("INSERT INTO job_runs (job_name, slot, started_at, finished_at, status, detail, "
                              "lease_expires_at) VALUES (:n, :s, :st, :f, :status, '{}'::jsonb, "
                              "coalesce(:lease, now() + interval '1 minute')) ON CONFLICT DO NOTHING"),
                         {"n": name, "s": slot, "st": started, "f": finished, "lease": lease,
                          "status": "running" if finished is None else rng.choice(["ok", "failed", "abandoned"])})
    with engine.connect() as conn:
        newest = conn.execute(text(LATEST_JOB_RUNS_SQL)).all()
        assert sorted(newest) == sorted(conn.execute(text(EVERY_RUN)).all())
        assert len(newest) == len({row[0] for row in newest})  # one per job


def test_a_run_past_its_lease_reads_abandoned_and_one_within_it_is_not_reported(engine):
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO job_runs (job_name, slot, started_at, finished_at, status, lease_expires_at) VALUES "
            "('plan', :t0, :t0, :t1, 'ok', NULL), "
            "('plan', :t1, :t1, NULL, 'running', now() + interval '1 minute'), "  # runs now
            "('retrain', :t0, :t0, NULL, 'running', :t1)"),  # its process died; its lease ran out at t1
            {"t0": T0, "t1": T0 + timedelta(seconds=30)})
        assert conn.execute(text(LATEST_JOB_RUNS_SQL)).all() == [("plan", "ok", 30), ("retrain", "abandoned", 30)]
