"""Scheduler: jobs in a PostgreSQL job store, each slot run once, failures recorded, ingest and partition jobs."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

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
    first = build_scheduler(engine, settings, background=True)
    first.start()
    time.sleep(1.5)
    second = build_scheduler(engine, settings, background=True)
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


# --- the loop outlives job store errors; its heartbeat is what /healthz reads --------------------------------------


class Recorder:
    """Every default job (their real periods and offsets, hence their real triggers) made a cheap recorder of its
    runs; :meth:`add` registers more. ``runs[name]`` lists each run's ``now``."""

    def __init__(self, settings) -> None:
        self.runs: dict[str, list[datetime]] = defaultdict(list)
        self._lock = threading.Lock()
        for spec in scheduler_module.default_jobs(settings):
            self.add(spec.name, spec.every_s, spec.offset_s)

    def add(self, name: str, every_s: int, offset_s: int = 0) -> None:
        def run(engine, settings, now):
            with self._lock:
                self.runs[name].append(now)
            return {}

        register_job(JobSpec(name, run, every_s, offset_s))


@pytest.fixture
def recorder(settings):
    saved = dict(scheduler_module.JOBS)
    yield Recorder(settings)
    scheduler_module.JOBS.clear()
    scheduler_module.JOBS.update(saved)


def _serve_scheduler(engine, settings):
    """The scheduler as ``prewarm serve --scheduler`` builds it."""
    return build_scheduler(engine, settings, background=True)


