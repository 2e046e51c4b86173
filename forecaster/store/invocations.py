"""Writing and reading per-model invocation counts.

Writes are *window replacements*: a batch deletes what the store held for its
models inside its windows, copies its non-zero counts in with PostgreSQL
``COPY``, merges the windows into the coverage multiranges and records the
batch, all in one transaction. Ingesting the same data twice therefore never
double-counts, and a batch that fails leaves nothing behind.

Rows have no step column (a 300 s row sits at its bucket's start); ``coverage``
says which step width a stretch holds. A window over data of another step
width replaces that data in whole buckets of it: the rest of a bucket the
window cuts is deleted and becomes unknown, and the other width's coverage
loses the window, so a stretch of a model is covered at one step width only
and no read adds a bucket's count to the minutes inside it.

Reads return a complete grid: a step inside some source's coverage has its
count (zero when no row was stored); a step outside all coverage is ``NaN``
(unknown).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime

import numpy as np
import pandas as pd
from sqlalchemy import Connection, Engine, text

from forecaster.contracts.batches import CountBatch, IngestError
from forecaster.store.catalog import missing_model_ids, register_missing
from forecaster.store.db import driver_errors
from forecaster.store.partitions import create_missing_partitions, ensure_partitions
from forecaster.store.retention import lock_days_for_write, rolled_up_steps


@dataclass(frozen=True)
class WriteResult:
    """What one batch did to the store."""

    batch_id: int | None
    duplicate: bool
    models: int
    rows_written: int
    invocations: int
    covered_steps: int
    #: Stored non-zero steps inside the batch's windows that the batch left out, so that they are zeros now
    #: (counted only when the writer asked, see ``report_zeroed``), and the invocations they held.
    zeroed_steps: int = 0
    zeroed_invocations: int = 0
    warnings: tuple[str, ...] = ()
    #: Models whose burst factor the catalogue now holds as measured by this batch's source (a per-request trace,
    #: or 10-second peaks from Prometheus or a push).
    burst_factors_stored: int = 0

    def as_dict(self) -> dict[str, object]:
        out = dict(self.__dict__)
        out["warnings"] = list(self.warnings)
        return out


def batch_fingerprint(batch: CountBatch) -> str:
    """sha256 over source, step, windows and counts, independent of row order."""
    digest = hashlib.sha256()
    digest.update(f"{batch.source}\n{batch.step_seconds}\n".encode())
    windows = batch.windows.sort_values("unique_id")
    counts = batch.counts.sort_values(["unique_id", "ds"])
    for frame in (windows, counts):
        digest.update(pd.util.hash_pandas_object(frame, index=False).to_numpy().tobytes())
    return digest.hexdigest()


def _copy_counts(conn: Connection, counts: pd.DataFrame) -> None:
    """Stream counts into ``invocations`` with COPY (CSV format, tab-separated).

    CSV, not COPY's text format: pandas quotes a field CSV's way, and in text format a backslash is an escape, so
    a model id holding ``\\`` or ``"`` was stored under another id (``gpu\\x31`` as ``gpu1``) or refused."""
    if counts.empty:
        return
    raw = conn.connection.driver_connection  # psycopg.Connection
    statement = "COPY invocations (model_id, minute, count) FROM STDIN (FORMAT csv, DELIMITER E'\\t')"
    with driver_errors(conn, statement), raw.cursor() as cur, cur.copy(statement) as copy:
        # in pieces: the text of a whole batch at once (and its fixed-width minute strings) took several times
        # the batch's size in memory
        for first in range(0, len(counts), COPY_CHUNK_ROWS):
            part = counts.iloc[first:first + COPY_CHUNK_ROWS]
            buffer = io.StringIO()
            pd.DataFrame(
                {
                    "model_id": part["unique_id"].to_numpy(),
                    "minute": np.char.add(
                        np.datetime_as_string(part["ds"].dt.tz_convert(None).to_numpy(), unit="s"), "+00:00"
                    ),
                    "count": part["y"].to_numpy(),
                }
            ).to_csv(buffer, sep="\t", header=False, index=False)
            copy.write(buffer.getvalue())


#: Rows of counts per piece of :func:`_copy_counts`' COPY (one COPY, one transaction).
COPY_CHUNK_ROWS = 50_000


def _window_arrays(batch: CountBatch) -> dict[str, list]:
    w = batch.windows
    return {
        "ids": w["unique_id"].astype(str).tolist(),
        "starts": [t.to_pydatetime() for t in w["start"]],
        "ends": [t.to_pydatetime() for t in w["end"]],
    }


def _window_days(batch: CountBatch) -> list[date]:
    """The UTC days any of the batch's windows touches, ascending."""
    w = batch.windows
    spans = pd.DataFrame({"first": w["start"].dt.floor("D"),
                          "last": (w["end"] - pd.Timedelta(microseconds=1)).dt.floor("D")}).drop_duplicates()
    days: set[date] = set()
    for first, last in spans.itertuples(index=False):
        days.update(d.date() for d in pd.date_range(first, last, freq="D"))
    return sorted(days)


