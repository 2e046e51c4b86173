"""Upgrades that run while the database is in use: several processes at once, and long readers of a table.

Every ``serve`` and ``scheduler`` process upgrades the schema at start (``cli._open_database``); pods of one rollout
start together, and the running ones keep reading. A real PostgreSQL, real separate sessions.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from forecaster.store.db import current_revision, make_engine, upgrade

REPO_ROOT = Path(__file__).resolve().parent.parent
HEAD = sorted(p.name.split("_")[0] for p in (REPO_ROOT / "migrations" / "versions").glob("[0-9]*_*.py"))[-1]
UPGRADER = "prewarm-test-upgrader"


def _wait_until(condition, *, timeout_s: float = 30.0, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _sessions_waiting_on_a_lock(engine, application_name: str) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                 "AND application_name = :a AND wait_event_type = 'Lock'"),
                            {"a": application_name}).scalar()


def _with_application_name(url: str, name: str) -> str:
    return make_url(url).update_query_dict({"application_name": name}).render_as_string(hide_password=False)


@pytest.fixture
def at_0016(empty_db_url):
    """A database one release behind (0016): the next upgrade alters ``forecasts`` (0017), then adds a table."""
    engine = make_engine(empty_db_url)
    upgrade(engine, "0016")
    yield engine
    engine.dispose()


def test_processes_starting_together_upgrade_one_after_the_other(at_0016, empty_db_url):
    """Three processes start at once (two API pods and the scheduler) while a job reads ``forecasts``. They used to
    run the same migration side by side: all queued on ``forecasts``, and once the reader ended the first added the
    column and the others failed with DuplicateColumn (on an empty database: UniqueViolation on alembic_version).
    Now one upgrades and the others wait on the migration lock, then find the schema at head."""
    reader = at_0016.connect()
    reader.execute(text("SELECT count(*) FROM forecasts"))  # ACCESS SHARE until rollback, like a running job
    child = ("import sys\n"
             "from forecaster.store.db import make_engine, upgrade\n"
             "engine = make_engine(sys.argv[1])\n"
             "upgrade(engine)\n"
             "engine.dispose()\n")
    url = _with_application_name(empty_db_url, UPGRADER)
    procs = [subprocess.Popen([sys.executable, "-c", child, url], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        # every process has reached the point where it waits: on forecasts (the migrating one) or the migration lock
        _wait_until(lambda: _sessions_waiting_on_a_lock(at_0016, UPGRADER) >= 3, what="three waiting upgraders")
    finally:
        reader.rollback()
        reader.close()
    results = [proc.communicate(timeout=60) for proc in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
    waited = [err for _, err in results if "another process" in err and "is migrating the schema" in err]
    assert len(waited) == 2, [err for _, err in results]
    assert current_revision(at_0016) == HEAD
    with at_0016.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1
        assert conn.execute(text("SELECT count(*) FROM information_schema.columns WHERE table_name = 'forecasts' "
                                 "AND column_name = 'request_rate_rpm'")).scalar() == 1


def test_each_migration_commits_on_its_own(empty_db_url):
    """The upgrade was one transaction: a migration waiting for a lock kept every lock the earlier ones took, so
    reads of those tables queued behind it for as long as it waited. Now each migration commits before the next."""
    engine = make_engine(empty_db_url)
    upgrade(engine, "0015")
    reader = engine.connect()
    reader.execute(text("SELECT count(*) FROM forecasts"))  # 0017 must wait for this
    failures: list[BaseException] = []

    def run() -> None:
        upgrader = make_engine(_with_application_name(empty_db_url, UPGRADER))
        try:
            upgrade(upgrader)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)
        finally:
            upgrader.dispose()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        _wait_until(lambda: _sessions_waiting_on_a_lock(engine, UPGRADER) >= 1, what="the upgrade waiting on forecasts")
        with engine.begin() as conn:  # 0016 altered action_counts: its lock went with its commit
            conn.execute(text("SET LOCAL lock_timeout = '1s'"))
            conn.execute(text("SELECT count(*) FROM action_counts"))
        assert current_revision(engine) == "0016"  # 0016 committed while 0017 waits
    finally:
        reader.rollback()
        reader.close()
        thread.join(timeout=60)
    assert not failures, failures
    assert current_revision(engine) == HEAD
    engine.dispose()


def test_a_lock_not_granted_is_retried_a_bounded_number_of_times_then_named(at_0016, caplog):
    """A long reader of ``forecasts`` (a report, pg_dump) outlasts every attempt: the upgrade gives up after its
    attempts, each waiting ``lock_timeout`` at most, and says which table and session blocked it."""
    from forecaster.store.db import MigrationLockTimeout

    reader = at_0016.connect()
    reader.execute(text("SELECT count(*) FROM forecasts"))
    reader_pid = reader.execute(text("SELECT pg_backend_pid()")).scalar()
    caplog.set_level("WARNING", logger="forecaster.store.db")
    started = time.monotonic()
    try:
        with pytest.raises(MigrationLockTimeout) as raised:
            upgrade(at_0016, lock_timeout_s=0.2, attempts=3, retry_delay_s=0.05)
    finally:
        reader.rollback()
        reader.close()
    assert time.monotonic() - started < 10
    message = str(raised.value)
    assert "not granted within 0.2 s in 3 attempts" in message
    assert "stays at revision 0016" in message
    assert f"forecasts (held by pid {reader_pid}" in message
    assert "ALTER TABLE forecasts" in message
    retries = [r for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) == 2
    assert "attempt 1/3" in retries[0].getMessage() and "forecasts (held by pid" in retries[0].getMessage()
    assert current_revision(at_0016) == "0016"
    upgrade(at_0016)  # once the reader is gone
    assert current_revision(at_0016) == HEAD


def test_a_lock_granted_on_a_later_attempt_completes_the_upgrade(at_0016, caplog):
    reader = at_0016.connect()
    reader.execute(text("SELECT count(*) FROM forecasts"))
    caplog.set_level("WARNING", logger="forecaster.store.db")
    release = threading.Timer(1.0, lambda: (reader.rollback(), reader.close()))
    release.start()
    try:
        assert upgrade(at_0016, lock_timeout_s=0.3, attempts=10, retry_delay_s=0.2) is True
    finally:
        release.join()
    assert any("retrying in" in r.getMessage() for r in caplog.records)
    assert current_revision(at_0016) == HEAD


def test_the_upgrade_leaves_no_lock_timeout_on_the_pooled_connections(at_0016):
    """The service's engine runs the upgrade at start, then serves: its pooled sessions keep the server's default."""
    upgrade(at_0016)
    pooled = at_0016.pool.checkedin()
    assert pooled >= 2  # the migration lock's connection and the migrating one
    conns = [at_0016.connect() for _ in range(pooled)]
    try:
        assert {conn.exec_driver_sql("SHOW lock_timeout").scalar() for conn in conns} == {"0"}
    finally:
        for conn in conns:
            conn.close()
