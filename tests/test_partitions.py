"""Daily partitions created by several writers at once (invocations and forecasts), on a real PostgreSQL."""

from __future__ import annotations

import threading
import time
from datetime import date, datetime, timedelta, timezone

import pytest
from sqlalchemy import text

from forecaster.store import partitions
from forecaster.store.forecasts import ensure_forecast_partitions, forecast_partitions, maintain_forecast_partitions
from forecaster.store.partitions import ensure_partitions, existing_partitions, maintain_partitions, partition_name

WRITERS = 6


def at_once(target, *args) -> list[BaseException]:
    """``target(*args)`` in ``WRITERS`` threads released together; the errors they raised."""
    start = threading.Barrier(WRITERS, timeout=30)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            start.wait()
            target(*args)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


@pytest.mark.parametrize("day", [date(2031, 1, 1) + timedelta(days=i) for i in range(4)])
def test_writers_creating_one_new_invocation_day_at_once_all_succeed(engine, day):
    """Two pushes of one new day used to race on ``CREATE TABLE IF NOT EXISTS``: one of them failed with 42P07
    (seen as a refused push in tests/test_api_hostile.py). Six at once: none fails, one partition."""
    start = datetime(day.year, day.month, day.day, tzinfo=timezone.utc)
    assert at_once(ensure_partitions, engine, start, start + timedelta(hours=1)) == []
    with engine.connect() as conn:
        assert partition_name(day) in existing_partitions(conn)


@pytest.mark.parametrize("day", [date(2031, 2, 1) + timedelta(days=i) for i in range(4)])
def test_writers_creating_one_new_forecast_day_at_once_all_succeed(engine, day):
    assert at_once(ensure_forecast_partitions, engine, [day]) == []
    with engine.connect() as conn:
        assert day in forecast_partitions(conn)


def _behind_a_long_reader(engine, table: str, maintain) -> dict:
    """Run ``maintain()`` in a thread while another session holds an open transaction that read ``table`` (a
    pg_dump, a session idle in transaction); once the maintenance waits for its lock, a third session reads
    ``table`` with a 2 s statement timeout. Returns what the maintenance returned (``result``), or raised."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = maintain()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            outcome["error"] = exc

    reader = engine.connect()
    reader.begin()
    reader.execute(text(f"SELECT count(*) FROM {table}"))
    thread = threading.Thread(target=run)
    try:
        thread.start()
        deadline = time.monotonic() + 10
        with engine.connect() as conn:  # wait until the maintenance's DDL queues for the table's lock
            while time.monotonic() < deadline and not conn.execute(text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query ILIKE '%PARTITION OF%'")).scalar():
                time.sleep(0.01)
        with engine.begin() as conn:
            conn.execute(text("SET LOCAL statement_timeout = '2s'"))
            conn.execute(text(f"SELECT count(*) FROM {table}")).scalar()  # raised QueryCanceled: queued behind DDL
        thread.join(30)
        assert not thread.is_alive()
    finally:
        reader.rollback()
        reader.close()
        thread.join(60)
    return outcome


def test_forecast_partition_maintenance_behind_a_long_reader_skips_and_never_stalls_readers(engine, monkeypatch,
                                                                                           caplog):
    """CREATE TABLE ... PARTITION OF and DROP TABLE of a partition wait for an exclusive lock on ``forecasts``
    behind any open reader, and every later query of the table queued behind them: the forecast, plan and ingest
    jobs hung. Now each waits at most PARTITION_LOCK_TIMEOUT_S, is skipped with a warning and done next run."""
    monkeypatch.setattr(partitions, "PARTITION_LOCK_TIMEOUT_S", 0.5)
    now = datetime(2031, 3, 10, 12, tzinfo=timezone.utc)
    ensure_forecast_partitions(engine, [date(2031, 3, 1)])  # past retention: to drop
    maintain = lambda: maintain_forecast_partitions(engine, now=now, days_ahead=1, retention_days=2)  # noqa: E731

    outcome = _behind_a_long_reader(engine, "forecasts", maintain)

    assert outcome == {"result": {"created": [], "dropped": [],
                                  "skipped": ["forecasts_20310310", "forecasts_20310311", "forecasts_20310301"]}}
    assert "forecast partition forecasts_20310310 not created" in caplog.text
    assert "forecast partition forecasts_20310301 not dropped" in caplog.text
    assert maintain() == {"created": ["forecasts_20310310", "forecasts_20310311"], "dropped": ["forecasts_20310301"],
                          "skipped": []}


def test_invocation_partition_maintenance_behind_a_long_reader_skips_and_never_stalls_readers(engine, monkeypatch,
                                                                                             caplog):
    monkeypatch.setattr(partitions, "PARTITION_LOCK_TIMEOUT_S", 0.5)
    now = datetime(2031, 3, 10, 12, tzinfo=timezone.utc)
    maintain = lambda: maintain_partitions(engine, now=now, days_ahead=1)  # noqa: E731

    assert _behind_a_long_reader(engine, "invocations", maintain) == {"result": []}
    assert "partition invocations_20310310 not created" in caplog.text
    assert maintain() == ["invocations_20310310", "invocations_20310311"]