def _still_stored(conn: Connection, batch: CountBatch, arrays: dict[str, list]) -> bool:
    """Whether the store holds exactly ``batch`` inside its windows: its non-zero steps with their counts, and no
    other non-zero step. Then writing it again changes nothing, and it is answered as a duplicate.

    A batch whose content was written once is not enough: a later batch may have replaced those windows since,
    and a sender who re-sends the first (to undo a wrong push) must find it written, not skipped."""
    counts = batch.counts
    window = ("FROM invocations i JOIN unnest(CAST(:ids AS text[]), CAST(:starts AS timestamptz[]), "
              "CAST(:ends AS timestamptz[])) AS w(model_id, s, e) ON i.model_id = w.model_id "
              "AND i.minute >= w.s AND i.minute < w.e WHERE i.minute >= :lo AND i.minute < :hi AND i.count > 0")
    held = conn.execute(text(f"SELECT count(*) {window}"),
                        {**arrays, "lo": min(arrays["starts"]), "hi": max(arrays["ends"])}).scalar_one()
    if held != len(counts):
        return False
    if not len(counts):
        return True
    same = conn.execute(
        text("SELECT count(*) FROM unnest(CAST(:m AS text[]), CAST(:t AS timestamptz[]), CAST(:c AS bigint[])) "
             "AS n(model_id, minute, count) JOIN invocations i ON i.model_id = n.model_id AND i.minute = n.minute "
             "AND i.count = n.count WHERE i.minute >= :lo AND i.minute < :hi"),
        {"m": counts["unique_id"].astype(str).tolist(), "t": list(counts["ds"].dt.to_pydatetime()),
         "c": counts["y"].astype("int64").tolist(), "lo": min(arrays["starts"]), "hi": max(arrays["ends"])},
    ).scalar_one()
    return same == len(counts)


def _incompatible_rollups(conn: Connection, batch: CountBatch, days: list[date]) -> dict[date, int]:
    """The days of ``days`` rolled up to buckets that ``batch``'s steps are not whole multiples of, with their
    bucket width. A finer step cannot be stored there, and neither can a coarser one that cuts the day's buckets
    (420 s steps over 300 s buckets): a later roll-up would bin such steps into the wrong hour."""
    return {day: step for day, step in rolled_up_steps(conn, days).items() if batch.step_seconds % step}


def _touches_rollups(conn: Connection, batch: CountBatch) -> bool:
    """Whether a day of ``batch``'s windows is rolled up to buckets the batch's step does not fit (it cannot be
    written again there: a batch seen before stays answered as a duplicate)."""
    return bool(_incompatible_rollups(conn, batch, _window_days(batch)))


def _reject_finer_than_rollups(conn: Connection, batch: CountBatch) -> list[date]:
    """Refuse a batch whose step is not a whole multiple of the buckets a touched day was rolled up to (see
    forecaster.store.retention): finer than them, or coarser but cutting them. Returns the days it locked.

    Takes the days' shared locks first, so a roll-up or drop of one of them
    either finished before (and is seen here) or waits until this batch committed.
    """
    days = _window_days(batch)
    lock_days_for_write(conn, days)
    refused = _incompatible_rollups(conn, batch, days)
    if refused:
        day = min(refused)
        more = f" (and {len(refused) - 1} more days)" if len(refused) > 1 else ""
        what = ("is finer than the store keeps there" if batch.step_seconds < refused[day]
                else f"cuts its {refused[day]} s buckets")
        raise IngestError(
            "rolled_up",
            f"day {day.isoformat()}{more} is rolled up to {refused[day]} s steps; a batch at "
            f"step_seconds={batch.step_seconds} {what}. Send it at {refused[day]} s or a multiple of it",
            field="ds",
            value=day.isoformat(),
        )
    return days


