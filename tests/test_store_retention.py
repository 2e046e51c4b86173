"""Retention of invocations: roll-ups keep totals and known buckets, drops remove days, ingest respects roll-ups."""

from __future__ import annotations

import threading
from datetime import date, datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import text

from forecaster.contracts.batches import IngestError
from forecaster.ingest.validate import build_count_batch
from forecaster.jobs.runs import run_once
from forecaster.jobs.scheduler import default_jobs
from forecaster.settings import Settings, SettingsError, load_settings
from forecaster.store import retention
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.invocations import read_counts, write_count_batch
from forecaster.store.retention import apply_retention, drop_day, rollup_day

DAY = date(2026, 11, 20)  # 9 days before the `now` fixture: old enough for a roll-up
NEXT = DAY + timedelta(days=1)


def _at(day: date, hour: int = 0, minute: int = 0) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=timezone.utc) + timedelta(hours=hour, minutes=minute)


def _write(engine, now, rows, *, windows, source="push", step=60):
    raw = pd.DataFrame(rows, columns=["unique_id", "ds", "y"])
    win = pd.DataFrame(windows, columns=["unique_id", "start", "end"])
    return write_count_batch(engine, build_count_batch(raw, source=source, step_seconds=step, now=now, windows=win))


def _minute_rows(model_id: str, start: datetime, minutes: int, seed: int) -> list[tuple]:
    counts = np.random.default_rng(seed).poisson(1.5, minutes)  # plenty of zeros: not stored
    return [(model_id, start + timedelta(minutes=i), int(c)) for i, c in enumerate(counts)]


@pytest.fixture
def store(engine, now):
    """Two models on DAY and NEXT.

    * llama, source push, step 60: all of DAY and the first hour of NEXT.
    * mistral, source push, step 60: DAY 10:02-10:13 only, so buckets 10:00 and
      10:10 are partly covered and 10:05 fully.
    * mistral, source trace, step 60: DAY 23:52 - NEXT 00:08, across midnight.
    """
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="llama"), ServingModelSpec(id="mistral")])
    _write(engine, now, _minute_rows("llama", _at(DAY), 1440, 1) + _minute_rows("llama", _at(NEXT), 60, 2),
           windows=[("llama", _at(DAY), _at(NEXT, 1))])
    _write(engine, now, [("mistral", _at(DAY, 10, 2 + i), 1 + i) for i in range(11)],
           windows=[("mistral", _at(DAY, 10, 2), _at(DAY, 10, 13))])
    _write(engine, now, [("mistral", _at(DAY, 23, 52) + timedelta(minutes=i), 2) for i in range(16)],
           windows=[("mistral", _at(DAY, 23, 52), _at(NEXT, 0, 8))], source="trace")
    return engine


def _live(engine, now, model_id="llama", source="push", at: datetime | None = None):
    """One fresh minute of ``source`` at ``at`` (default: ``now``'s hour): the source is still ingesting.

    Retention ages a day from the newest data of the sources holding it, so a test of ageing needs a source
    whose data reaches the present.
    """
    at = at or now.replace(minute=0, second=0, microsecond=0)
    _write(engine, at, [(model_id, at, 1)], windows=[(model_id, at, at + timedelta(minutes=1))], source=source)