def _until(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def _outage() -> OperationalError:
    return OperationalError("UPDATE apscheduler_jobs SET next_run_time=...", {},
                            Exception("terminating connection due to administrator command"))


def test_a_job_store_error_while_apscheduler_updates_a_job_does_not_end_the_scheduler(engine, settings, recorder,
                                                                                      monkeypatch):
    """The database gone between APScheduler's ``get_due_jobs`` and its ``update_job`` (the audit's outage during the
    UPDATE of ``apscheduler_jobs``): the loop logs it and tries again after the job store's retry interval; its
    thread used to end there, and no job ran again."""
    recorder.add("probe", 1)
    failures = []
    real_update = SQLAlchemyJobStore.update_job

    def update_job(store, job):
        if job.id == "probe" and not failures:
            failures.append(job.id)
            raise _outage()
        return real_update(store, job)

    monkeypatch.setattr(SQLAlchemyJobStore, "update_job", update_job)
    scheduler = _serve_scheduler(engine, settings)
    scheduler.jobstore_retry_interval = 0.5
    scheduler.start()
    try:
        assert _until(lambda: failures and len(recorder.runs["probe"]) >= 3, timeout=15), recorder.runs["probe"]
        assert scheduler._thread.is_alive()
        healthy, detail = scheduler.heartbeat.health()
    finally:
        scheduler.shutdown()
    assert healthy, detail
    assert detail["errors"] == 1 and detail["last_error"].startswith("OperationalError")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop's end, on purpose
def test_healthz_fails_once_the_scheduler_loop_has_ended_or_stalls(engine, settings, recorder, monkeypatch):
    """``/healthz`` of a process that runs the scheduler: 200 while its loop turns, 503 when it has not woken for
    HEARTBEAT_STALE_S (stuck) and when its thread has ended; the API's own ``/healthz`` (no scheduler) is unchanged."""
    from apscheduler.schedulers.blocking import BlockingScheduler
    from fastapi.testclient import TestClient

    from api.main import create_app
    from forecaster.jobs.heartbeat import HEARTBEAT_STALE_S, SchedulerHeartbeat

    clock = [time.time()]
    heartbeat = SchedulerHeartbeat(clock=lambda: clock[0])
    scheduler = build_scheduler(engine, settings, background=True, heartbeat=heartbeat)
    assert scheduler.heartbeat is heartbeat
    scheduler.start(paused=True)  # the loop turns (and beats); no job runs
    try:
        with TestClient(create_app(settings, engine, scheduler_health=heartbeat.health)) as client:
            assert _until(lambda: heartbeat.state()["last_wakeup"] is not None, timeout=5)
            ok = client.get("/healthz")
            assert ok.status_code == 200 and ok.json()["scheduler"]["status"] == "ok", ok.json()
            clock[0] += HEARTBEAT_STALE_S + 1  # no wakeup since: stuck
            stuck = client.get("/healthz")
            assert stuck.status_code == 503 and stuck.json()["scheduler"]["status"].startswith("stuck"), stuck.json()
            clock[0] -= HEARTBEAT_STALE_S + 1

            def ends_the_loop(self):
                raise SystemExit("not an Exception: it ends the loop, guarded or not")

            monkeypatch.setattr(BlockingScheduler, "_process_jobs", ends_the_loop)
            scheduler.wakeup()
            assert _until(lambda: not scheduler._thread.is_alive(), timeout=5)
            dead = client.get("/healthz")
            assert dead.status_code == 503 and dead.json()["scheduler"]["status"].startswith("stopped"), dead.json()
        with TestClient(create_app(settings, engine)) as client:
            assert client.get("/healthz").json() == {"status": "ok"}
    finally:
        monkeypatch.undo()
        scheduler.shutdown()


def test_api_workers_answer_healthz_from_the_parent_schedulers_heartbeat_file(db_url, tmp_path, monkeypatch):
    """``prewarm serve --workers N --scheduler``: the scheduler beats into a file whose path the workers inherit;
    each worker's ``/healthz`` reads it."""
    from fastapi.testclient import TestClient

    from api.main import app_from_environment
    from forecaster.jobs.heartbeat import HEARTBEAT_FILE_ENV, SchedulerHeartbeat

    path = tmp_path / "heartbeat.json"
    monkeypatch.setenv("DATABASE_URL", db_url)
    monkeypatch.setenv("PREWARM_API_SNAPSHOT_REFRESH_S", "0")
    monkeypatch.setenv(HEARTBEAT_FILE_ENV, str(path))
    heartbeat = SchedulerHeartbeat(path)
    with TestClient(app_from_environment()) as client:
        assert client.get("/healthz").json()["scheduler"] == {"status": "no heartbeat"}
        heartbeat.loop_started()
        heartbeat.failed(_outage())
        answer = client.get("/healthz")
        assert answer.status_code == 200 and answer.json()["scheduler"]["errors"] == 1, answer.json()
        heartbeat.loop_ended()
        assert client.get("/healthz").status_code == 503


SERVE_WITH_FAULTS = """
import os
import sys
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from sqlalchemy.exc import OperationalError
from forecaster.jobs import scheduler as sch
from forecaster.jobs.runs import JobSpec
from forecaster.settings import load_settings


def update_job(store, job):
    if job.id == "tick":
        updates.append(job.id)
        if len(updates) == 1:  # the database gone while APScheduler writes the next run time back
            raise OperationalError("UPDATE apscheduler_jobs", {}, Exception("terminating connection"))
        if os.path.exists(os.environ["END_THE_LOOP"]):  # the loop's thread ends (not an Exception: no guard keeps it)
            raise SystemExit("the scheduler's loop ends")
    return real_update(store, job)


def build(*args, **kwargs):
    scheduler = real_build(*args, **kwargs)
    scheduler.jobstore_retry_interval = 0.5
    return scheduler


if __name__ == "__main__":  # API workers are spawned: they import this file too
    for spec in sch.default_jobs(load_settings()):  # the real job names, made cheap
        sch.register_job(JobSpec(spec.name, lambda e, s, now: {}, spec.every_s, spec.offset_s))
    sch.register_job(JobSpec("tick", lambda e, s, now: {}, every_s=1))
    real_update, updates = SQLAlchemyJobStore.update_job, []
    SQLAlchemyJobStore.update_job = update_job
    real_build, sch.build_scheduler = sch.build_scheduler, build
    from forecaster.cli import main
    sys.argv = ["prewarm", *sys.argv[1:]]
    main()
"""


def test_serve_with_the_scheduler_outlives_a_job_store_error_and_healthz_reports_a_dead_loop(engine, db_url,
                                                                                            tmp_path, workers=1):
    """``prewarm serve --scheduler`` (the scheduler pod): after a job store error in APScheduler's bookkeeping the
    jobs go on running; once the loop's thread has ended, ``/healthz`` (the pod's liveness probe) answers 503.

    ``workers=2`` (API workers in processes of their own, reading the heartbeat file) passes too; it is not
    parametrized here because spawning the workers takes half a minute on a busy machine."""
    import os
    import signal
    import subprocess
    import sys

    import httpx

    from tests.runtime_fixtures import free_port, wait_until

    script = tmp_path / "serve_with_faults.py"
    script.write_text(SERVE_WITH_FAULTS)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_") and k != "DATABASE_URL"}
    env.update(DATABASE_URL=db_url, PREWARM_DATA_DIR=str(tmp_path / "data"), PREWARM_MODELS_DIR=str(tmp_path / "m"),
               PREWARM_API_SNAPSHOT_REFRESH_S="0", PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               END_THE_LOOP=str(tmp_path / "end-the-loop"))
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, str(script), "serve", "--scheduler", "--port", str(port),
                                   "--workers", str(workers)], env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/healthz"

    def ticks() -> int:
        with engine.connect() as conn:
            return conn.execute(text("SELECT count(*) FROM job_runs WHERE job_name = 'tick'")).scalar()

    try:
        wait_until(lambda: httpx.get(url, timeout=2).status_code == 200, timeout=60, what="prewarm serve",
                   proc=server, log=log)
        wait_until(lambda: ticks() >= 3, timeout=15, what="ticks after the job store error", proc=server, log=log)
        assert httpx.get(url, timeout=2).json()["scheduler"]["errors"] == 1
        (tmp_path / "end-the-loop").touch()
        wait_until(lambda: httpx.get(url, timeout=2).status_code == 503, timeout=15, what="/healthz failing",
                   proc=server, log=log)
        scheduler = httpx.get(url, timeout=2).json()["scheduler"]
        assert scheduler["status"].startswith("stopped") and scheduler["errors"] == 1, scheduler
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _next_run_times(engine) -> dict[str, float]:
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT id, next_run_time FROM apscheduler_jobs")).all())


