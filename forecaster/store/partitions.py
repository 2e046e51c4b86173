"""Daily range partitions of ``invocations``.

Ingest creates the partitions a batch needs before it writes (historical traces
land in the past); the maintenance job creates ``days_ahead`` days in advance
so that live ingest never waits on DDL. Old partitions are rolled up to
coarser steps, and finally dropped, by :mod:`forecaster.store.retention`.
"""

from __future__ import annotations

import logging
from datetime import date, datetime, timedelta, timezone

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from forecaster.store.db import sqlstate_of

log = logging.getLogger(__name__)

#: How long creating or dropping a partition may wait for the exclusive lock on its parent table. The DDL needs
#: that lock, so it waits behind any open reader of the table (a pg_dump, a session idle in transaction), and
#: every later query of the table queues behind the DDL: without a limit the forecast, plan and ingest jobs all
#: hung. After this long it gives up (SQLSTATE 55P03); maintenance skips the day and the next run tries again.
PARTITION_LOCK_TIMEOUT_S = 3.0
#: SQLSTATE of a lock wait that ran past ``lock_timeout``.
LOCK_NOT_AVAILABLE = "55P03"


def set_partition_lock_timeout(conn: Connection) -> None:
    """Bound this transaction's waits for locks by :data:`PARTITION_LOCK_TIMEOUT_S`."""
    conn.execute(text(f"SET LOCAL lock_timeout = '{max(1, int(PARTITION_LOCK_TIMEOUT_S * 1000))}ms'"))


def is_lock_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a lock wait that ran past ``lock_timeout``."""
    return isinstance(exc, DBAPIError) and sqlstate_of(exc) == LOCK_NOT_AVAILABLE


def partition_name(day: date) -> str:
    return f"invocations_{day:%Y%m%d}"


def day_bounds(day: date) -> tuple[datetime, datetime]:
    """``[start, end)`` of the UTC ``day``: the bounds of its partition."""
    lo = datetime(day.year, day.month, day.day, tzinfo=timezone.utc)
    return lo, lo + timedelta(days=1)


def _days(start: datetime, end: datetime) -> list[date]:
    first = start.astimezone(timezone.utc).date()
    last = (end.astimezone(timezone.utc) - timedelta(microseconds=1)).date()
    return [first + timedelta(days=i) for i in range((last - first).days + 1)]


def existing_partitions(conn: Connection) -> set[str]:
    rows = conn.execute(
        text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = 'invocations'"
        )
    )
    return {r[0] for r in rows}


def partition_days(conn: Connection) -> list[date]:
    """The days that have a partition, ascending (from the names ``invocations_YYYYMMDD``)."""
    days = []
    for name in existing_partitions(conn):
        suffix = name.removeprefix("invocations_")
        if len(suffix) == 8 and suffix.isdigit():
            days.append(datetime.strptime(suffix, "%Y%m%d").date())
    return sorted(days)


def create_partition_once(conn: Connection, name: str, ddl: str) -> None:
    """Run ``ddl`` (a ``CREATE TABLE IF NOT EXISTS "name" PARTITION OF ...``) holding a transaction-scoped advisory
    lock on ``name``. ``IF NOT EXISTS`` alone is not safe between two sessions creating the same table at once: both
    find it missing and the second fails with ``42P07`` (relation exists) or a unique violation in the catalogue,
    which turned two concurrent pushes of one new day into a refused request. With the lock the second waits for
    the first to commit, then finds the table.

    The DDL waits at most :data:`PARTITION_LOCK_TIMEOUT_S` for the parent's lock, then raises a DBAPIError with
    SQLSTATE 55P03 (:func:`is_lock_timeout`) and creates nothing."""
    conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended('prewarm.partition:' || :n, 0))"), {"n": name})
    set_partition_lock_timeout(conn)
    conn.execute(text(ddl))


def _partition_ddl(day: date) -> str:
    lo, hi = day_bounds(day)
    return (f'CREATE TABLE IF NOT EXISTS "{partition_name(day)}" PARTITION OF invocations '
            f"FOR VALUES FROM ('{lo.isoformat()}') TO ('{hi.isoformat()}')")


def create_missing_partitions(conn: Connection, days: list[date]) -> list[str]:
    """Create, inside the caller's transaction, the partitions of ``days`` that do not exist; return their names.

    A writer calls this after taking its days' shared locks
    (:func:`forecaster.store.retention.lock_days_for_write`): a day that retention dropped after
    :func:`ensure_partitions` found it is then created again instead of failing the COPY ("no partition of
    relation invocations found for row"). Only in that race does it cost more than one catalogue query: the
    DDL holds the parent's exclusive lock until the writer commits.
    """
    names = {partition_name(day): day for day in days}
    missing = conn.execute(
        text("SELECT n FROM unnest(CAST(:names AS text[])) AS n WHERE to_regclass(quote_ident(n)) IS NULL ORDER BY n"),
        {"names": list(names)},
    ).scalars().all()
    if missing:
        previous = conn.execute(text("SELECT current_setting('lock_timeout')")).scalar_one()
        for name in missing:
            create_partition_once(conn, name, _partition_ddl(names[name]))
        conn.execute(text("SELECT set_config('lock_timeout', :v, true)"), {"v": previous})  # the caller's again
    return list(missing)


def ensure_partitions(engine: Engine, start: datetime, end: datetime, *, skip_locked: bool = False) -> list[str]:
    """Create the daily partitions covering ``[start, end)``; return the names created.

    Each partition is created in its own short transaction; an empty partition
    is harmless, so a batch that later fails leaves no partial data behind.
    A day whose parent lock is not had within :data:`PARTITION_LOCK_TIMEOUT_S`
    raises (a writer needs its partition), or with ``skip_locked`` is logged
    and left for the next run (the maintenance job, which works days ahead).
    """
    if end <= start:
        return []
    with engine.connect() as conn:
        present = existing_partitions(conn)
    created = []
    for day in _days(start, end):
        name = partition_name(day)
        if name in present:
            continue
        try:
            with engine.begin() as conn:  # a concurrent ingest may be creating it too
                create_partition_once(conn, name, _partition_ddl(day))
        except DBAPIError as exc:
            if not (skip_locked and is_lock_timeout(exc)):
                raise
            log.warning("partition %s not created: a long transaction holds invocations for more than %.0f s "
                        "(PARTITION_LOCK_TIMEOUT_S); the next run tries again", name, PARTITION_LOCK_TIMEOUT_S)
            continue
        created.append(name)
    return created


def maintain_partitions(engine: Engine, *, now: datetime, days_ahead: int) -> list[str]:
    """Create partitions from today through ``days_ahead`` days ahead of ``now``; a day whose lock is not had in
    time is skipped with a warning (see :data:`PARTITION_LOCK_TIMEOUT_S`) and tried again next run."""
    today = datetime(now.year, now.month, now.day, tzinfo=timezone.utc)
    return ensure_partitions(engine, today, today + timedelta(days=days_ahead + 1), skip_locked=True)