def _other_step_spill(conn: Connection, batch: CountBatch, arrays: dict[str, list]) -> tuple[set[str], list[tuple]]:
    """Which of the batch's models hold data of another step width inside their windows, and where the windows
    cut buckets of it: ``(model, start, end)`` pieces outside the windows, each the rest of such a bucket.

    ``invocations`` has no step column: a 300 s row sits at its bucket's start, and only ``coverage`` says what
    step a stored stretch has. A window that starts inside a stored 300 s bucket would leave that bucket's row
    (its whole count) beside the new minutes (double counted), and a window that covers the bucket's start but
    not its end would delete the bucket's count while the rest of the bucket still reads as known (lost). So the
    whole buckets of another step that a window touches are replaced: the pieces outside the window are deleted
    and cut out of coverage (unknown from then on, never a wrong count). Buckets are aligned to the Unix epoch,
    as :func:`forecaster.ingest.validate.build_count_batch` aligns steps.
    """
    # Usually no model has another step width there: ask without sending the windows (binding 100,000 windows
    # costs more than the question), then only for the models that do.
    candidates = set(conn.execute(
        text("SELECT DISTINCT model_id FROM coverage WHERE step_seconds <> :step AND ranges && tstzrange(:lo, :hi)"),
        {"step": batch.step_seconds, "lo": min(arrays["starts"]), "hi": max(arrays["ends"])},
    ).scalars())
    keep = [i for i, m in enumerate(arrays["ids"]) if m in candidates]
    if not keep:
        return set(), []
    rows = conn.execute(
        text(
            "WITH w AS (SELECT model_id, tstzrange(s, e, '[)') AS r FROM unnest(CAST(:ids AS text[]), "
            "CAST(:starts AS timestamptz[]), CAST(:ends AS timestamptz[])) AS w(model_id, s, e)), "
            "hit AS (SELECT w.model_id, c.step_seconds, c.ranges * tstzmultirange(w.r) AS inside FROM w "
            "  JOIN coverage c ON c.model_id = w.model_id AND c.step_seconds <> :step AND c.ranges && w.r), "
            "buckets AS ("
            "  SELECT h.model_id, range_agg(tstzrange(date_bin(b.stride, lower(p), b.origin), "
            "    date_bin(b.stride, upper(p) - interval '1 microsecond', b.origin) + b.stride, '[)')) AS r"
            "  FROM hit h, unnest(h.inside) AS p, LATERAL (SELECT make_interval(secs => h.step_seconds) AS stride, "
            "    TIMESTAMPTZ '1970-01-01 00:00:00+00' AS origin) AS b"
            "  GROUP BY h.model_id"
            "), windows AS (SELECT model_id, range_agg(r) AS r FROM w WHERE model_id IN (SELECT model_id FROM hit) "
            "  GROUP BY model_id"
            ") SELECT b.model_id, lower(x), upper(x) FROM buckets b JOIN windows w USING (model_id) "
            "LEFT JOIN LATERAL unnest(b.r - w.r) AS x ON true ORDER BY 1, 2"
        ),
        {**{k: [v[i] for i in keep] for k, v in arrays.items()}, "step": batch.step_seconds},
    ).all()
    return {r[0] for r in rows}, [tuple(r) for r in rows if r[1] is not None]


def _cut_other_steps(conn: Connection, batch: CountBatch, arrays: dict[str, list], models: set[str],
                     spill: list[tuple]) -> int:
    """Cut the windows of ``models`` out of the coverage of every other step width (the batch's steps replace
    that data), and the spill pieces out of every coverage (their rows were deleted): a stretch of a model stays
    covered at one step width only, in whole buckets of it. Returns the coverage rows changed."""
    keep = [i for i, m in enumerate(arrays["ids"]) if m in models]
    params = {"ids": [arrays["ids"][i] for i in keep], "starts": [arrays["starts"][i] for i in keep],
              "ends": [arrays["ends"][i] for i in keep], "step": batch.step_seconds,
              "sp_ids": [p[0] for p in spill], "sp_lo": [p[1] for p in spill], "sp_hi": [p[2] for p in spill]}
    # the windows are cut from other steps only; the spill from every step (the batch's own included)
    cut = ("WITH pieces AS ("
           "  SELECT model_id, tstzrange(s, e, '[)') AS r, false AS spill FROM unnest(CAST(:ids AS text[]), "
           "  CAST(:starts AS timestamptz[]), CAST(:ends AS timestamptz[])) AS w(model_id, s, e)"
           "  UNION ALL SELECT model_id, tstzrange(s, e, '[)'), true FROM unnest(CAST(:sp_ids AS text[]), "
           "  CAST(:sp_lo AS timestamptz[]), CAST(:sp_hi AS timestamptz[])) AS p(model_id, s, e)"
           "), cut AS ("
           "  SELECT model_id, range_agg(r) AS all_r, coalesce(range_agg(r) FILTER (WHERE spill), '{}') AS spill_r "
           "  FROM pieces GROUP BY model_id"
           ") UPDATE coverage c SET ranges = c.ranges - CASE WHEN c.step_seconds = :step THEN cut.spill_r "
           "ELSE cut.all_r END, updated_at = now() FROM cut WHERE c.model_id = cut.model_id "
           "AND c.ranges && CASE WHEN c.step_seconds = :step THEN cut.spill_r ELSE cut.all_r END")
    # Lock the models' coverage rows in key order first, as the roll-up does (forecaster.store.retention), so that
    # cutting several rows of one model and the upsert after it never close a deadlock cycle with it.
    conn.execute(text("SELECT count(*) FROM (SELECT 1 FROM coverage WHERE model_id = ANY(CAST(:models AS text[])) "
                      "ORDER BY model_id, source, step_seconds FOR UPDATE) AS locked"), {"models": sorted(models)})
    changed = conn.execute(text(cut), params).rowcount
    if changed:
        conn.execute(text("DELETE FROM coverage WHERE model_id = ANY(CAST(:ids AS text[])) AND isempty(ranges)"),
                     {"ids": sorted(models)})
    return int(changed)


