"""Job runs' owners, leases and locks (``forecaster.jobs.runs``) on a real PostgreSQL, with scheduler processes of
their own (``tests/job_lease_child.py``) that the tests kill:

* a run killed mid-run is reported ``abandoned`` on ``/metrics`` once its lease runs out, and its slot runs again;
* a process marks the dead claims of its host's previous processes, never a live one;
* an outcome the database was away for is recorded when it is back;
* a job runs in one process at a time: the second process skips it (at once) while the first runs it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import text

from forecaster.jobs import runs as runs_module
from forecaster.jobs.runs import JobSpec, run_once
from forecaster.settings import Settings
from forecaster.store.db import make_engine, upgrade
from forecaster.store.job_runs import LATEST_JOB_RUNS_SQL

ROOT = Path(__file__).resolve().parent.parent
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
RETRAIN_SLOT = datetime(2026, 11, 29, 3, 0, tzinfo=timezone.utc)


def _child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.job_lease_child", *args], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _read_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the child process said nothing"
    return proc.stdout.readline().strip()


def _hold(db_url: str, job: str, lease_s: float, every_s: int = 86_400, offset_s: int = 3 * 3600):
    """A child that claims ``job``'s slot of NOW and runs it for a minute: (process, its owner name)."""
    proc = _child("hold", db_url, job, str(every_s), str(offset_s), NOW.isoformat(), str(lease_s))
    owner = _read_line(proc).removeprefix("owner").strip()
    assert _read_line(proc) == "started"
    return proc, owner


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_run_killed_mid_run_is_reported_abandoned_and_its_slot_runs_again(engine, settings, db_url):
    """The nightly retrain SIGKILLed mid-run: once its lease has run out (1 s here), /metrics reports it
    ``abandoned`` (``PrewarmJobFailing`` fires on that), and the next attempt of the day takes the slot over
    (attempt 2) instead of skipping it as run."""
    child, child_owner = _hold(db_url, "retrain", lease_s=1.0)
    try:
        time.sleep(0.3)  # a heartbeat or two
    finally:
        _kill(child)
    time.sleep(1.5)  # its lease runs out
    from api.main import create_app

    with engine.connect() as conn:
        latest = conn.execute(text(LATEST_JOB_RUNS_SQL)).all()
    with TestClient(create_app(settings, engine, clock=lambda: NOW)) as client:
        scraped = [line for line in client.get("/metrics").text.splitlines()
                   if line.startswith("prewarm_job_last_duration_seconds{")]
    ran = []
    retrain = JobSpec("retrain", lambda e, s, n: ran.append(n) or {"trained": 1}, every_s=86_400, offset_s=3 * 3600)
    detail = run_once(engine, settings, retrain, now=NOW + timedelta(minutes=5))
    with engine.connect() as conn:
        row = conn.execute(text("SELECT status, finished_at IS NOT NULL, attempt, detail->'took_over'->>'owner' "
                                "FROM job_runs WHERE job_name = 'retrain' AND slot = :s"),
                           {"s": RETRAIN_SLOT}).first()
    found = {"latest": [(name, status) for name, status, _ in latest],
             "scraped": any('job="retrain"' in line and 'status="abandoned"' in line for line in scraped),
             "ran again": detail is not None and ran == [NOW + timedelta(minutes=5)],
             "row": tuple(row)}
    assert found == {"latest": [("retrain", "abandoned")], "scraped": True, "ran again": True,
                     "row": ("ok", True, 2, child_owner)}, scraped


def test_the_dead_claims_of_this_hosts_gone_processes_are_marked_and_live_ones_kept(engine, settings, db_url):
    """A process (a restarted container's, on the same host) finds the claims of this host's processes that are
    gone and marks them ``abandoned`` at once, long before their lease (a minute) runs out; a claim whose process
    still runs it (it holds the job's lock) stays ``running``."""
    from forecaster.jobs.runs import abandon_dead_runs
    from forecaster.store.job_runs import job_lock_held

    live, _ = _hold(db_url, "partitions", lease_s=60.0, every_s=3600, offset_s=0)
    try:
        dead, _ = _hold(db_url, "retrain", lease_s=60.0)
        _kill(dead)
        deadline = time.monotonic() + 10  # the server ends the killed process's session once it sees it gone
        while job_lock_held(engine, "retrain") and time.monotonic() < deadline:
            time.sleep(0.05)
        marked = abandon_dead_runs(engine)
        with engine.connect() as conn:
            rows = dict(conn.execute(text("SELECT job_name, status FROM job_runs")).all())
            # with the process gone, the next run of the job takes the slot (its lease has not run out)
            assert run_once(engine, settings, JobSpec("retrain", lambda e, s, n: {}, 86_400, 3 * 3600),
                            now=NOW) is not None
    finally:
        _kill(live)
    assert marked == {"retrain": [RETRAIN_SLOT]}
    assert rows == {"retrain": "abandoned", "partitions": "running"}


