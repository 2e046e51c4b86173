"""Store semantics: window replacement, idempotency, coverage (zero vs unknown), atomicity."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import text

from forecaster.contracts.batches import IngestError
from forecaster.ingest.validate import build_count_batch
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.invocations import read_counts, write_count_batch

T0 = datetime(2026, 11, 28, 23, 58, tzinfo=timezone.utc)  # spans midnight: two partitions


def _minute(i: int) -> datetime:
    return T0 + timedelta(minutes=i)


def _batch(rows, now, *, windows=None, source="push", step=60):
    raw = pd.DataFrame(rows, columns=["unique_id", "ds", "y"])
    return build_count_batch(raw, source=source, step_seconds=step, now=now, windows=windows)


@pytest.fixture
def registered(engine):
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="llama"), ServingModelSpec(id="mistral")])
    return engine


def _total(engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT coalesce(sum(count), 0) FROM invocations")).scalar())


def test_write_then_read_back_zero_vs_unknown(registered, now):
    batch = _batch([("llama", _minute(0), 3), ("llama", _minute(3), 5), ("mistral", _minute(1), 2)], now)
    result = write_count_batch(registered, batch)
    assert (result.rows_written, result.invocations, result.models) == (3, 10, 2)

    frame = read_counts(registered, ["llama", "mistral"], _minute(-1), _minute(5))
    llama = frame[frame.unique_id == "llama"]["y"].tolist()
    # minute -1 is before coverage (unknown); 0..3 covered; 4 after coverage (unknown)
    assert np.isnan(llama[0]) and np.isnan(llama[5])
    assert llama[1:5] == [3.0, 0.0, 0.0, 5.0]
    mistral = frame[frame.unique_id == "mistral"]["y"].tolist()
    assert mistral[2] == 2.0 and np.isnan(mistral[1]) and np.isnan(mistral[3])


def test_same_batch_twice_is_a_noop(registered, now):
    batch = _batch([("llama", _minute(0), 3), ("llama", _minute(2), 4)], now)
    first = write_count_batch(registered, batch)
    second = write_count_batch(registered, batch)
    assert not first.duplicate and second.duplicate and second.batch_id == first.batch_id
    assert _total(registered) == 7


def test_overlapping_window_replaces_not_adds(registered, now):
    write_count_batch(registered, _batch([("llama", _minute(0), 3), ("llama", _minute(2), 4)], now))
    # a corrected re-send of minutes 1..2 that says minute 2 had 1 invocation
    windows = pd.DataFrame({"unique_id": ["llama"], "start": [_minute(1)], "end": [_minute(3)]})
    write_count_batch(registered, _batch([("llama", _minute(2), 1)], now, windows=windows))
    frame = read_counts(registered, ["llama"], _minute(0), _minute(3))
    assert frame["y"].tolist() == [3.0, 0.0, 1.0]
    assert _total(registered) == 4


def test_coverage_ranges_merge_when_adjacent(registered, now):
    for i in range(5):
        write_count_batch(registered, _batch([("llama", _minute(i), i + 1)], now))
    with registered.connect() as conn:
        ranges = conn.execute(text("SELECT ranges::text FROM coverage WHERE model_id = 'llama'")).scalar()
    assert ranges.count("[") == 1, ranges  # one merged range, not five


def test_unknown_model_writes_nothing(registered, now):
    batch = _batch([("llama", _minute(0), 3), ("ghost", _minute(0), 1)], now)
    with pytest.raises(IngestError) as info:
        write_count_batch(registered, batch)
    assert info.value.reason == "unknown_model" and info.value.value == "ghost"
    assert _total(registered) == 0
    with registered.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM coverage")).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM ingest_batches")).scalar() == 0


def test_auto_register(engine, now):
    result = write_count_batch(engine, _batch([("new-model", _minute(0), 2)], now), register_models=True)
    assert result.rows_written == 1
    with engine.connect() as conn:
        assert conn.execute(text("SELECT labels->>'registered_by' FROM serving_models")).scalar() == "push"


def test_five_minute_data_is_unknown_at_one_minute(registered, now):
    rows = [("llama", _minute(2), 10), ("llama", _minute(7), 20)]
    write_count_batch(registered, _batch(rows, now, step=300))
    five = read_counts(registered, ["llama"], _minute(2), _minute(12), step_seconds=300)
    assert five["y"].tolist() == [10.0, 20.0]
    one = read_counts(registered, ["llama"], _minute(2), _minute(4), step_seconds=60)
    assert one["y"].isna().all()


def test_rows_land_in_daily_partitions(registered, now):
    write_count_batch(registered, _batch([("llama", _minute(0), 1), ("llama", _minute(3), 1)], now))
    with registered.connect() as conn:
        parts = conn.execute(text("SELECT tableoid::regclass::text FROM invocations ORDER BY minute")).scalars().all()
    assert parts == ["invocations_20261128", "invocations_20261129"]


@pytest.mark.parametrize("step", [60, 120])
def test_many_models_read_as_text_blocks_equal_a_row_fetch(engine, now, monkeypatch, step):
    """Above FETCH_CELLS_MAX_MODELS the cells come as server-built text blocks; they must equal the row fetch."""
    from forecaster.store import invocations

    rng = np.random.default_rng(7)
    ids = [f"m{k:02d}" for k in range(40)]
    rows = [(m, _minute(i), int(rng.poisson(1.5))) for m in ids for i in range(30)]
    windows = pd.DataFrame({"unique_id": ids, "start": _minute(0), "end": _minute(30)})
    write_count_batch(engine, _batch([r for r in rows if r[2] > 0], now, windows=windows), register_models=True)
    monkeypatch.setattr(invocations, "CELL_BLOCK_CELLS", 16 * 30)  # 16 models a block: several, one partial
    # fewer, longer steps: more models a block
    assert invocations._block_models({"start": _minute(0), "end": _minute(30), "step": step}) == 16 * step // 60
    _, _, blocks = invocations.read_grid(engine, ids, _minute(0), _minute(30), step_seconds=step)
    monkeypatch.setattr(invocations, "FETCH_CELLS_MAX_MODELS", 10**6)
    _, _, fetched = invocations.read_grid(engine, ids, _minute(0), _minute(30), step_seconds=step)
    assert np.nansum(blocks) == sum(r[2] for r in rows) and not np.isnan(blocks).any()
    np.testing.assert_array_equal(blocks, fetched)
