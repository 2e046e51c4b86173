"""Daily partitions created by several writers at once (invocations and forecasts), on a real PostgreSQL."""

from __future__ import annotations

import threading
from datetime import date, datetime, timedelta, timezone

import pytest
from forecaster.store.forecasts import ensure_forecast_partitions, forecast_partitions
from forecaster.store.partitions import ensure_partitions, existing_partitions, partition_name

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