def test_an_outcome_the_database_was_away_for_is_recorded_when_it_is_back(crashable, tmp_path, monkeypatch):
    """The database goes away while the job runs and stays away longer than the slot's wait: the outcome cannot be
    recorded then. It is kept, and the next run that reaches the database records it; the slot does not stay
    ``running`` while its process lives on."""
    engine = make_engine(crashable.url)
    upgrade(engine)
    settings = Settings(database_url=crashable.url, data_dir=tmp_path)

    calls = []

    def dies_inside(engine_, settings_, now):
        calls.append(now)
        crashable.crash()  # down for longer than the wait below
        with engine_.connect() as conn:
            conn.execute(text("SELECT 1"))
        return {}

    forecast = JobSpec("forecast", dies_inside, every_s=60)
    monkeypatch.setattr(runs_module, "LEASE_S", 0.5, raising=False)
    try:
        detail = run_once(engine, settings, forecast, now=NOW, sleep=lambda s: None, db_wait_s=3)
        assert detail["error"].startswith("OperationalError")
        crashable.start()  # its lease has run out meanwhile
        with engine.connect() as conn:
            before = conn.execute(text("SELECT status FROM job_runs WHERE job_name = 'forecast'")).scalar()
        # the slot fired again: its kept outcome is recorded first, so the slot is not a dead claim to run again
        again = run_once(engine, settings, forecast, now=NOW + timedelta(seconds=30))
        assert run_once(engine, settings, JobSpec("plan", lambda e, s, n: {}, every_s=60), now=NOW) is not None
        with engine.connect() as conn:
            row = conn.execute(text("SELECT status, finished_at IS NOT NULL, detail->>'error' FROM job_runs "
                                    "WHERE job_name = 'forecast'")).first()
            latest = dict((name, status) for name, status, _ in conn.execute(text(LATEST_JOB_RUNS_SQL)))
    finally:
        engine.dispose()
    assert before == "running"  # nothing could be written while the database was away
    assert again is None and calls == [NOW]
    assert row[:2] == ("failed", True) and row[2].startswith("OperationalError"), row
    assert latest == {"forecast": "failed", "plan": "ok"}


def test_a_second_process_skips_a_job_that_runs_in_another(engine, db_url):
    """Two scheduler processes fire a job every second that takes 1.5 s: it never runs in both at once (each slot's
    run starts after the previous one ended), and the process that finds it running elsewhere returns at once
    instead of waiting for it."""
    children = [_child("loop", db_url, "forecast", "1", "1.5", "4") for _ in range(2)]
    try:
        for child in children:
            assert _read_line(child) == "ready"
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        calls = [json.loads(_read_line(child, timeout=60)) for child in children]
    finally:
        for child in children:
            _kill(child)
    with engine.connect() as conn:
        runs = conn.execute(text("SELECT slot, started_at, finished_at FROM job_runs WHERE job_name = 'forecast' "
                                 "ORDER BY slot")).all()
    overlapping = [(a.slot, b.slot) for a, b in zip(runs, runs[1:]) if b.started_at < a.finished_at]
    assert all(finished is not None for _, _, finished in runs)
    assert len(runs) >= 2 and overlapping == [], runs
    skipped = [end - start for one in calls for start, end, ran in one if not ran]
    assert skipped and max(skipped) < 1.0, skipped  # a skip, not a wait for the other process's run


def test_a_claim_is_taken_over_only_past_its_lease(engine, settings):
    """Another host's claim within its lease holds its slot and the job (the other process runs it, maybe without
    the lock after losing its connection); past its lease it is abandoned and its slot runs again."""
    spec = JobSpec("forecast", lambda e, s, n: {}, every_s=60)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO job_runs (job_name, slot, owner, lease_expires_at) VALUES "
                          "('forecast', :s, 'elsewhere:1:abcd', now() + interval '1 minute')"), {"s": NOW})
    assert run_once(engine, settings, spec, now=NOW) is None  # its slot
    assert run_once(engine, settings, spec, now=NOW + timedelta(minutes=1)) is None  # the job runs elsewhere
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_runs SET lease_expires_at = now() - interval '1 second'"))
    assert run_once(engine, settings, spec, now=NOW + timedelta(minutes=1)) is not None
    assert run_once(engine, settings, spec, now=NOW) is not None  # taken over
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT slot, status, attempt, detail->'took_over'->>'status' FROM job_runs "
                                 "ORDER BY slot")).all()
    assert rows == [(NOW, "ok", 2, "abandoned"), (NOW + timedelta(minutes=1), "ok", 1, None)]


