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


# --- writes at different step widths ---------------------------------------------------------------------------

TEN = datetime(2026, 11, 28, 10, 0, tzinfo=timezone.utc)


def _ten(minute: int) -> datetime:
    return TEN + timedelta(minutes=minute)


def _window(model_id: str, first: int, end: int) -> pd.DataFrame:
    return pd.DataFrame({"unique_id": [model_id], "start": [_ten(first)], "end": [_ten(end)]})


def _read_ten(engine, model_id: str, step: int) -> list[float]:
    return read_counts(engine, [model_id], _ten(0), _ten(15), step_seconds=step)["y"].tolist()


@pytest.mark.parametrize("first, end", [(2, 8), (0, 2), (3, 12)])
def test_minutes_over_five_minute_data_never_double_count_or_invent(registered, now, first, end):
    """The audit's case: a 5-minute trace of 50/50/50 for 10:00-10:15, then the same traffic per minute (10 a
    minute) for part of it. The 60 s window used to leave the 300 s row of a bucket it starts inside (stored 160,
    read [80, 30, 50]) or delete a bucket's whole count while the bucket still read as known. Every read is now
    the truth or unknown; the per-minute model beside it in the same batch is written as usual."""
    write_count_batch(registered, _batch([("llama", _ten(m), 50) for m in (0, 5, 10)], now,
                                         windows=_window("llama", 0, 15), source="trace", step=300))
    windows = pd.concat([_window("llama", first, end), _window("mistral", 0, 15)], ignore_index=True)
    rows = [("llama", _ten(m), 10) for m in range(first, end)] + [("mistral", _ten(m), 1) for m in range(15)]
    result = write_count_batch(registered, _batch(rows, now, windows=windows))

    with registered.connect() as conn:
        assert conn.execute(text("SELECT sum(count) FROM invocations WHERE model_id = 'llama'")).scalar() <= 150
    five, minutes = _read_ten(registered, "llama", 300), _read_ten(registered, "llama", 60)
    assert all(np.isnan(y) or y == 50 for y in five), five
    assert all(np.isnan(y) or y == 10 for y in minutes), minutes
    assert minutes[first:end] == [10.0] * (end - first)  # the window is known
    untouched = [b for b in range(3) if 5 * (b + 1) <= first or 5 * b >= end]
    assert [five[b] for b in untouched] == [50.0] * len(untouched)  # buckets the window does not touch stay
    assert any("unknown now" in w for w in result.warnings) == (first % 5 != 0 or end % 5 != 0)
    assert _read_ten(registered, "mistral", 60) == [1.0] * 15


def test_five_minute_data_over_minutes_is_unknown_at_one_minute(registered, now):
    """A 300 s batch over per-minute coverage used to leave the minutes covered: a minute read showed the bucket's
    total at its first minute and zeros after it."""
    write_count_batch(registered, _batch([("llama", _ten(m), 10) for m in range(15)], now))
    write_count_batch(registered, _batch([("llama", _ten(0), 50), ("llama", _ten(5), 50)], now,
                                         windows=_window("llama", 0, 10), step=300))
    minutes = _read_ten(registered, "llama", 60)
    assert all(np.isnan(y) for y in minutes[:10]), minutes
    assert minutes[10:] == [10.0] * 5
    assert _read_ten(registered, "llama", 300) == [50.0, 50.0, 50.0]
    assert _total(registered) == 150


def test_model_ids_with_backslashes_and_quotes_are_stored_under_their_own_ids(engine, now):
    """COPY's text format reads a backslash as an escape and knows no CSV quotes: ``gpu\\x31``'s counts were
    stored under ``gpu1`` (another model's), and ids with a quote were refused by the foreign key."""
    ids = ["gpu1", "gpu\\x31", 'q"uote', "back\\\\slash", "\\N"]
    rows = [(model_id, _minute(k), k + 1) for k, model_id in enumerate(ids)]
    write_count_batch(engine, _batch(rows, now), register_models=True)
    with engine.connect() as conn:
        stored = dict(conn.execute(text("SELECT model_id, count FROM invocations")).all())
    assert stored == {model_id: k + 1 for k, model_id in enumerate(ids)}


def test_more_new_models_than_one_statement_can_bind_are_registered(engine):
    """22,000 unknown models at once (a generated fleet's trace with --register) exceeded the 65,535 parameters
    one statement may bind; the error had no SQLSTATE and was retried and reported as the database being away."""
    from forecaster.store.catalog import register_missing

    ids = [f"m{k:05d}" for k in range(25_000)]
    with engine.begin() as conn:
        assert register_missing(conn, ids, labels={"registered_by": "test"}) == ids
        assert register_missing(conn, ids[:10] + ["new"]) == ["new"]
        assert conn.execute(text("SELECT count(*) FROM serving_models")).scalar() == 25_001