def test_a_shutdown_takes_no_due_job_and_leaves_its_run_time_stored(engine, settings, recorder):
    """``shutdown()`` wakes the loop to end it; APScheduler then processed the due jobs once more, handing each to
    the executor already shut down and moving its stored next run time on: the slot due at that moment was lost, a
    restart did not run it either."""
    due = (datetime.now(timezone.utc) - timedelta(minutes=5)).replace(microsecond=0)
    scheduler = _serve_scheduler(engine, settings)
    scheduler.start(paused=True)
    scheduler.modify_job("retrain", next_run_time=due)
    scheduler.shutdown()
    assert _next_run_times(engine)["retrain"] == due.timestamp()
    assert not recorder.runs["retrain"]


# --- a restart keeps the stored run times; interval jobs on fixed boundaries --------------------------------------


def _upkeep_ran(engine, now: datetime) -> None:
    """ok runs of partitions and retention for the hour of ``now`` and the next (no run at start, even when the
    hour turns during the test)."""
    with engine.begin() as conn:
        for name in ("partitions", "retention"):
            for slot in (slot_for(now, 3600), slot_for(now, 3600) + timedelta(hours=1)):
                conn.execute(text("INSERT INTO job_runs (job_name, slot, started_at, finished_at, status, detail) "
                                  "VALUES (:n, :s, now(), now(), 'ok', '{}'::jsonb)"), {"n": name, "s": slot})