def _utc(moment) -> pd.Timestamp:
    """``moment`` as a UTC timestamp (a naive one is UTC already): flooring an aware one cuts its own zone's day."""
    stamp = pd.Timestamp(moment)
    return stamp if stamp.tzinfo is None else stamp.tz_convert("UTC")


def _spill_days(spill: list[tuple]) -> list[date]:
    """The UTC days the spill pieces touch (a bucket of a step that does not divide a day may reach another).

    The pieces come from the database in the session's TimeZone; floored there, a piece of UTC day 2026-11-28
    read in New York counted as 2026-11-27, and the write locked the wrong day against a concurrent roll-up.
    """
    days: set[date] = set()
    for _, lo, hi in spill:
        days.update(d.date() for d in pd.date_range(_utc(lo).floor("D"),
                                                    (_utc(hi) - pd.Timedelta(microseconds=1)).floor("D")))
    return sorted(days)


def _spill_warning(spill: list[tuple], invocations: int) -> str:
    models = sorted({p[0] for p in spill})
    model = models[0]
    first, last = min(p[1] for p in spill if p[0] == model), max(p[2] for p in spill if p[0] == model)
    more = f" and {len(models) - 1} more models" if len(models) > 1 else ""
    return (f"this batch's windows cut buckets stored at another step width; their parts outside the windows "
            f"({invocations} invocations) are unknown now: model {model!r} from {first.isoformat()} to "
            f"{last.isoformat()}{more}. Send those stretches again at the batch's step")


#: First key of the two-key advisory lock on a bucket of models (ASCII "prwm").
MODEL_LOCK_CLASS = 0x7072776D
#: Models hash into this many lock buckets: two writers of one model serialise, and a batch of 100,000
#: models takes at most this many locks (each one a slot in the shared lock table).
MODEL_LOCK_BUCKETS = 64


def _lock_models(conn: Connection, model_ids: list[str]) -> None:
    """Exclusive per-model-bucket advisory locks, in ascending order (so writers never deadlock).

    Two concurrent corrections of the same window used to both delete, both
    COPY, and the second died with a UniqueViolation (a 500); now the second
    waits, then deletes what the first wrote.
    """
    conn.execute(
        text("SELECT count(pg_advisory_xact_lock(:cls, b)) FROM ("
             "SELECT DISTINCT abs(hashtext(m)) % :n AS b FROM unnest(CAST(:ids AS text[])) AS m ORDER BY 1) AS l"),
        {"cls": MODEL_LOCK_CLASS, "n": MODEL_LOCK_BUCKETS, "ids": model_ids},
    )


def _zeroed_warning(zeroed: list[tuple[str, int, int, datetime, datetime]]) -> str:
    steps = sum(r[1] for r in zeroed)
    invocations = sum(r[2] for r in zeroed)
    model, n, _, first, last = max(zeroed, key=lambda r: r[1])
    more = f" and {len(zeroed) - 1} more models" if len(zeroed) > 1 else ""
    return (f"this batch covers {steps} stored non-zero steps ({invocations} invocations) that it leaves out, "
            f"so they are zeros now: model {model!r} {n} steps from {first.isoformat()} to {last.isoformat()}{more}. "
            "A batch covers each model from its first to its last minute; send every minute, or only the "
            "minutes you mean to correct in separate batches")