def _totals(engine) -> dict[tuple[str, date], int]:
    """Invocations per model and UTC day."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT model_id, (minute AT TIME ZONE 'UTC')::date, sum(count) "
                                 "FROM invocations GROUP BY 1, 2")).all()
    return {(m, d): int(s) for m, d, s in rows}


def _rows(engine, day: date) -> int:
    with engine.connect() as conn:
        return conn.execute(text(f"SELECT count(*) FROM invocations_{day:%Y%m%d}")).scalar_one()


def _coverage(engine, day: date | None = None) -> dict[tuple[str, str, int], str]:
    """Coverage ranges per (model, source, step), cut to ``day`` when given (empty parts left out)."""
    cut = "ranges" if day is None else "ranges * tstzmultirange(tstzrange(:lo, :hi, '[)'))"
    lo, hi = _at(day or DAY), _at((day or DAY) + timedelta(days=1))
    with engine.connect() as conn:
        conn.execute(text("SET TIME ZONE 'UTC'"))
        rows = conn.execute(text(f"SELECT model_id, source, step_seconds, ({cut})::text FROM coverage"),
                            {"lo": lo, "hi": hi}).all()
    return {(m, s, st): r for m, s, st, r in rows if r != "{}"}


def _read(engine, day: date, step: int) -> pd.DataFrame:
    return read_counts(engine, ["llama", "mistral"], _at(day), _at(day + timedelta(days=1)), step_seconds=step)


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))


def _bucket(frame: pd.DataFrame, model_id: str, at: datetime) -> float:
    return float(frame[(frame.unique_id == model_id) & (frame.ds == pd.Timestamp(at))]["y"].iloc[0])


def test_rollup_keeps_totals_and_five_minute_reads(store):
    totals, rows_before = _totals(store), _rows(store, DAY)
    five_before, next_before = _read(store, DAY, 300), _read(store, NEXT, 60)
    next_coverage = _coverage(store, NEXT)

    result = rollup_day(store, DAY, 300)

    assert (result.rows_before, result.skipped) == (rows_before, False)
    assert result.rows_after == _rows(store, DAY) < rows_before
    assert _totals(store) == totals  # every invocation of every model and day is still counted
    _same(_read(store, DAY, 300), five_before)
    assert _read(store, DAY, 60)["y"].isna().all()  # minutes of a rolled-up day are unknown, not zero
    _same(_read(store, NEXT, 60), next_before)
    assert _coverage(store, NEXT) == next_coverage  # the next day's coverage is untouched
    with store.connect() as conn:
        minutes = conn.execute(text("SELECT DISTINCT extract(epoch FROM minute)::bigint % 300 "
                                    "FROM invocations_20261120")).scalars().all()
        rolled = conn.execute(text("SELECT step_seconds, rows_before, rows_after FROM rollups")).one()
    assert minutes == [0]  # one row per bucket start
    assert tuple(rolled) == (300, rows_before, result.rows_after)


def test_partly_covered_bucket_is_unknown_but_counted(store):
    rollup_day(store, DAY, 300)
    five = _read(store, DAY, 300)
    # mistral/push covered 10:02-10:13: counts 1..11; bucket 10:00 held 1+2+3, 10:05 4..8, 10:10 9+10+11
    assert np.isnan(_bucket(five, "mistral", _at(DAY, 10, 0)))
    assert _bucket(five, "mistral", _at(DAY, 10, 5)) == 4 + 5 + 6 + 7 + 8
    assert np.isnan(_bucket(five, "mistral", _at(DAY, 10, 10)))
    with store.connect() as conn:
        kept = dict(conn.execute(text(
            "SELECT minute, count FROM invocations WHERE model_id = 'mistral' AND minute >= :lo AND minute < :hi"
        ), {"lo": _at(DAY, 10), "hi": _at(DAY, 10, 15)}).all())
    assert kept == {_at(DAY, 10, 0): 6, _at(DAY, 10, 5): 30, _at(DAY, 10, 10): 30}
    coverage = _coverage(store)
    assert coverage[("mistral", "push", 300)] == '{["2026-11-20 10:05:00+00","2026-11-20 10:10:00+00")}'
    assert ("mistral", "push", 60) not in coverage  # its only range lay inside the day
    # the midnight-spanning source: the day's part snapped inward to 23:55, the next day's minutes stay
    assert coverage[("mistral", "trace", 300)] == '{["2026-11-20 23:55:00+00","2026-11-21 00:00:00+00")}'
    assert coverage[("mistral", "trace", 60)] == '{["2026-11-21 00:00:00+00","2026-11-21 00:08:00+00")}'
    assert coverage[("llama", "push", 60)] == '{["2026-11-21 00:00:00+00","2026-11-21 01:00:00+00")}'


def test_rolled_partition_keeps_its_indexes_and_constraints(store):
    rollup_day(store, DAY, 300)
    with store.connect() as conn:
        attached = conn.execute(text(
            "SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid "
            "WHERE c.relname = 'invocations_20261120'")).scalar_one()
        indexes = conn.execute(text("SELECT indexname FROM pg_indexes WHERE tablename = 'invocations_20261120'")
                               ).scalars().all()
        constraints = dict(conn.execute(text(
            "SELECT conname, conparentid <> 0 FROM pg_constraint WHERE conrelid = 'invocations_20261120'::regclass "
            "AND contype IN ('f', 'p', 'c')")).all())
        leftovers = conn.execute(text("SELECT to_regclass('invocations_20261120_rollup')")).scalar()
    assert "2026-11-20 00:00:00+00" in attached and "2026-11-21 00:00:00+00" in attached
    assert indexes == ["invocations_20261120_pkey"]
    assert constraints == {"invocations_20261120_pkey": True, "invocations_model_id_fkey": True,
                           "invocations_count_nonneg": False}
    assert leftovers is None
    with pytest.raises(Exception, match="foreign key"), store.begin() as conn:
        conn.execute(text("INSERT INTO invocations VALUES ('ghost', :t, 1)"), {"t": _at(DAY, 1)})


def test_rerun_is_a_noop(store):
    first = rollup_day(store, DAY, 300)
    with store.connect() as conn:
        recorded = conn.execute(text("SELECT rolled_at, rows_after FROM rollups")).one()
    again = rollup_day(store, DAY, 300)
    assert again.skipped and again.rows_before == 0 and again.step_seconds == 300
    with store.connect() as conn:
        assert conn.execute(text("SELECT rolled_at, rows_after FROM rollups")).one() == recorded
    assert first.rows_after == _rows(store, DAY)


def test_hourly_rollup_of_a_five_minute_day(store, now):
    # a second, natively 5-minute source on NEXT's afternoon, beside the per-minute data
    _write(store, now, [("mistral", _at(NEXT, 12) + timedelta(minutes=5 * i), 10 + i) for i in range(24)],
           windows=[("mistral", _at(NEXT, 12), _at(NEXT, 14))], source="huawei", step=300)
    totals = _totals(store)
    hourly = {d: _read(store, d, 3600) for d in (DAY, NEXT)}
    rollup_day(store, DAY, 300)
    hour_day = rollup_day(store, DAY, 3600)
    hour_next = rollup_day(store, NEXT, 3600)  # straight from minutes and 5-minute data
    assert _totals(store) == totals
    for d in (DAY, NEXT):
        _same(_read(store, d, 3600), hourly[d])
        assert _read(store, d, 300)["y"].isna().all()
    assert hour_day.rows_after == _rows(store, DAY) <= 2 * 24
    assert _bucket(_read(store, NEXT, 3600), "mistral", _at(NEXT, 12)) == sum(10 + i for i in range(12))
    coverage = _coverage(store)
    assert {k for k in coverage if k[2] < 3600} == set()  # all finer coverage of both days moved
    assert ("mistral", "trace", 3600) not in coverage  # 23:52-00:08 holds no whole hour
    assert hour_next.coverage_rows == 3  # llama/push/60, mistral/trace/60, mistral/huawei/300


def test_drop_day_removes_rows_and_coverage(store):
    rollup_day(store, DAY, 300)
    next_coverage, next_rows = _coverage(store, NEXT), _rows(store, NEXT)
    result = drop_day(store, DAY)
    assert result["partition_dropped"] and result["coverage_rows"] > 0
    with store.connect() as conn:
        assert conn.execute(text("SELECT to_regclass('invocations_20261120')")).scalar() is None
        assert conn.execute(text("SELECT count(*) FROM rollups")).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM invocations WHERE minute < :hi"),
                            {"hi": _at(NEXT)}).scalar() == 0
    assert _coverage(store, DAY) == {}
    assert _coverage(store, NEXT) == next_coverage and _rows(store, NEXT) == next_rows
    assert _read(store, DAY, 300)["y"].isna().all()
    assert drop_day(store, DAY) == {"day": "2026-11-20", "partition_dropped": False, "coverage_rows": 0}


def test_ingest_finer_than_a_rolled_day_is_rejected(store, now):
    rollup_day(store, DAY, 300)
    totals, coverage = _totals(store), _coverage(store)
    with store.connect() as conn:
        batches = conn.execute(text("SELECT count(*) FROM ingest_batches")).scalar()
    with pytest.raises(IngestError) as info:
        _write(store, now, [("llama", _at(DAY, 5, 1), 7)], windows=[("llama", _at(DAY, 5), _at(DAY, 6))])
    assert info.value.reason == "rolled_up" and info.value.value == "2026-11-20"
    assert "2026-11-20" in str(info.value) and "300 s" in str(info.value)
    assert _totals(store) == totals and _coverage(store) == coverage
    with store.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM ingest_batches")).scalar() == batches
    # at the rolled step and coarser it is accepted, replacing the window
    _write(store, now, [("llama", _at(DAY, 5, 5), 7)], windows=[("llama", _at(DAY, 5), _at(DAY, 6))], step=300)
    assert _bucket(_read(store, DAY, 300), "llama", _at(DAY, 5, 5)) == 7.0
    _write(store, now, [("llama", _at(DAY, 7), 9)], windows=[("llama", _at(DAY, 7), _at(DAY, 8))], step=3600)
    assert _bucket(_read(store, DAY, 3600), "llama", _at(DAY, 7)) == 9.0
    # a per-minute window that also touches the rolled day is refused as a whole
    with pytest.raises(IngestError, match="rolled up"):
        _write(store, now, [("llama", _at(NEXT, 2), 1)], windows=[("llama", _at(DAY, 23, 59), _at(NEXT, 3))])
    _write(store, now, [("llama", _at(NEXT, 2), 1)], windows=[("llama", _at(NEXT, 2), _at(NEXT, 3))])


def test_ingest_at_a_step_that_cuts_rolled_buckets_is_rejected(store, now):
    """A 420 s batch is coarser than a day rolled up to 300 s but cuts its buckets (the check compared sizes
    only, and the batch was written); a multiple of 300 s is still accepted."""
    rollup_day(store, DAY, 300)
    totals, coverage = _totals(store), _coverage(store)
    start = pd.Timestamp(_at(DAY, 5)).floor("420s").to_pydatetime()
    with pytest.raises(IngestError) as info:
        _write(store, now, [("llama", start, 7)], windows=[("llama", start, start + timedelta(seconds=840))],
               step=420)
    assert info.value.reason == "rolled_up" and "cuts its 300 s buckets" in str(info.value)
    assert _totals(store) == totals and _coverage(store) == coverage
    _write(store, now, [("llama", _at(DAY, 5), 7)], windows=[("llama", _at(DAY, 5), _at(DAY, 5, 20))], step=600)
    assert _bucket(_read(store, DAY, 600), "llama", _at(DAY, 5, 10)) == 0.0


def test_rollup_waits_for_a_writer_of_the_same_day(store):
    """A roll-up started while a batch writes the day waits for its commit (no count lost in between)."""
    done: list = []
    with store.connect() as writer:
        with writer.begin():
            retention.lock_days_for_write(writer, [DAY])
            worker = threading.Thread(target=lambda: done.append(rollup_day(store, DAY, 300)))
            worker.start()
            worker.join(timeout=1.0)
            assert worker.is_alive() and not done  # blocked on the day's lock
        worker.join(timeout=30)
    assert done and done[0].rows_after > 0


def _state(engine) -> tuple:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT model_id, minute, count FROM invocations ORDER BY 1, 2")).all()
        rollups = conn.execute(text("SELECT day, step_seconds FROM rollups ORDER BY day")).all()
        staging = conn.execute(text("SELECT count(*) FROM pg_class WHERE relname LIKE '%\\_rollup'")).scalar()
    return rows, _coverage(engine), rollups, staging


def test_failure_mid_rollup_leaves_the_day_unchanged(store, monkeypatch):
    before = _state(store)
    swapped = []

    def swap_then_fail(conn, *args):
        real_swap(conn, *args)  # the new partition is in place when the failure hits
        swapped.append(True)
        raise RuntimeError("disk full")

    real_swap = retention._swap_partition
    monkeypatch.setattr(retention, "_swap_partition", swap_then_fail)
    with pytest.raises(RuntimeError, match="disk full"):
        rollup_day(store, DAY, 300)
    assert swapped and _state(store) == before
    monkeypatch.undo()

    # a database-side failure at the very end (a trigger on rollups) rolls back just as well
    with store.begin() as conn:
        conn.execute(text("CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
                          "$$ BEGIN IF NEW.day = DATE '2026-11-20' THEN RAISE EXCEPTION 'refused'; END IF; "
                          "RETURN NEW; END $$"))
        conn.execute(text("CREATE TRIGGER refuse BEFORE INSERT ON rollups FOR EACH ROW EXECUTE FUNCTION refuse()"))
    with pytest.raises(Exception, match="refused"):
        rollup_day(store, DAY, 300)
    assert _state(store) == before
    assert rollup_day(store, NEXT, 300).rows_after > 0  # other days are unaffected


def test_apply_retention_by_age_and_idempotent(engine, now):
    settings = Settings(invocations_minute_days=7, invocations_5min_days=35, invocations_retention_days=400)
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="llama")])
    today = now.date()
    ages = {"recent": today - timedelta(days=7), "five": today - timedelta(days=8),
            "hourly": today - timedelta(days=36), "gone": today - timedelta(days=401)}
    for i, day in enumerate(ages.values()):
        _write(engine, now, _minute_rows("llama", _at(day), 1440, i), windows=[("llama", _at(day), _at(day, 24))])
    _live(engine, now)
    totals = _totals(engine)
    with engine.begin() as conn:  # coverage left from a day whose partition is long gone; the source ingests still
        conn.execute(text("INSERT INTO coverage (model_id, source, step_seconds, ranges) VALUES ('llama', 'old', 60, "
                          "tstzmultirange(tstzrange(:lo, :hi), tstzrange(:now, :now_end)))"),
                     {"lo": _at(ages["gone"] - timedelta(days=9)), "hi": _at(ages["gone"] - timedelta(days=8)),
                      "now": _at(today), "now_end": _at(today, 1)})

    summary = apply_retention(engine, now=now, settings=settings)

    assert {k: summary[k] for k in ("rolled_to_300s", "rolled_to_3600s", "dropped")} == \
        {"rolled_to_300s": 1, "rolled_to_3600s": 1, "dropped": 1}
    assert summary["dropped_days"] == [ages["gone"].isoformat()]
    assert summary["coverage_rows_trimmed"] == 1
    assert _coverage(engine)[("llama", "old", 60)].count("[") == 1  # only the recent range is left
    with engine.connect() as conn:
        assert dict(conn.execute(text("SELECT day, step_seconds FROM rollups")).all()) == \
            {ages["five"]: 300, ages["hourly"]: 3600}
    assert _totals(engine) == {k: v for k, v in totals.items() if k[1] != ages["gone"]}
    recent = _read(engine, ages["recent"], 60)
    assert recent[recent.unique_id == "llama"]["y"].notna().all()
    assert apply_retention(engine, now=now, settings=settings) == {**dict.fromkeys(summary, 0), "dropped_days": []}
    # without newer data nothing ages, however late the clock; with the source's data 28 days on, the
    # 5-minute day (8 + 28 = 36 days old) becomes hourly
    assert apply_retention(engine, now=now + timedelta(days=28), settings=settings)["rolled_to_3600s"] == 0
    _live(engine, now + timedelta(days=28))
    assert apply_retention(engine, now=now + timedelta(days=28), settings=settings)["rolled_to_3600s"] == 1


def test_apply_retention_finishes_other_days_then_raises(engine, now):
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="llama")])
        conn.execute(text("CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
                          "$$ BEGIN IF NEW.day = DATE '2026-11-20' THEN RAISE EXCEPTION 'refused'; END IF; "
                          "RETURN NEW; END $$"))
        conn.execute(text("CREATE TRIGGER refuse BEFORE INSERT ON rollups FOR EACH ROW EXECUTE FUNCTION refuse()"))
    for day in (DAY, NEXT):
        _write(engine, now, _minute_rows("llama", _at(day), 120, 3), windows=[("llama", _at(day), _at(day, 2))])
    _live(engine, now)
    rows_before = _rows(engine, DAY)
    with pytest.raises(RuntimeError, match="1 day.*2026-11-20.*refused"):
        apply_retention(engine, now=now, settings=Settings())
    with engine.connect() as conn:
        assert conn.execute(text("SELECT day FROM rollups")).scalars().all() == [NEXT]
    assert _rows(engine, DAY) == rows_before


def test_retention_job_runs_once_per_slot(engine, settings, now, store):
    spec = next(s for s in default_jobs(settings) if s.name == "retention")
    assert spec.every_s == settings.retention_interval_s == 3600
    _live(engine, now)
    first = run_once(engine, settings, spec, now=now)
    assert first["invocations"]["rolled_to_300s"] == 2  # DAY and NEXT are 9 and 8 days old
    assert set(first["forecasts"]) == {"created", "dropped", "skipped"}  # forecast partitions kept ahead and pruned
    assert run_once(engine, settings, spec, now=now + timedelta(minutes=30)) is None  # same slot
    later = run_once(engine, settings, spec, now=now + timedelta(hours=1))
    assert later["invocations"]["rolled_to_300s"] == 0
    with engine.connect() as conn:
        runs = conn.execute(text("SELECT status FROM job_runs WHERE job_name = 'retention'")).scalars().all()
    assert runs == ["ok", "ok"]


def test_imported_trace_is_aged_from_its_own_newest_data_not_the_wall_clock(engine, now, caplog):
    """A trace of 2024 imported in 2026 keeps every minute; the wall clock alone never drops or rolls it up."""
    settings = Settings(invocations_minute_days=7, invocations_5min_days=35, invocations_retention_days=400)
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="llama")])
    old = [date(2024, 7, 14), date(2024, 7, 15)]
    for i, day in enumerate(old):
        _write(engine, now, _minute_rows("llama", _at(day), 1440, i), windows=[("llama", _at(day), _at(day, 24))],
               source="trace:azure2019")
    totals = _totals(engine)
    assert apply_retention(engine, now=now, settings=settings) == {
        "rolled_to_300s": 0, "rolled_to_3600s": 0, "dropped": 0, "rows_before": 0, "rows_after": 0,
        "coverage_rows_trimmed": 0, "dropped_days": []}
    assert _totals(engine) == totals
    kept = _read(engine, old[0], 60)
    assert kept[kept.unique_id == "llama"]["y"].notna().all()  # minutes still known, not rolled up
    # a live source ingesting today does not age the trace's days either: they age from the trace's newest data
    _live(engine, now, source="prometheus")
    assert apply_retention(engine, now=now, settings=settings)["dropped"] == 0
    assert _totals(engine) == {**totals, ("llama", now.date()): 1}
    # the trace's first day is 1 day older than its newest data: after 7 days of it, it is rolled up, logged
    _write(engine, now, _minute_rows("llama", _at(date(2024, 7, 23)), 10, 9),
           windows=[("llama", _at(date(2024, 7, 23)), _at(date(2024, 7, 23), 1))], source="trace:azure2019")
    assert apply_retention(engine, now=now, settings=settings)["rolled_to_300s"] == 2


def test_dropping_a_day_logs_what_and_why(engine, now, caplog):
    settings = Settings(invocations_minute_days=1, invocations_5min_days=1, invocations_retention_days=2)
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="llama")])
    gone = now.date() - timedelta(days=3)
    _write(engine, now, _minute_rows("llama", _at(gone), 60, 1), windows=[("llama", _at(gone), _at(gone, 1))])
    _live(engine, now)
    with caplog.at_level("WARNING", logger="forecaster.store.retention"):
        summary = apply_retention(engine, now=now, settings=settings)
    assert summary["dropped_days"] == [gone.isoformat()]
    line = next(r.getMessage() for r in caplog.records if "dropping" in r.getMessage())
    assert gone.isoformat() in line and "push" in line and "older than 2 days" in line


def test_retention_ages_must_ascend():
    with pytest.raises(SettingsError, match="INVOCATIONS_MINUTE_DAYS <= PREWARM_INVOCATIONS_5MIN_DAYS"):
        load_settings(invocations_minute_days=10, invocations_5min_days=9)
    with pytest.raises(SettingsError, match="got 7 / 35 / 30"):
        load_settings(invocations_retention_days=30)
    assert load_settings(invocations_minute_days=3, invocations_5min_days=3, invocations_retention_days=3)
