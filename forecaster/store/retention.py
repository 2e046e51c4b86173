"""Retention of ``invocations``: old days are rolled up to coarser steps, the oldest dropped.

Ages count whole UTC days before the day of ``now`` (settings in brackets):

* younger than ``invocations_minute_days`` (7): rows as ingested, per minute;
* younger than ``invocations_5min_days`` (35): 5-minute buckets (300 s);
* younger than ``invocations_retention_days`` (400): hourly buckets (3600 s);
* older: the day's partition and its coverage are gone.

With ``now`` on day D and ``invocations_minute_days = 7`` the days D-7 .. D keep
minutes, so any read of the last 7 x 1440 minutes (the nightly retrain's
window) never meets a rolled-up day.

A rolled-up row keeps the column name ``minute`` but stands for a whole bucket
starting there, like 5-minute data ingested at step 300. What a step means is
carried by ``coverage``: the roll-up moves the day's coverage from every finer
step to the bucket step, snapped *inward*, so that
:func:`forecaster.store.invocations.read_counts` at the bucket step sees the
same known buckets as before, and at a finer step sees the day as unknown
(NaN), never as made-up zeros. A bucket only partly covered before keeps its
summed count in the table (totals never change) but is not covered after, so
reads say unknown there.

Each day is one transaction, recorded in ``rollups``. Ingest and roll-up of the
same day are serialised by an advisory lock per day (exclusive here, shared in
:func:`forecaster.store.invocations.write_count_batch`), and ingest refuses a
batch finer than the step a day now keeps (``IngestError("rolled_up")``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone

from sqlalchemy import Connection, Engine, text

from forecaster.settings import Settings
from forecaster.store.partitions import day_bounds, partition_days, partition_name

log = logging.getLogger(__name__)

#: Steps a day can be rolled up to: whole minutes that tile a UTC day exactly.
ROLLUP_STEPS_SECONDS = (300, 3600)
#: First key of the two-key advisory lock on one invocation day (ASCII "prwd").
DAY_LOCK_CLASS = 0x70727764
#: How long the partition swap may wait for readers of ``invocations`` to finish
#: before the day's transaction gives up (and the next run retries the day).
SWAP_LOCK_TIMEOUT_S = 30
#: Memory for the day's hash aggregate and primary-key build (per transaction, not per server).
ROLLUP_WORK_MEM = "256MB"
ROLLUP_MAINTENANCE_WORK_MEM = "512MB"
#: Bucket origin: UTC midnight, so 300 s and 3600 s buckets tile each day.
_ORIGIN_SQL = "TIMESTAMPTZ '2000-01-01 00:00:00+00'"


@dataclass(frozen=True)
class RollupResult:
    """What :func:`rollup_day` did to one day.

    Attributes:
        day: the UTC day.
        step_seconds: the bucket width the day holds now.
        rows_before: ``invocations`` rows of the day before (0 when skipped).
        rows_after: rows after (one per model and non-empty bucket).
        coverage_rows: fine-step coverage rows whose part inside the day moved.
        skipped: the day already held ``step_seconds`` or coarser; nothing changed.
    """

    day: date
    step_seconds: int
    rows_before: int
    rows_after: int
    coverage_rows: int
    skipped: bool = False


def day_lock_key(day: date) -> int:
    """Second advisory-lock key of ``day``: days since 1970-01-01 (fits int4)."""
    return (day - date(1970, 1, 1)).days


def lock_days_for_write(conn: Connection, days: list[date]) -> None:
    """Take the shared per-day locks an ingest transaction holds while it writes ``days``.

    Taken in ascending day order, so two writers never wait on each other; a
    roll-up or drop of one of the days waits for the writer to commit, and a
    writer that comes second sees the committed ``rollups`` row.
    """
    keys = sorted({day_lock_key(d) for d in days})
    if keys:
        conn.execute(
            text("SELECT count(pg_advisory_xact_lock_shared(:cls, d)) FROM unnest(CAST(:keys AS int[])) AS d"),
            {"cls": DAY_LOCK_CLASS, "keys": keys},
        )


def last_rolled_up_day(engine: Engine) -> date | None:
    """The newest day rolled up to a step coarser than a minute (None: none). Per-minute counts of a rolled-up
    day are refused (``IngestError("rolled_up")``) and days roll up oldest first, so a writer that goes back in
    time (the Prometheus catch-up) starts after this day."""
    with engine.connect() as conn:
        return conn.execute(text("SELECT max(day) FROM rollups WHERE step_seconds > 60")).scalar()


def rolled_up_steps(conn: Connection, days: list[date]) -> dict[date, int]:
    """Bucket width (seconds) of each of ``days`` that has been rolled up."""
    if not days:
        return {}
    rows = conn.execute(
        text("SELECT day, step_seconds FROM rollups WHERE day = ANY(CAST(:days AS date[]))"), {"days": list(days)}
    )
    return {r[0]: int(r[1]) for r in rows}


def _lock_day(conn: Connection, day: date) -> None:
    conn.execute(text("SELECT pg_advisory_xact_lock(:cls, :key)"), {"cls": DAY_LOCK_CLASS, "key": day_lock_key(day)})


def _partition_exists(conn: Connection, name: str) -> bool:
    return conn.execute(text("SELECT to_regclass(:n) IS NOT NULL"), {"n": f'"{name}"'}).scalar_one()


def _build_rollup_table(conn: Connection, name: str, staging: str, lo: datetime, hi: datetime,
                        step_seconds: int) -> tuple[int, int]:
    """Create ``staging`` holding the day's counts summed per model and bucket; return (rows before, after).

    One scan of the old partition feeds both the insert and the row counts
    (materialised CTE). The primary key is built after the load (one sorted
    build instead of one index insert per row), and a CHECK on the day's bounds
    lets ATTACH PARTITION skip its validation scan.
    """
    conn.execute(text(f'CREATE TABLE "{staging}" (LIKE invocations INCLUDING DEFAULTS INCLUDING CONSTRAINTS)'))
    counts = conn.execute(
        text(
            f"WITH buckets AS MATERIALIZED ("
            f"  SELECT model_id, date_bin(CAST(:step AS interval), minute, {_ORIGIN_SQL}) AS bucket, "
            f"         sum(count)::bigint AS count, count(*) AS rows_before "
            f'  FROM "{name}" GROUP BY 1, 2'
            f"), copied AS ("
            f'  INSERT INTO "{staging}" (model_id, minute, count) SELECT model_id, bucket, count FROM buckets'
            f") SELECT coalesce(sum(rows_before), 0)::bigint, count(*) FROM buckets"
        ),
        {"step": timedelta(seconds=step_seconds)},
    ).one()
    conn.execute(text(f'ALTER TABLE "{staging}" ADD CONSTRAINT "{staging}_pkey" PRIMARY KEY (model_id, minute)'))
    conn.execute(
        text(f'ALTER TABLE "{staging}" ADD CONSTRAINT "{staging}_bounds" '
             f"CHECK (minute >= '{lo.isoformat()}' AND minute < '{hi.isoformat()}')")
    )
    conn.execute(text(f'ANALYZE "{staging}"'))
    return int(counts[0]), int(counts[1])


def _move_coverage(conn: Connection, lo: datetime, hi: datetime, step_seconds: int) -> int:
    """Move every finer-step coverage inside ``[lo, hi)`` to ``step_seconds``, snapped inward.

    Per (model, source) the finer steps' ranges inside the day are merged, each
    range shrunk to whole buckets, and added to that source's row at the bucket
    step; the finer rows lose the day (and are deleted when nothing is left).

    Returns:
        The number of finer-step coverage rows that changed.
    """
    day = {"lo": lo, "hi": hi, "step": step_seconds, "step_interval": timedelta(seconds=step_seconds)}
    day_range = "tstzrange(:lo, :hi, '[)')"
    # Lock the rows in key order first: ingest upserts coverage in model order too, so no deadlock cycle.
    touched = conn.execute(
        text(f"SELECT count(*) FROM (SELECT 1 FROM coverage WHERE step_seconds < :step AND ranges && {day_range} "
             "ORDER BY model_id, source, step_seconds FOR UPDATE) AS locked"),
        day,
    ).scalar_one()
    if not touched:
        return 0
    conn.execute(
        text(
            "WITH inside AS ("
            "  SELECT c.model_id, c.source, range_agg(r) AS ranges"
            f"  FROM coverage c, unnest(c.ranges * tstzmultirange({day_range})) AS r"
            f"  WHERE c.step_seconds < :step AND c.ranges && {day_range}"
            "  GROUP BY c.model_id, c.source"
            "), snapped AS ("
            "  SELECT i.model_id, i.source, range_agg(tstzrange(b.lo, b.hi, '[)')) AS ranges"
            "  FROM inside i, unnest(i.ranges) AS r, LATERAL ("
            f"    SELECT date_bin(:step_interval, lower(r) + :step_interval - interval '1 microsecond', {_ORIGIN_SQL})"
            f"           AS lo, date_bin(:step_interval, upper(r), {_ORIGIN_SQL}) AS hi"
            "  ) AS b WHERE b.lo < b.hi"
            "  GROUP BY i.model_id, i.source"
            ") INSERT INTO coverage (model_id, source, step_seconds, ranges) "
            "SELECT model_id, source, :step, ranges FROM snapped "
            "ON CONFLICT (model_id, source, step_seconds) DO UPDATE "
            "SET ranges = coverage.ranges + EXCLUDED.ranges, updated_at = now()"
        ),
        day,
    )
    _remove_from_coverage(conn, lo, hi, finer_than_seconds=step_seconds)
    return int(touched)


def _remove_from_coverage(conn: Connection, lo: datetime, hi: datetime, *, finer_than_seconds: int | None) -> int:
    """Cut ``[lo, hi)`` out of coverage (of steps finer than ``finer_than_seconds``, or all); return rows changed."""
    params = {"lo": lo, "hi": hi, "step": finer_than_seconds}
    steps = "" if finer_than_seconds is None else "step_seconds < :step AND "
    deleted = conn.execute(
        text(f"DELETE FROM coverage WHERE {steps}ranges <@ tstzrange(:lo, :hi, '[)')"), params
    ).rowcount
    updated = conn.execute(
        text(f"UPDATE coverage SET ranges = ranges - tstzmultirange(tstzrange(:lo, :hi, '[)')), updated_at = now() "
             f"WHERE {steps}ranges && tstzrange(:lo, :hi, '[)')"),
        params,
    ).rowcount
    return deleted + updated


def _swap_partition(conn: Connection, name: str, staging: str, lo: datetime, hi: datetime) -> None:
    """Replace partition ``name`` by ``staging``: drop, rename, attach. Catalog work only.

    The foreign key is added (and validated) before the old partition is
    dropped, so ATTACH finds an equal constraint and takes it over instead of
    validating under the ACCESS EXCLUSIVE lock that dropping a partition takes
    on ``invocations``; the bounds CHECK lets ATTACH skip its scan. The lock is
    therefore held from here to commit only, a few milliseconds, and waits at
    most :data:`SWAP_LOCK_TIMEOUT_S` for running reads.
    """
    conn.execute(
        text(f'ALTER TABLE "{staging}" ADD CONSTRAINT invocations_model_id_fkey FOREIGN KEY (model_id) '
             "REFERENCES serving_models (id) ON DELETE CASCADE")
    )
    conn.execute(text(f"SET LOCAL lock_timeout = '{int(SWAP_LOCK_TIMEOUT_S * 1000)}ms'"))
    conn.execute(text(f'DROP TABLE "{name}"'))
    conn.execute(text(f'ALTER TABLE "{staging}" RENAME TO "{name}"'))
    conn.execute(text(f'ALTER TABLE "{name}" RENAME CONSTRAINT "{staging}_pkey" TO "{name}_pkey"'))
    conn.execute(
        text(f'ALTER TABLE invocations ATTACH PARTITION "{name}" '
             f"FOR VALUES FROM ('{lo.isoformat()}') TO ('{hi.isoformat()}')")
    )
    conn.execute(text(f'ALTER TABLE "{name}" DROP CONSTRAINT "{staging}_bounds"'))


def _record_rollup(conn: Connection, day: date, step_seconds: int, rows_before: int, rows_after: int) -> None:
    conn.execute(
        text("INSERT INTO rollups (day, step_seconds, rolled_at, rows_before, rows_after) "
             "VALUES (:day, :step, now(), :before, :after) ON CONFLICT (day) DO UPDATE SET "
             "step_seconds = EXCLUDED.step_seconds, rolled_at = EXCLUDED.rolled_at, "
             "rows_before = EXCLUDED.rows_before, rows_after = EXCLUDED.rows_after"),
        {"day": day, "step": step_seconds, "before": rows_before, "after": rows_after},
    )


def rollup_day(engine: Engine, day: date, step_seconds: int) -> RollupResult:
    """Turn the whole ``invocations`` partition of ``day`` into ``step_seconds`` buckets, atomically.

    How: in ONE transaction, build a new table with the counts summed per
    model and bucket start (one scan + hash aggregate of the old partition),
    give it its primary key, move the day's coverage to the bucket step, record
    the day in ``rollups``, then drop the old partition and attach the new
    table in its place.

    Why a table swap rather than DELETE + INSERT inside the partition: at ~25
    million minute rows per day (100,000 models), DELETE writes 25 million dead
    tuples and WAL records and updates the primary-key index row by row, and
    the partition stays bloated until a VACUUM; the swap reads the old
    partition once, writes only the new rows (at most 288 or 24 per model),
    builds the index in one sorted pass, and frees the old files at commit by
    unlinking them. Readers keep reading the old day while the new table is
    built; only the final swap, catalog work alone, takes an exclusive lock on
    ``invocations`` (measured: 5 million minute rows roll up in ~8 s, of which
    the swap including the foreign-key check is 0.16 s). Writers of this one day wait (a
    SHARE lock and the day's advisory lock) so that no count is lost between
    the aggregate and the swap.

    Args:
        engine: the store.
        day: the UTC day.
        step_seconds: 300 or 3600; a multiple of the step the day already holds.

    Returns:
        What was done; ``skipped`` when the day already holds this step or a
        coarser one (re-running is a no-op).

    Raises:
        ValueError: for a step that is not 300 or 3600, or does not refine to it.
    """
    if step_seconds not in ROLLUP_STEPS_SECONDS:
        raise ValueError(f"step_seconds must be one of {ROLLUP_STEPS_SECONDS}, got {step_seconds}")
    name = partition_name(day)
    staging = f"{name}_rollup"
    lo, hi = day_bounds(day)
    with engine.begin() as conn:
        conn.execute(text(f"SET LOCAL work_mem = '{ROLLUP_WORK_MEM}'"))
        conn.execute(text(f"SET LOCAL maintenance_work_mem = '{ROLLUP_MAINTENANCE_WORK_MEM}'"))
        _lock_day(conn, day)
        current = rolled_up_steps(conn, [day]).get(day)
        if current is not None and current >= step_seconds:
            return RollupResult(day, current, 0, 0, 0, skipped=True)
        if current is not None and step_seconds % current:
            raise ValueError(f"day {day} holds {current} s buckets; {step_seconds} s is not a multiple of it")
        rows_before = rows_after = 0
        has_partition = _partition_exists(conn, name)
        if has_partition:
            # Writers of this day (outside write_count_batch too) wait until commit; readers do not.
            conn.execute(text(f'LOCK TABLE "{name}" IN SHARE MODE'))
            has_rows = conn.execute(text(f'SELECT EXISTS (SELECT 1 FROM "{name}")')).scalar_one()
            if has_rows:
                rows_before, rows_after = _build_rollup_table(conn, name, staging, lo, hi, step_seconds)
        coverage_rows = _move_coverage(conn, lo, hi, step_seconds)
        _record_rollup(conn, day, step_seconds, rows_before, rows_after)
        if rows_before:
            _swap_partition(conn, name, staging, lo, hi)
    log.info("rolled up %s to %d s: %d rows -> %d, %d coverage rows moved",
             day, step_seconds, rows_before, rows_after, coverage_rows)
    return RollupResult(day, step_seconds, rows_before, rows_after, coverage_rows)


def drop_day(engine: Engine, day: date) -> dict[str, object]:
    """Drop the partition of ``day`` and cut the day out of every coverage row, in one transaction.

    Returns:
        ``{"day", "partition_dropped" (bool), "coverage_rows" (rows changed)}``;
        both falsy when the day was already gone.
    """
    name = partition_name(day)
    lo, hi = day_bounds(day)
    with engine.begin() as conn:
        _lock_day(conn, day)
        existed = _partition_exists(conn, name)
        if existed:
            conn.execute(text(f"SET LOCAL lock_timeout = '{int(SWAP_LOCK_TIMEOUT_S * 1000)}ms'"))
            conn.execute(text(f'DROP TABLE "{name}"'))
            conn.execute(text("SET LOCAL lock_timeout = 0"))
        coverage_rows = _remove_from_coverage(conn, lo, hi, finer_than_seconds=None)
        conn.execute(text("DELETE FROM rollups WHERE day = :day"), {"day": day})
    return {"day": day.isoformat(), "partition_dropped": existed, "coverage_rows": coverage_rows}


def _trim_coverage_before(engine: Engine, cutoff: datetime, source: str | None = None) -> int:
    """Cut everything before ``cutoff`` out of coverage (days whose partition is already gone).

    With ``source`` only that source's coverage is cut (each source ages from its own newest data).
    """
    only = "" if source is None else " AND source = :source"
    with engine.begin() as conn:
        deleted = conn.execute(
            text(f"DELETE FROM coverage WHERE upper(ranges) <= :cutoff{only}"), {"cutoff": cutoff, "source": source}
        ).rowcount
        updated = conn.execute(
            text("UPDATE coverage SET ranges = ranges - tstzmultirange(tstzrange(NULL, :cutoff)), updated_at = now() "
                 f"WHERE ranges && tstzrange(NULL, :cutoff){only}"),
            {"cutoff": cutoff, "source": source},
        ).rowcount
    return deleted + updated


def retention_plan(now: datetime, settings: Settings) -> tuple[date, date, date]:
    """The first day kept at 60 s, at 300 s, and at all: ``(minute_from, five_min_from, keep_from)``."""
    today = now.astimezone(timezone.utc).date()
    return (today - timedelta(days=settings.invocations_minute_days),
            today - timedelta(days=settings.invocations_5min_days),
            today - timedelta(days=settings.invocations_retention_days))


def newest_data_by_source(engine: Engine) -> dict[str, datetime]:
    """Per coverage source, the end of the newest data it ingested (UTC)."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT source, max(upper(ranges)) FROM coverage GROUP BY source")).all()
    return {r[0]: r[1] for r in rows if r[1] is not None}