def test_a_restart_keeps_stored_run_times_so_a_missed_nightly_retrain_runs(engine, settings, recorder):
    """The retrain fell due while the process was down (its stored next run time 5 minutes ago, within its 12 h
    grace): the restarted scheduler runs it. It used to replace every stored job, the next run recomputed from the
    start: tomorrow's retrain."""
    _upkeep_ran(engine, datetime.now(timezone.utc))
    old = _serve_scheduler(engine, settings)
    old.start(paused=True)
    old.modify_job("retrain", next_run_time=datetime.now(timezone.utc) - timedelta(minutes=5))
    old.shutdown()
    restarted = _serve_scheduler(engine, settings)
    restarted.start()
    try:
        assert _until(lambda: recorder.runs["retrain"], timeout=10), dict(recorder.runs)
    finally:
        restarted.shutdown()
    assert len(recorder.runs["retrain"]) == 1
    assert _next_run_times(engine)["retrain"] > time.time()  # the next one: tomorrow's


def test_interval_jobs_fire_on_epoch_aligned_boundaries_that_a_restart_keeps(engine, settings, recorder):
    """Hourly jobs at the top of the hour, minute jobs at second 0, the retrain at its hour, whenever the process
    started, and a restart leaves every stored run time as it was: a start used to push each interval job a whole
    period back (a scheduler restarted more often than hourly never ran retention)."""
    _upkeep_ran(engine, datetime.now(timezone.utc))
    first = _serve_scheduler(engine, settings)
    first.start(paused=True)
    first.shutdown()
    stored = _next_run_times(engine)
    assert stored["partitions"] % 3600 == 0 and stored["retention"] % 3600 == 0, stored
    assert all(stored[name] % 60 == 0 for name in ("ingest", "forecast", "plan", "coldstarts", "forecast_errors"))
    assert stored["retrain"] % 86_400 == settings.retrain_hour_utc * 3600
    assert 0 < stored["partitions"] - time.time() <= 3600
    time.sleep(0.01)
    second = _serve_scheduler(engine, settings)
    second.start(paused=True)
    second.shutdown()
    assert _next_run_times(engine) == stored


def test_partitions_and_retention_run_at_start_when_their_slot_has_not_run(engine, settings, recorder):
    """A first start (or one after more than the grace time down) runs the hourly upkeep at once rather than at the
    next top of the hour; a start within an hour that has its runs leaves them to the next boundary."""
    first = _serve_scheduler(engine, settings)
    first.start()
    try:
        assert _until(lambda: recorder.runs["partitions"] and recorder.runs["retention"], timeout=10), \
            dict(recorder.runs)
        # a one-off run: the jobs' own run times stay on the hour, the one-offs are gone once they fired
        assert _until(lambda: not {"partitions@start", "retention@start"} & set(_next_run_times(engine)), timeout=5)
    finally:
        first.shutdown()
    assert all(_next_run_times(engine)[name] % 3600 == 0 for name in ("partitions", "retention"))
    _upkeep_ran(engine, datetime.now(timezone.utc) + timedelta(hours=1))  # the next hour's too: no flake at :59:59
    second = _serve_scheduler(engine, settings)
    second.start(paused=True)
    second.shutdown()
    stored = _next_run_times(engine)
    assert stored["partitions"] > time.time() and stored["partitions"] % 3600 == 0
    assert not {"partitions@start", "retention@start"} & set(stored)


def test_a_changed_job_replaces_the_stored_one(engine, settings, recorder):
    """A job whose trigger changed (here ingest every 2 minutes instead of 1) is replaced, not kept."""
    import pickle

    first = _serve_scheduler(engine, settings)
    first.start(paused=True)
    first.shutdown()
    recorder.add("ingest", 120)
    second = _serve_scheduler(engine, settings)
    second.start(paused=True)
    second.shutdown()
    with engine.connect() as conn:
        state = pickle.loads(conn.execute(text("SELECT job_state FROM apscheduler_jobs WHERE id = 'ingest'")).scalar())
    assert state["trigger"].interval == timedelta(seconds=120)
    assert _next_run_times(engine)["ingest"] % 120 == 0
