"""Scheduler: jobs in a PostgreSQL job store, each slot run once, failures recorded, ingest and partition jobs."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy import text

from forecaster.jobs import scheduler as scheduler_module
from forecaster.jobs.runs import JobSpec, run_once, slot_for
from forecaster.jobs.scheduler import build_scheduler, partition_job, register_job
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.invocations import read_counts


def test_slot_for_minutes_and_nightly_offsets():
    now = datetime(2026, 11, 29, 12, 34, 56, tzinfo=timezone.utc)
    assert slot_for(now, 60) == datetime(2026, 11, 29, 12, 34, tzinfo=timezone.utc)
    assert slot_for(now, 86_400, 3 * 3600) == datetime(2026, 11, 29, 3, 0, tzinfo=timezone.utc)
    early = datetime(2026, 11, 29, 2, 0, tzinfo=timezone.utc)
    assert slot_for(early, 86_400, 3 * 3600) == datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc)


def test_a_slot_runs_once_and_failures_are_recorded(engine, settings, now):
    calls = []
    spec = JobSpec("probe", lambda e, s, n: calls.append(n) or {"seen": len(calls)}, every_s=60)
    assert run_once(engine, settings, spec, now=now)["seen"] == 1
    assert run_once(engine, settings, spec, now=now + timedelta(seconds=30)) is None  # same minute
    assert run_once(engine, settings, spec, now=now + timedelta(seconds=60))["seen"] == 2
    assert calls == [now, now + timedelta(seconds=60)]

    def broken(e, s, n):
        raise RuntimeError("metrics source down")

    detail = run_once(engine, settings, JobSpec("broken", broken, every_s=60), now=now)
    assert detail["error"] == "RuntimeError: metrics source down"
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT job_name, status, detail->>'error' FROM job_runs ORDER BY job_name, slot")).all()
    assert rows == [("broken", "failed", "RuntimeError: metrics source down"), ("probe", "ok", None),
                    ("probe", "ok", None)]


@pytest.fixture
def probe_job():
    calls: list[datetime] = []
    lock = threading.Lock()

    def probe(engine, settings, now):
        with lock:
            calls.append(now)
        return {}

    register_job(JobSpec("probe", probe, every_s=1))
    yield calls
    scheduler_module.JOBS.pop("probe", None)


def test_two_schedulers_on_one_job_store_never_run_a_slot_twice(engine, settings, probe_job):
    """A restarted scheduler, or a second replica, shares the PostgreSQL job store and the slot claims."""
    first = build_scheduler(engine, settings, BackgroundScheduler(timezone=timezone.utc))
    first.start()
    time.sleep(1.5)
    second = build_scheduler(engine, settings, BackgroundScheduler(timezone=timezone.utc))
    second.start()  # both now fire 'probe' every second
    time.sleep(3.2)
    first.shutdown(wait=True)
    second.shutdown(wait=True)
    with engine.connect() as conn:
        stored = set(conn.execute(text("SELECT id FROM apscheduler_jobs")).scalars())
        slots = conn.execute(text("SELECT slot FROM job_runs WHERE job_name = 'probe'")).scalars().all()
    assert {"probe", "ingest", "partitions"} <= stored
    assert len(probe_job) == len(slots) >= 3
    assert len(set(slots)) == len(slots)


def test_partition_job_creates_days_ahead(engine, settings, now):
    detail = partition_job(engine, settings.model_copy(update={"partition_days_ahead": 2}), now)
    assert detail["created"] == ["invocations_20261129", "invocations_20261130", "invocations_20261201"]
    assert partition_job(engine, settings, now)["created"][:1] == ["invocations_20261202"]


def test_ingest_job_pulls_prometheus_and_advances_its_watermark(engine, settings, prom_server):
    """The real ingest path: Prometheus -> validation -> COPY -> coverage; the next run starts where it ended."""
    # both runs lie in the past: the source never asks Prometheus about minutes after the real clock
    now = datetime.now(timezone.utc).replace(second=0, microsecond=0) - timedelta(minutes=10)
    with engine.begin() as conn:
        upsert_models(conn, [
            ServingModelSpec(id="steady", labels={"prometheus_query": "vector(4)"}),
            ServingModelSpec(id="silent", labels={"prometheus_query": 'sum(nonexistent_metric{job="x"})'}),
        ])
    settings = settings.model_copy(update={"prometheus_url": prom_server.url, "prometheus_lag_s": 120,
                                           "prometheus_backfill_minutes": 30})
    first = scheduler_module.ingest_job(engine, settings, now)
    assert first == {"models": 1, "rows_written": 30, "invocations": 120, "skipped": 1, "burst_factors_updated": 0,
                     "burst_errors": {}, "peaks_clipped": 0, "query_errors": {}, "query_error_models": 0,
                     "catch_up_skipped_models": 0, "catch_up_skipped_minutes": 0}
    later = now + timedelta(minutes=5)
    second = scheduler_module.ingest_job(engine, settings, later)
    assert second["rows_written"] == 5 and second["invocations"] == 20
    end = later - timedelta(minutes=2)
    frame = read_counts(engine, ["steady", "silent"], end - timedelta(minutes=36), end)
    steady = frame[frame.unique_id == "steady"]["y"]
    assert steady.isna().sum() == 1 and (steady.dropna() == 4).all()  # 35 minutes known, the one before unknown
    assert frame[frame.unique_id == "silent"]["y"].isna().all()  # no samples: unknown, not zero
