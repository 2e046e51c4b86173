"""The database every bench script runs against: a fresh database on ``PREWARM_BENCH_ADMIN_URL``'s server, or on an
embedded PostgreSQL in a temporary directory that lives for the run."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from forecaster.store.db import embedded_server, make_engine, upgrade


def fresh_database(admin_url: str, name: str) -> str:
    """Drop and create database ``name`` on ``admin_url``'s server, migrated to head; its URL."""
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        conn.execute(text(f"CREATE DATABASE {name}"))
    admin.dispose()
    url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    return url


def on_bench_server(run_on, *, prefix: str):
    """``run_on(admin_url)`` against ``PREWARM_BENCH_ADMIN_URL``'s server, or against an embedded PostgreSQL in a
    temporary directory (``prefix``) that lives for the call; its answer."""
    admin_url = os.environ.get("PREWARM_BENCH_ADMIN_URL")
    if admin_url:
        return run_on(admin_url)
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        os.chmod(tmp, 0o755)
        with embedded_server(Path(tmp) / "pgdata") as url:
            return run_on(url)