def write_count_batch(engine: Engine, batch: CountBatch, *, register_models: bool = False,
                      report_zeroed: bool = False, lock_timeout_s: float | None = None,
                      then: Callable[[Connection], int] | None = None) -> WriteResult:
    """Write one validated batch atomically; a batch the store still holds as it is (the same content written
    before, unchanged since in its windows) is a no-op.

    Args:
        engine: the store.
        batch: validated counts and coverage windows.
        register_models: add models missing from the catalogue instead of
            rejecting the batch.
        report_zeroed: count the stored non-zero steps the batch replaces
            with zeros (inside its windows, absent from its counts) and
            return a warning naming them (pushed batches: the sender sees
            it). Costs a join of the deleted rows with the batch's keys.
        lock_timeout_s: give up (SQLSTATE 55P03, lock_not_available) when
            another writer of the same days or models holds them longer than
            this; None waits as long as it takes.
        then: more writes that belong to the batch (burst factors from Prometheus' or pushed peaks), run in its
            transaction after the counts; it returns how many burst factors it stored. A batch seen before runs it
            too (the same counts may come again with peaks), so it must be idempotent, as the burst watermark
            makes it (:func:`forecaster.store.catalog.advance_burst_factors`).

    Raises:
        IngestError: ``unknown_model`` when a model is not registered and
            ``register_models`` is false; ``bad_step`` for steps that are not
            whole minutes; ``rolled_up`` when a window touches a day already
            rolled up to buckets the batch's step is not a multiple of
            (nothing is written).
    """
    if batch.step_seconds % 60:
        raise IngestError("bad_step", f"the store keeps whole-minute steps, got step_seconds={batch.step_seconds}")
    if batch.windows.empty:
        return WriteResult(None, False, 0, 0, 0, 0)
    fingerprint = batch_fingerprint(batch)
    arrays = _window_arrays(batch)
    ensure_partitions(engine, min(arrays["starts"]), max(arrays["ends"]))

    with engine.begin() as conn:
        if lock_timeout_s:
            conn.execute(text(f"SET LOCAL lock_timeout = '{max(1, int(lock_timeout_s * 1000))}ms'"))
        # Serialise writers of the same batch content; the second sees the first's row.
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:fp))"), {"fp": fingerprint})
        previous = conn.execute(
            text("SELECT id FROM ingest_batches WHERE content_sha256 = :fp"), {"fp": fingerprint}
        ).scalar()
        if previous is not None and (_still_stored(conn, batch, arrays) or _touches_rollups(conn, batch)):
            stored = int(then(conn)) if then is not None else 0
            return WriteResult(previous, True, len(arrays["ids"]), 0, batch.total_invocations, batch.covered_steps,
                               burst_factors_stored=stored)
        # Seen before, but a later write changed its windows since (an operator re-sending the batch that was
        # right, after a wrong one): written again, as any batch is, under a new ledger row (readers that cache
        # history follow the ledger's ids: the first row's id is behind their watermarks).
        if previous is not None:
            conn.execute(text("DELETE FROM ingest_batches WHERE id = :id"), {"id": previous})

        days = _reject_finer_than_rollups(conn, batch)
        # a day dropped by retention since ensure_partitions looked is created again (its drop cannot come now)
        create_missing_partitions(conn, days)
        _lock_models(conn, arrays["ids"])
        if register_models:
            register_missing(conn, arrays["ids"], labels={"registered_by": batch.source})
        missing = missing_model_ids(conn, arrays["ids"])
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise IngestError(
                "unknown_model",
                f"model {missing[0]!r}{more} not registered; register it first or enable "
                "PREWARM_AUTO_REGISTER_MODELS",
                field="unique_id",
                value=missing[0],
            )

        # Data of another step width inside the windows: replaced in whole buckets of it (see _other_step_spill).
        other_step_models, spill = _other_step_spill(conn, batch, arrays)
        spilled = 0
        if spill:
            lock_days_for_write(conn, _spill_days(spill))
            spilled = conn.execute(
                text("WITH d AS (DELETE FROM invocations i USING unnest(CAST(:ids AS text[]), "
                     "CAST(:los AS timestamptz[]), CAST(:his AS timestamptz[])) AS p(model_id, s, e) "
                     "WHERE i.model_id = p.model_id AND i.minute >= p.s AND i.minute < p.e "
                     "AND i.minute >= :lo AND i.minute < :hi RETURNING i.count) SELECT coalesce(sum(count), 0) FROM d"),
                {"ids": [p[0] for p in spill], "los": [p[1] for p in spill], "his": [p[2] for p in spill],
                 "lo": min(p[1] for p in spill), "hi": max(p[2] for p in spill)},
            ).scalar_one()
        if other_step_models:
            _cut_other_steps(conn, batch, arrays, other_step_models, spill)

        delete = (
            "DELETE FROM invocations i USING unnest(CAST(:ids AS text[]), CAST(:starts AS timestamptz[]), "
            "CAST(:ends AS timestamptz[])) AS w(model_id, s, e) "
            "WHERE i.model_id = w.model_id AND i.minute >= w.s AND i.minute < w.e "
            "AND i.minute >= :lo AND i.minute < :hi"
        )
        params = {**arrays, "lo": min(arrays["starts"]), "hi": max(arrays["ends"])}
        zeroed: list = []
        if report_zeroed:
            # The stored non-zero rows the delete removes are kept aside, and those the batch does not write again
            # are found after its COPY: the batch's keys sent as lists of Python datetimes and ids were, with the
            # whole COPY text, most of the peak memory of a large trace's write (bench/ingest.py --memory).
            conn.execute(text(f"CREATE TEMPORARY TABLE replaced_counts ON COMMIT DROP AS WITH d AS ({delete} "
                              "RETURNING i.model_id, i.minute, i.count) SELECT * FROM d WHERE d.count > 0"), params)
        else:
            conn.execute(text(delete), params)
        _copy_counts(conn, batch.counts)
        if report_zeroed:
            zeroed = conn.execute(
                text("SELECT d.model_id, count(*), sum(d.count), min(d.minute), max(d.minute) FROM replaced_counts d "
                     "WHERE NOT EXISTS (SELECT 1 FROM invocations i WHERE i.model_id = d.model_id "
                     "AND i.minute = d.minute) GROUP BY d.model_id ORDER BY d.model_id")
            ).all()
            conn.execute(text("DROP TABLE replaced_counts"))
        conn.execute(
            text(
                "INSERT INTO coverage (model_id, source, step_seconds, ranges) "
                "SELECT w.model_id, :source, :step, tstzmultirange(tstzrange(w.s, w.e, '[)')) "
                "FROM unnest(CAST(:ids AS text[]), CAST(:starts AS timestamptz[]), CAST(:ends AS timestamptz[])) "
                "AS w(model_id, s, e) "
                "ON CONFLICT (model_id, source, step_seconds) DO UPDATE "
                "SET ranges = coverage.ranges + EXCLUDED.ranges, updated_at = now()"
            ),
            {**arrays, "source": batch.source, "step": batch.step_seconds},
        )
        batch_id = conn.execute(
            text(
                "INSERT INTO ingest_batches (source, kind, content_sha256, models, rows_written, invocations, "
                "window_start, window_end) VALUES (:source, 'counts', :fp, :models, :rows, :inv, :lo, :hi) "
                "RETURNING id"
            ),
            {
                "source": batch.source,
                "fp": fingerprint,
                "models": len(arrays["ids"]),
                "rows": len(batch.counts),
                "inv": batch.total_invocations,
                # what the batch changed: a cut bucket of another step may begin before its windows
                "lo": min(arrays["starts"] + [p[1] for p in spill]),
                "hi": max(arrays["ends"] + [p[2] for p in spill]),
            },
        ).scalar_one()
        stored = int(then(conn)) if then is not None else 0
    return WriteResult(batch_id, False, len(arrays["ids"]), len(batch.counts), batch.total_invocations,
                       batch.covered_steps, zeroed_steps=int(sum(r[1] for r in zeroed)),
                       zeroed_invocations=int(sum(r[2] for r in zeroed)),
                       warnings=((_zeroed_warning(zeroed),) if zeroed else ())
                       + ((_spill_warning(spill, int(spilled)),) if spill else ()),
                       burst_factors_stored=stored)


