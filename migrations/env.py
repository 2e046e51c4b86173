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

Autogenerate (``alembic check``, ``alembic revision --autogenerate``) compares
``Base.metadata`` with the database, server defaults included
(``compare_server_default``). The metadata declares every table, index, unique
constraint, column type and server default the migrations create (``tests/test_migrations.py``
holds it to that); what it cannot declare is left out by :func:`partition_filter`:
the daily partitions of ``invocations`` and ``forecasts`` (``invocations_20261129``,
``forecasts_20261129``), which ingest, the forecast job and retention create and
drop at run time. Without the hook every partition would come out as a
``drop_table``.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection, create_engine, text

from forecaster.store.tables import Base

config = context.config
target_metadata = Base.metadata


#: Tables of the current schema that are partitions of another table (``pg_class.relispartition``).
_PARTITIONS_SQL = ("SELECT c.relname FROM pg_class c "
                   "WHERE c.relispartition AND c.relnamespace = to_regnamespace(current_schema())")


def partition_filter(connection: Connection):
    """An ``include_name`` hook for ``connection``'s database: every name but a partition's table.

    A partition is created by raw SQL at run time, belongs to its parent's definition and has no place in the
    metadata. The partitions are looked up on the first call, which comes only from autogenerate (inside its
    transaction): a plain upgrade never calls the hook, so it runs no query on the connection before Alembic's own
    transactions.
    """
    partitions: set[str] | None = None

    def include_name(name: str | None, type_: str, parent_names: dict) -> bool:
        nonlocal partitions
        if type_ != "table":
            return True
        if partitions is None:
            partitions = set(connection.execute(text(_PARTITIONS_SQL)).scalars())
        return name not in partitions

    return include_name


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, transaction_per_migration=True,
                      compare_server_default=True,
                      include_name=partition_filter(connection))
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
