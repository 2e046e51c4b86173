"""The database goes away mid-write: the batch is retried whole, never half-written or counted twice."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pandas as pd
import pytest
from sqlalchemy import text

import forecaster.store.invocations as invocations_module
from forecaster.ingest.validate import build_count_batch
from forecaster.store.db import DatabaseUnavailable, make_engine, run_with_retry, upgrade
from forecaster.store.invocations import write_count_batch


T0 = datetime(2026, 11, 29, 10, 0, tzinfo=timezone.utc)


def _batch(now):
    rows = [("llama", T0 + timedelta(minutes=i), i + 1) for i in range(30)]
    return build_count_batch(pd.DataFrame(rows, columns=["unique_id", "ds", "y"]), source="push", step_seconds=60,
                             now=now)


def test_crash_mid_copy_is_retried_once_and_counted_once(crashable, monkeypatch, now):
    engine = make_engine(crashable.url)
    upgrade(engine)
    batch = _batch(now)
    original_copy = invocations_module._copy_counts
    crashes = []

    def copy_then_crash(conn, counts):
        if not crashes:
            crashes.append(crashable.pid())
            crashable.crash()  # the server dies after DELETE, before the rows are in
        return original_copy(conn, counts)

    monkeypatch.setattr(invocations_module, "_copy_counts", copy_then_crash)
    restarts = []

    def restart_instead_of_sleeping(delay_s: float) -> None:
        restarts.append(delay_s)
        crashable.start()

    result = run_with_retry(lambda: write_count_batch(engine, batch, register_models=True), attempts=3,
                            base_delay_s=0.01, what="test", sleep=restart_instead_of_sleeping)
    assert len(crashes) == 1 and len(restarts) == 1
    assert crashable.pid() != crashes[0]  # a new postmaster really runs
    assert result.rows_written == 30 and not result.duplicate
    with engine.connect() as conn:
        total, rows = conn.execute(text("SELECT sum(count), count(*) FROM invocations")).one()
        batches = conn.execute(text("SELECT count(*) FROM ingest_batches")).scalar()
    assert (total, rows, batches) == (sum(range(1, 31)), 30, 1)
    # and a re-send after the recovery is recognised as the same batch
    assert write_count_batch(engine, batch).duplicate
    engine.dispose()


def test_database_down_for_good_gives_a_clear_error_and_nothing_written(crashable, now):
    engine = make_engine(crashable.url)
    upgrade(engine)
    crashable.crash()
    with pytest.raises(DatabaseUnavailable, match="ingest push: database unavailable after 3 attempts"):
        run_with_retry(lambda: write_count_batch(engine, _batch(now), register_models=True), attempts=3,
                       base_delay_s=0.0, what="ingest push", sleep=lambda s: None)
    crashable.start()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM invocations")).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM ingest_batches")).scalar() == 0
    engine.dispose()


def test_crash_after_the_burst_update_moves_the_factor_once(crashable, monkeypatch, now):
    """The counts' batch and the burst factors it moves (Prometheus ingest) are one transaction: the server dies
    after the factor's UPDATE and before the commit, the retry writes both again, and the factor moves once."""
    import numpy as np

    from forecaster.contracts.bursts import BURST_ALPHA
    from forecaster.store.catalog import advance_burst_factors

    engine = make_engine(crashable.url)
    upgrade(engine)
    crashes = []

    def move_then_crash(conn) -> int:
        # 30 minutes of 120 requests, 60 of them in the busiest 10 s: a ratio of 3 each
        minutes = pd.date_range(T0, periods=30, freq="min")
        moved = advance_burst_factors(conn, ["llama"], minutes, np.full((1, 30), 120.0), np.full((1, 30), 60.0))
        if not crashes:
            crashes.append(crashable.pid())
            crashable.crash()
        return moved

    def restart_instead_of_sleeping(delay_s: float) -> None:
        crashable.start()

    result = run_with_retry(lambda: write_count_batch(engine, _batch(now), register_models=True,
                                                      then=move_then_crash),
                            attempts=3, base_delay_s=0.01, what="test", sleep=restart_instead_of_sleeping)
    assert len(crashes) == 1 and result.rows_written == 30 and result.burst_factors_stored == 1
    keep = (1.0 - BURST_ALPHA) ** 30
    with engine.connect() as conn:
        factor = conn.execute(text("SELECT burst_factor FROM serving_models WHERE id = 'llama'")).scalar()
        assert conn.execute(text("SELECT count(*) FROM ingest_batches")).scalar() == 1
    assert factor == pytest.approx(keep + 3.0 * (1.0 - keep))
    engine.dispose()