#: Up to this many models, :func:`_count_cells` fetches rows instead of blocks of text.
FETCH_CELLS_MAX_MODELS = 16
#: Cells (model x step) per text block of :func:`_count_cells`: 2,048 models x a day of minutes, ~60 MB of text
#: at most (PostgreSQL's limit for one value is 1 GB); a longer window gets fewer models per block.
CELL_BLOCK_CELLS = 2048 * 1440


def _block_models(params: dict) -> int:
    """Models per text block for the window of ``params`` (at least one)."""
    n_steps = max(1, int((params["end"] - params["start"]).total_seconds()) // int(params["step"]))
    return max(1, CELL_BLOCK_CELLS // n_steps)


def _count_cells(conn: Connection, params: dict) -> np.ndarray:
    """Stored counts as ``(model index, step index, count)`` int64 rows, as blocks of text (a few models: fetched).

    Indexes are computed in SQL (model position in ``params["ids"]``, step
    number from ``start``), so that millions of rows need no Python objects;
    the text is parsed by pyarrow's CSV reader. At a one-minute step there is
    at most one row per model and step (the primary key), so the sum per step
    is only computed for coarser steps.
    """
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    raw = conn.connection.driver_connection
    if int(params["step"]) == 60:
        select = ("SELECT w.i - 1, extract(epoch FROM i.minute - %(start)s)::bigint / 60, i.count ")
        group = ""
    else:
        select = ("SELECT w.i - 1, floor(extract(epoch FROM i.minute - %(start)s) / %(step)s)::bigint AS step, "
                  "sum(i.count) ")
        group = " GROUP BY 1, 2"

    def query_from(group: str) -> str:
        return ("FROM invocations i JOIN unnest(%(ids)s::text[]) WITH ORDINALITY AS w(id, i) "
                f"ON w.id = i.model_id WHERE i.minute >= %(start)s AND i.minute < %(end)s{group}")

    bound = {k: params[k] for k in ("start", "end", "step", "ids")}
    if len(params["ids"]) <= FETCH_CELLS_MAX_MODELS:
        # a few models (the dashboard's series: a week is 10,080 rows of one model): COPY TO hands libpq one
        # message per row, which psycopg yields one by one (~5 us each); a binary fetch of the same rows is cheaper
        with raw.cursor(binary=True) as cur:
            cur.execute(select + query_from(group), bound)
            rows = cur.fetchall()
        return np.array(rows, dtype=np.int64).reshape(-1, 3)
    # Many models: the rows as tab-separated text, aggregated on the server into one text value per block of
    # models (_block_models: about CELL_BLOCK_CELLS cells each), streamed one block at a time. A COPY TO of the
    # same rows hands libpq one message per row, which psycopg yields one by one (~5-25 us each: 2.4-5.7 s of the
    # 100,000-model job's 15-minute re-read of 214,000 rows; a full read of 10,000 models x a day, 2 million rows,
    # took 4.7-5.7 s by COPY against 1.9-2.1 s this way).
    query = (f"SELECT string_agg(concat_ws(E'\\t', r, s, c), E'\\n') FROM ({select}{query_from(group)}) "
             f"AS cells(r, s, c) GROUP BY r / {_block_models(params)}")
    buffer = io.BytesIO()
    with raw.cursor() as cur:
        # reading every model joins ~100,000 ids to millions of rows: keep the hash join in memory
        cur.execute("SET LOCAL work_mem = '256MB'")
    with raw.cursor() as cur:
        for (block,) in cur.stream(query, bound):
            if block:
                buffer.write(block.encode())
                buffer.write(b"\n")
    if not buffer.tell():
        return np.empty((0, 3), dtype=np.int64)
    buffer.seek(0)
    table = pa_csv.read_csv(
        buffer, read_options=pa_csv.ReadOptions(column_names=["row", "step", "count"]),
        parse_options=pa_csv.ParseOptions(delimiter="\t"),
        convert_options=pa_csv.ConvertOptions(column_types={c: pa.int64() for c in ("row", "step", "count")}))
    return np.column_stack([table.column(c).to_numpy() for c in ("row", "step", "count")])


def read_counts(
    engine: Engine | Connection,
    model_ids: list[str],
    start: datetime,
    end: datetime,
    *,
    step_seconds: int = 60,
) -> pd.DataFrame:
    """Counts per model and step over ``[start, end)``, with unknown steps as NaN.

    A step is known when the union of the model's coverage, over every source
    whose step divides ``step_seconds``, contains the whole step. Reading
    5-minute data at a 1-minute step therefore yields NaN, never made-up zeros.

    Returns:
        Long frame ``unique_id, ds, y`` (float64; NaN = unknown), one row per
        model and step, sorted.
    """
    ids, grid_ds, grid = read_grid(engine, model_ids, start, end, step_seconds=step_seconds)
    return pd.DataFrame(
        {"unique_id": np.repeat(ids, len(grid_ds)),
         "ds": pd.to_datetime(np.tile(grid_ds.as_unit("ns").asi8, len(ids)), utc=True),
         "y": grid.reshape(-1)}
    )


def read_grid(
    engine: Engine | Connection,
    model_ids: list[str],
    start: datetime,
    end: datetime,
    *,
    step_seconds: int = 60,
) -> tuple[list[str], pd.DatetimeIndex, np.ndarray]:
    """The same counts as :func:`read_counts` as a ``(models x steps)`` float64 grid.

    At 100,000 models a long frame of every cell costs gigabytes of Python-side
    columns; the forecast job reads this grid (one float per cell) instead.

    Returns:
        ``(sorted model ids, step start times, grid)`` with NaN = unknown.
    """
    step = pd.Timedelta(seconds=step_seconds)
    start_ts, end_ts = pd.Timestamp(start).tz_convert("UTC"), pd.Timestamp(end).tz_convert("UTC")
    if start_ts.floor(step) != start_ts or end_ts.floor(step) != end_ts:
        raise ValueError(f"start and end must be aligned to {step_seconds} s")
    grid_ds = pd.date_range(start_ts, end_ts, freq=step, inclusive="left")
    ids = sorted(set(model_ids))
    if not ids or not len(grid_ds):
        return ids, grid_ds, np.full((len(ids), len(grid_ds)), np.nan)
    params = {
        "ids": ids,
        "step": step_seconds,
        "start": start_ts.to_pydatetime(),
        "end": end_ts.to_pydatetime(),
        "interval": step.to_pytimedelta(),
    }
    coverage_sql = text(
        "SELECT model_id, lower(r), upper(r) FROM ("
        "  SELECT model_id, unnest(range_agg(ranges)) AS r FROM coverage"
        "  WHERE model_id = ANY(CAST(:ids AS text[])) AND :step % step_seconds = 0 GROUP BY model_id"
        ") AS merged WHERE r && tstzrange(:start, :end, '[)')"
    )
    if isinstance(engine, Connection):
        ranges = engine.execute(coverage_sql, params).all()
        with driver_errors(engine, "read invocations (raw cursor)"):
            cells = _count_cells(engine, params)
    else:
        with engine.connect() as conn:
            ranges = conn.execute(coverage_sql, params).all()
            with driver_errors(conn, "read invocations (raw cursor)"):
                cells = _count_cells(conn, params)

    # Fill a (model x step) grid: NaN unknown, 0 inside coverage, then the stored counts.
    position = {model_id: i for i, model_id in enumerate(ids)}
    n_steps = len(grid_ds)
    grid = np.full((len(ids), n_steps), np.nan)
    step_s = float(step_seconds)
    origin = start_ts.timestamp()
    for model_id, lower, upper in ranges:
        lo = 0 if lower is None else max(0, int(np.ceil((lower.timestamp() - origin) / step_s)))
        hi = n_steps if upper is None else min(n_steps, int(np.floor((upper.timestamp() - origin) / step_s)))
        if hi > lo:
            grid[position[model_id], lo:hi] = 0.0
    if len(cells):
        row_idx, col_idx, values = cells[:, 0], cells[:, 1], cells[:, 2].astype(np.float64)
        known = ~np.isnan(grid[row_idx, col_idx])  # a count in a partly covered step stays unknown
        grid[row_idx[known], col_idx[known]] = values[known]
    return ids, grid_ds, grid


def batch_watermark(engine: Engine) -> int:
    """The newest ingest batch id (0 before any): what a reader has seen up to."""
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT coalesce(max(id), 0) FROM ingest_batches")).scalar())


def earliest_window_since(engine: Engine, watermark: int):
    """The earliest window start of any batch after ``watermark`` (None if none came)."""
    with engine.connect() as conn:
        return conn.execute(text("SELECT min(window_start) FROM ingest_batches WHERE id > :w"),
                            {"w": watermark}).scalar()


def coverage_ends(engine: Engine, model_ids: list[str], *, source: str, step_seconds: int) -> dict[str, datetime]:
    """Per model, the end of what ``source`` covered at ``step_seconds`` (models never covered are left out)."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT model_id, upper(ranges) FROM coverage WHERE source = :src AND step_seconds = :step "
                 "AND model_id = ANY(CAST(:ids AS text[]))"),
            {"src": source, "step": step_seconds, "ids": model_ids},
        ).all()
    return {r[0]: r[1] for r in rows if r[1] is not None}


def _query_sha256(query: str) -> str:
    return hashlib.sha256(query.encode("utf-8")).hexdigest()


def asked_through(engine: Engine, queries: dict[str, str], *, source: str) -> dict[str, datetime]:
    """Per model (``queries``: model id -> the query it is asked with now), the end of the last run of ``source``
    that asked that same query and found no sample (:func:`record_asked_through`). Models never recorded, or
    recorded under another query (a corrected label), are left out: their minutes are asked again."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT model_id, asked_through, query_sha256 FROM source_cursors WHERE source = :src "
                 "AND model_id = ANY(CAST(:ids AS text[]))"),
            {"src": source, "ids": list(queries)},
        ).all()
    return {r[0]: r[1] for r in rows if r[2] == _query_sha256(queries[r[0]])}


