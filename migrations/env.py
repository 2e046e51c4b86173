"""Alembic environment: runs migrations on a connection or URL handed in by prewarm.

``forecaster.store.db.upgrade`` passes an open connection in
``config.attributes["connection"]``, outside any transaction, while it holds
the migration advisory lock on another connection; the ``alembic`` command line
can instead set ``sqlalchemy.url`` (or ``DATABASE_URL``), and then takes no lock.

Each migration runs and commits in a transaction of its own
(``transaction_per_migration``), so the locks a migration takes are released
when it is done, not when the last one is. That holds only for a connection
that is not in a transaction when it is handed in: Alembic treats an open
transaction as the caller's and runs everything inside it.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine

from forecaster.store.tables import Base

config = context.config
target_metadata = Base.metadata


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, transaction_per_migration=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("DATABASE_URL")
    if not url:
        raise RuntimeError("no database: set sqlalchemy.url or DATABASE_URL")
    engine = create_engine(url)
    with engine.connect() as connection:
        _run(connection)


if context.is_offline_mode():
    raise RuntimeError("offline (SQL script) mode is not supported; run `prewarm db upgrade`")
run_migrations_online()
