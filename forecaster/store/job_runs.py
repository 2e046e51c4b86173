"""``job_runs``: one row per (job, slot), claimed before the job runs, so a slot never runs twice."""

from __future__ import annotations

import json
from datetime import datetime

from sqlalchemy import Engine, text

#: The names of the jobs with runs, one index probe each (a loose index scan over the primary key): the CTE
#: ``jobs(name)``, its last row NULL.
JOB_NAMES_CTE = """jobs AS (
    SELECT min(job_name) AS name FROM job_runs
    UNION ALL
    SELECT (SELECT min(job_name) FROM job_runs WHERE job_name > jobs.name) FROM jobs WHERE jobs.name IS NOT NULL)"""

#: Each job's newest finished run: ``(job_name, status, seconds)``. A loose index scan over the primary key
#: ``(job_name, slot)`` (the job names one probe at a time, then each one's newest finished slot), so a scrape reads
#: a handful of index entries however many runs are kept: the ``DISTINCT ON (job_name)`` it replaces read every run
#: (about 5,800 a day, kept PREWARM_JOB_RUNS_RETENTION_DAYS): at 2,000,000 runs 2,122 ms a scrape against 1.2 ms
#: (``bench/metrics_history.py``).
LATEST_JOB_RUNS_SQL = """
WITH RECURSIVE """ + JOB_NAMES_CTE + """
SELECT jobs.name, newest.status, newest.seconds FROM jobs CROSS JOIN LATERAL (
    SELECT status, EXTRACT(EPOCH FROM finished_at - started_at) AS seconds FROM job_runs
    WHERE job_name = jobs.name AND finished_at IS NOT NULL ORDER BY slot DESC LIMIT 1) newest
ORDER BY jobs.name"""


def claim_slot(engine: Engine, job_name: str, slot: datetime) -> bool:
    """Record the start of ``job_name`` for ``slot``; False if it ran (or runs) already."""
    with engine.begin() as conn:
        claimed = conn.execute(
            text("INSERT INTO job_runs (job_name, slot) VALUES (:n, :s) ON CONFLICT DO NOTHING RETURNING job_name"),
            {"n": job_name, "s": slot},
        ).first()
    return claimed is not None


def finish_slot(engine: Engine, job_name: str, slot: datetime, *, status: str, detail: dict) -> None:
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE job_runs SET status = :st, finished_at = now(), detail = CAST(:d AS jsonb) "
                 "WHERE job_name = :n AND slot = :s"),
            {"st": status, "d": _json(detail), "n": job_name, "s": slot},
        )


def last_ok_slot(engine: Engine, job_name: str) -> datetime | None:
    """The slot of ``job_name``'s newest successful run that did its work (None when there is none).

    A run whose detail says ``skipped`` (nothing it could do, e.g. a backend that cannot observe) does not count.
    One walk down the primary key ``(job_name, slot)`` from the newest slot.
    """
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT slot FROM job_runs WHERE job_name = :n AND status = 'ok' AND detail->'skipped' IS NULL "
                 "ORDER BY slot DESC LIMIT 1"),
            {"n": job_name},
        ).scalar()


def _json(detail: dict) -> str:
    return json.dumps(detail, default=str)
