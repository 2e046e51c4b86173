"""Index helpers shared by the migrations (``from migrations.indexes import create_index_if_not_exists``).

Several migrations tell operators to build their indexes ``CONCURRENTLY`` by hand first on a large table, under
the same names, so that the migration's ``CREATE INDEX IF NOT EXISTS`` has nothing left to do. A concurrent build
that fails or is cancelled (a statement timeout, a duplicate key, Ctrl-C) leaves an INVALID index of that name:
the planner never uses it, yet every write still maintains it, and ``IF NOT EXISTS`` skipped it, so the upgrade
reported success and the index the migration promised never existed. :func:`create_index_if_not_exists` drops an
invalid index of that name first.

This module is imported by released migrations: change what it does only in ways every one of them can live with.
"""

from __future__ import annotations

import logging
import re

from alembic import op
from sqlalchemy import text

log = logging.getLogger(__name__)


def drop_invalid_index(name: str) -> bool:
    """Drop the index ``name`` (looked up like ``CREATE INDEX`` does, through the search path) if it is INVALID.

    Returns:
        True when it dropped one.

    Raises:
        RuntimeError: the index is being built ``CONCURRENTLY`` right now (it is invalid until that build ends):
            the migration cannot know what it will become, and dropping it would undo the operator's build.
    """
    conn = op.get_bind()
    row = conn.execute(text(
        "SELECT i.indisvalid, i.indexrelid::regclass::text AS qualified, "
        "  (SELECT p.pid FROM pg_stat_progress_create_index p WHERE p.index_relid = i.indexrelid LIMIT 1) AS builder "
        "FROM pg_index i WHERE i.indexrelid = to_regclass(quote_ident(:name))"), {"name": name}).one_or_none()
    if row is None or row.indisvalid:
        return False
    if row.builder is not None:
        raise RuntimeError(f"index {name} is being built CONCURRENTLY right now (database pid {row.builder}); "
                           f"let that build finish (or cancel it), then upgrade again")
    log.warning("index %s is INVALID (a failed or cancelled CREATE INDEX CONCURRENTLY left it): dropping it to "
                "build it again", row.qualified)
    conn.execute(text(f"DROP INDEX {row.qualified}"))
    return True


_CREATE = re.compile(r"\s*CREATE\s+(UNIQUE\s+)?INDEX\s+IF\s+NOT\s+EXISTS\s+(\w+)\s", re.IGNORECASE)


def create_index_if_not_exists(ddl: str) -> None:
    """Run ``ddl`` (a ``CREATE [UNIQUE] INDEX IF NOT EXISTS name ...``) after :func:`drop_invalid_index` of its name.

    A valid index of that name is kept, as ``IF NOT EXISTS`` always did (the operator's hand-built one).
    """
    match = _CREATE.match(ddl)
    if match is None:
        raise ValueError(f"not a CREATE INDEX IF NOT EXISTS statement: {ddl[:80]!r}")
    drop_invalid_index(match.group(2))
    op.execute(ddl)