def test_the_lock_connection_takes_no_pool_slot(db_url, settings):
    """The run's lock connection is out of the pool: a job that needs the only pooled connection still gets it."""
    from sqlalchemy import create_engine

    engine = create_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=2)
    try:
        def job(engine_, settings_, now):
            with engine_.connect() as conn:
                return {"backends": conn.execute(text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")).scalar()}

        assert run_once(engine, settings, JobSpec("forecast", job, every_s=60), now=NOW)["backends"] == 2
        with engine.connect() as conn:  # the lock connection is closed with the run
            assert conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
                                ).scalar() == 1
            assert conn.execute(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")).scalar() == 0
    finally:
        engine.dispose()


def test_a_jobs_lock_is_seen_held_in_its_own_database_only(engine, db_url, pg_admin_url):
    """``job_lock_held`` reads ``pg_locks`` for the 64-bit key, either sign, in this database only."""
    from sqlalchemy import create_engine

    from forecaster.store.job_runs import job_lock_held, job_lock_key

    names = ["forecast", "retrain", "plan", "ingest", "partitions"]
    assert {job_lock_key(n) < 0 for n in names} == {True, False}  # both signs among them
    other = create_engine(pg_admin_url)  # another database of the same server
    try:
        with engine.connect() as holder, other.connect() as elsewhere:
            holder.execute(text("SELECT pg_advisory_lock(:k)"), {"k": job_lock_key("forecast")})
            holder.execute(text("SELECT pg_advisory_lock(:k)"), {"k": job_lock_key("retrain")})
            elsewhere.execute(text("SELECT pg_advisory_lock(:k)"), {"k": job_lock_key("plan")})
            assert {n: job_lock_held(engine, n) for n in names} == {
                "forecast": True, "retrain": True, "plan": False, "ingest": False, "partitions": False}
            holder.rollback()  # a session lock outlives its transaction
            assert job_lock_held(engine, "forecast")
            holder.execute(text("SELECT pg_advisory_unlock_all()"))
            assert not job_lock_held(engine, "forecast")
    finally:
        other.dispose()


def test_the_heartbeat_keeps_a_long_run_alive_past_its_first_lease(engine, settings, monkeypatch):
    """A run longer than its lease (0.6 s here, the job 2 s): the heartbeat extends the lease, so the run is never
    reported abandoned and its slot cannot be taken over; its outcome is recorded at the end."""
    import threading

    from forecaster.store.job_runs import claim_slot

    started = threading.Event()

    def long_job(engine_, settings_, now):
        started.set()
        time.sleep(2.0)
        return {"long": True}

    out: list = []
    monkeypatch.setattr(runs_module, "LEASE_S", 0.6, raising=False)
    runner = threading.Thread(target=lambda: out.append(run_once(
        engine, settings, JobSpec("retrain", long_job, 86_400, 3 * 3600), now=NOW)))
    runner.start()
    try:
        assert started.wait(30)
        time.sleep(1.5)  # past the first lease
        with engine.connect() as conn:
            lease_left = conn.execute(text("SELECT lease_expires_at > now() FROM job_runs")).scalar()
            latest = conn.execute(text(LATEST_JOB_RUNS_SQL)).all()
        taken = claim_slot(engine, "retrain", RETRAIN_SLOT, owner="elsewhere:1:abcd", lease_s=60)
    finally:
        runner.join()
    assert (lease_left, latest, taken) == (True, [], None)
    assert out[0]["long"] is True
    with engine.connect() as conn:
        assert conn.execute(text("SELECT status, attempt FROM job_runs")).all() == [("ok", 1)]


def test_a_second_run_of_a_job_in_this_process_waits_for_the_first_and_runs_its_own_slot(engine, settings):
    """The scheduler's catch-up run at start (``partitions@start``) can still run when the job's next boundary
    fires in the same process: the advisory lock is per session, so the boundary's run took the catch-up's lock
    for another process's and skipped its slot. It waits for it instead, then runs its own slot."""
    import threading

    started = threading.Event()
    slots: list = []

    def slow(engine_, settings_, now):
        slots.append(now)
        started.set()
        time.sleep(1.0)
        return {}

    spec = JobSpec("partitions", slow, 3600)
    first = threading.Thread(target=lambda: run_once(engine, settings, spec, now=NOW))
    first.start()
    try:
        assert started.wait(30)
        second = run_once(engine, settings, spec, now=NOW + timedelta(hours=1))  # the next boundary, same process
    finally:
        first.join()
    assert second is not None and slots == [NOW, NOW + timedelta(hours=1)]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT status FROM job_runs WHERE job_name = 'partitions' ORDER BY slot")).scalars(
        ).all() == ["ok", "ok"]