def record_asked_through(engine: Engine, queries: dict[str, str], *, source: str, through: datetime) -> None:
    """Record that ``source`` asked for these models' minutes up to ``through`` with ``queries`` (model id -> query)
    and found no sample: the next run asking the same query need not ask for them again. Under the same query a
    cursor never moves back; models deleted meanwhile are skipped."""
    if not queries:
        return
    ids = sorted(queries)
    with engine.begin() as conn:
        conn.execute(
            text("INSERT INTO source_cursors (model_id, source, asked_through, query_sha256) "
                 "SELECT m.id, :src, :through, q.sha FROM unnest(CAST(:ids AS text[]), CAST(:shas AS text[])) "
                 "AS q(id, sha) JOIN serving_models m ON m.id = q.id "
                 "ON CONFLICT (model_id, source) DO UPDATE SET asked_through = CASE "
                 "WHEN source_cursors.query_sha256 = excluded.query_sha256 "
                 "THEN greatest(source_cursors.asked_through, excluded.asked_through) ELSE excluded.asked_through END, "
                 "query_sha256 = excluded.query_sha256, updated_at = now()"),
            {"src": source, "through": through, "ids": ids, "shas": [_query_sha256(queries[i]) for i in ids]},
        )


def covered_within(engine: Engine, windows: pd.DataFrame, *, source: str, step_seconds: int
                   ) -> list[tuple[str, datetime, datetime]]:
    """The parts of ``windows`` (``unique_id, start, end``) that ``source`` already covers at ``step_seconds``:
    ``(model, start, end)`` per covered range, what a batch of those windows would replace."""
    if windows.empty:
        return []
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT w.model_id, lower(r), upper(r) FROM unnest(CAST(:ids AS text[]), "
                 "CAST(:starts AS timestamptz[]), CAST(:ends AS timestamptz[])) AS w(model_id, s, e) "
                 "JOIN coverage c ON c.model_id = w.model_id AND c.source = :src AND c.step_seconds = :step "
                 "CROSS JOIN LATERAL unnest(c.ranges * tstzmultirange(tstzrange(w.s, w.e, '[)'))) AS r "
                 "ORDER BY 1, 2"),
            {"src": source, "step": step_seconds, "ids": windows["unique_id"].astype(str).tolist(),
             "starts": [t.to_pydatetime() for t in windows["start"]],
             "ends": [t.to_pydatetime() for t in windows["end"]]},
        ).all()
    return [(r[0], r[1], r[2]) for r in rows]


def batch_window_models(engine: Engine, batch_id: int) -> tuple[datetime, datetime, list[str]]:
    """A batch's window and the models whose coverage overlaps it (what the batch spoke for)."""
    with engine.connect() as conn:
        start, end = conn.execute(text("SELECT window_start, window_end FROM ingest_batches WHERE id = :id"),
                                  {"id": batch_id}).one()
        model_ids = conn.execute(
            text("SELECT model_id FROM coverage WHERE ranges && tstzmultirange(tstzrange(:s, :e))"),
            {"s": start, "e": end}).scalars().all()
    return start, end, list(model_ids)
