"""The forecast job's in-memory history: incremental refreshes must equal a full read of the store."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd

from forecaster.ingest.validate import build_count_batch
from forecaster.jobs.forecasting import history
from forecaster.jobs.history import HistoryCache
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.invocations import write_count_batch

T0 = datetime(2026, 11, 28, 22, 0, tzinfo=timezone.utc)
LOOKBACK = 120


def _push(engine, now, model_ids, first: int, last: int, seed: int, *, windows=None) -> None:
    """Counts for minutes ``first..last-1`` (relative to T0) of ``model_ids``, zero minutes omitted."""
    rng = np.random.default_rng(seed)
    rows = [(m, T0 + timedelta(minutes=i), int(rng.poisson(2.0)))
            for m in model_ids for i in range(first, last)]
    raw = pd.DataFrame([r for r in rows if r[2] > 0], columns=["unique_id", "ds", "y"])
    windows = pd.DataFrame({"unique_id": model_ids, "start": T0 + timedelta(minutes=first),
                            "end": T0 + timedelta(minutes=last)})
    write_count_batch(engine, build_count_batch(raw, source="push", step_seconds=60, now=now, windows=windows))


def _same(cached, full) -> None:
    assert list(cached.ids) == list(full.ids) and cached.start == full.start
    np.testing.assert_array_equal(cached.values, full.values)


def test_incremental_refresh_equals_a_full_read(engine):
    now = T0 + timedelta(hours=6)
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m) for m in ("a", "b", "c", "new")])
    _push(engine, now, ["a", "b", "c"], 0, 200, seed=1)
    cache = HistoryCache(reread_min=5, full_refresh_min=60)
    ids = ["a", "b", "c", "new"]
    end = T0 + timedelta(minutes=150)
    _same(cache.panel(engine, ids, end=end, minutes=LOOKBACK), history(engine, ids, end=end, minutes=LOOKBACK))
    assert cache.last_read["kind"] == "full"

    # two minutes later: new minutes arrived, and a backfill corrected minutes 60-90 (outside the re-read tail)
    _push(engine, now, ["a", "b"], 60, 90, seed=2)
    _push(engine, now, ["new"], 100, 152, seed=3)  # a model that had no data before
    end += timedelta(minutes=2)
    cached = cache.panel(engine, ids, end=end, minutes=LOOKBACK)
    # re-read from the earliest batch window since the last read (minute 60) up to the new end (minute 152)
    assert cache.last_read["kind"] == "incremental" and cache.last_read["minutes"] == 152 - 60
    _same(cached, history(engine, ids, end=end, minutes=LOOKBACK))
    assert "new" in list(cached.ids)

    # a model registered after the last read: only its own history is read in full
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="late")])
    _push(engine, now, ["late"], 40, 152, seed=4)
    ids.append("late")
    end += timedelta(minutes=1)
    cached = cache.panel(engine, ids, end=end, minutes=LOOKBACK)
    assert cache.last_read["new_models"] == 1
    _same(cached, history(engine, ids, end=end, minutes=LOOKBACK))

    # a model removed from the catalogue is dropped; a gap longer than the look-back reads everything again
    ids.remove("b")
    _same(cache.panel(engine, ids, end=end, minutes=LOOKBACK), history(engine, ids, end=end, minutes=LOOKBACK))
    end += timedelta(minutes=LOOKBACK + 1)
    _same(cache.panel(engine, ids, end=end, minutes=LOOKBACK), history(engine, ids, end=end, minutes=LOOKBACK))
    assert cache.last_read["kind"] == "full"


def test_periodic_full_refresh_and_clock_going_back(engine):
    now = T0 + timedelta(hours=6)
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="a")])
    _push(engine, now, ["a"], 0, 300, seed=5)
    cache = HistoryCache(reread_min=5, full_refresh_min=10)
    end = T0 + timedelta(minutes=150)
    kinds = []
    for minute in range(12):
        cache.panel(engine, ["a"], end=end + timedelta(minutes=minute), minutes=LOOKBACK)
        kinds.append(cache.last_read["kind"])
    assert kinds == ["full"] + ["incremental"] * 9 + ["full", "incremental"]
    cache.panel(engine, ["a"], end=end, minutes=LOOKBACK)  # the clock went back: nothing cached is trusted
    assert cache.last_read["kind"] == "full"