def _sources_by_day(engine: Engine, days: list[date]) -> dict[date, list[str]]:
    if not days:
        return {}
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT d.day, array_agg(DISTINCT c.source) FROM unnest(CAST(:days AS date[])) AS d(day) "
            "JOIN coverage c ON c.ranges && tstzrange(d.day::timestamp AT TIME ZONE 'UTC', "
            "(d.day + 1)::timestamp AT TIME ZONE 'UTC', '[)') GROUP BY d.day"), {"days": days}).all()
    return {r[0]: list(r[1]) for r in rows}


def retention_reference(now: datetime, day_sources: list[str], newest: dict[str, datetime]) -> datetime:
    """The moment a day's age is measured from: the newest data of the sources holding it, never after ``now``.

    Measured from the wall clock, a scheduler dropped imported traces older than
    400 days the first time it ran. A day is as old as the newest data of each
    source that covers it, the youngest of them counting: data of a source
    that stopped ingesting is never aged out by the mere passing of time. A
    day no coverage speaks for ages from the newest data of any source.
    """
    candidates = [newest[s] for s in day_sources if s in newest] or list(newest.values())
    if not candidates:
        return now
    return min(now, max(candidates))


def apply_retention(engine: Engine, *, now: datetime, settings: Settings) -> dict[str, int]:
    """Roll up and drop old invocation days according to ``settings``; idempotent.

    Ages are measured from :func:`retention_reference` (the newest data of the
    sources that hold the day, at most ``now``), not from the wall clock.
    Days before ``invocations_minute_days`` go to 300 s buckets, before
    ``invocations_5min_days`` to 3600 s (straight from minutes when the job
    was not running meanwhile), before ``invocations_retention_days`` are
    dropped; every drop is logged with the day, its sources and the reason.
    Every day is its own transaction: a failure leaves that day as it
    was and the other days done; the remaining days are still processed, then
    a RuntimeError naming the failed days is raised (the job is recorded as
    failed and the next run retries what is left).

    Returns:
        Counts per action: ``rolled_to_300s``, ``rolled_to_3600s`` and
        ``dropped`` (days), ``rows_before`` and ``rows_after`` (rows of the
        rolled days), ``coverage_rows_trimmed`` (coverage before the kept
        days that had no partition); all zero when there was nothing to do;
        ``dropped_days`` lists the dropped days (ISO dates).
    """
    with engine.connect() as conn:
        days = set(partition_days(conn))
        rolled = dict(conn.execute(text("SELECT day, step_seconds FROM rollups")).all())
    newest = newest_data_by_source(engine)
    wall_minute_from = retention_plan(now, settings)[0]
    candidates = sorted(d for d in days | set(rolled) if d < wall_minute_from)
    sources = _sources_by_day(engine, candidates)
    summary: dict = {"rolled_to_300s": 0, "rolled_to_3600s": 0, "dropped": 0, "rows_before": 0, "rows_after": 0,
                     "coverage_rows_trimmed": 0, "dropped_days": []}
    errors: list[str] = []
    first_error: Exception | None = None
    for day in candidates:
        reference = retention_reference(now, sources.get(day, []), newest)
        minute_from, five_min_from, keep_from = retention_plan(reference, settings)
        if day >= minute_from:
            continue
        try:
            if day < keep_from:
                log.warning("retention: dropping invocations of %s (sources %s): older than %d days before %s, the "
                            "newest data of its sources (PREWARM_INVOCATIONS_RETENTION_DAYS)", day,
                            sources.get(day, []) or "none", settings.invocations_retention_days, reference.isoformat())
                drop_day(engine, day)
                summary["dropped"] += 1
                summary["dropped_days"].append(day.isoformat())
                continue
            target = 3600 if day < five_min_from else 300
            if rolled.get(day, 60) >= target:
                continue
            result = rollup_day(engine, day, target)
            if not result.skipped:
                summary[f"rolled_to_{target}s"] += 1
                summary["rows_before"] += result.rows_before
                summary["rows_after"] += result.rows_after
        except Exception as exc:  # noqa: BLE001 - one bad day must not stop the others; raised below
            log.exception("retention of %s failed", day)
            errors.append(f"{day}: {type(exc).__name__}: {exc}")
            first_error = first_error or exc
    if first_error is not None:
        raise RuntimeError(f"retention failed for {len(errors)} day(s): {'; '.join(errors)}") from first_error
    for source, end in sorted(newest.items()):
        keep_from = retention_plan(min(now, end), settings)[2]
        trimmed = _trim_coverage_before(engine, day_bounds(keep_from)[0], source)
        if trimmed:
            log.warning("retention: cut coverage of source %s before %s (%d rows): older than %d days before its "
                        "newest data %s", source, keep_from, trimmed, settings.invocations_retention_days,
                        min(now, end).isoformat())
        summary["coverage_rows_trimmed"] += trimmed
    return summary
