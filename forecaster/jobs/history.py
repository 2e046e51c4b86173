"""The forecast job's history, kept in memory and refreshed incrementally.

At 100,000 models, reading the whole look-back (a day of minutes: ~20 million
stored rows) from PostgreSQL takes longer than the job's one-minute period.
Between two runs only a few minutes change, so :class:`HistoryCache` keeps the
``(models x minutes)`` grid of the last run and, each minute:

* shifts it by the minutes that passed;
* re-reads ``reread_min`` trailing minutes for every model (late data, the
  newest partial minutes, Prometheus' lag);
* re-reads from the earliest window start of every ingest batch committed
  since the previous read (``ingest_batches.id`` above the watermark), so
  backfills and corrections anywhere in the look-back are picked up;
* reads the whole look-back of newly registered models only.

Anything else (another database, a changed look-back, a gap longer than the
look-back, a clock going backwards) reads everything again, and so does every
``full_refresh_min`` minutes, which bounds the effect of a batch that commits
with a smaller id after a larger one (ids are taken when a batch starts, not
when it commits).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from forecaster.forecast.panel import Panel
from forecaster.store.invocations import batch_watermark, earliest_window_since, read_grid

STEP = pd.Timedelta(minutes=1)


@dataclass
class _State:
    database: str
    minutes: int
    end: datetime
    ids: list[str]
    grid: np.ndarray
    watermark: int
    full_read_at: datetime


class HistoryCache:
    """Per-minute history of the serving models for the forecast job (see the module docstring).

    Args:
        reread_min: trailing minutes re-read on every run.
        full_refresh_min: read everything again at least this often.
    """

    def __init__(self, reread_min: int = 15, full_refresh_min: int = 60):
        self.reread_min = reread_min
        self.full_refresh_min = full_refresh_min
        self._state: _State | None = None
        self._lock = threading.Lock()
        self.last_read: dict = {}

    def panel(self, engine: Engine, ids: list[str], *, end: datetime, minutes: int) -> Panel:
        """Counts of ``ids`` over ``[end - minutes, end)``; models with no known minute are left out."""
        with self._lock:
            ids = sorted(set(ids))
            state = self._refresh(engine, ids, end, minutes)
            rows = pd.Index(state.ids).get_indexer(ids)
            known = _any_known(state.grid)[rows]
            grid = state.grid[rows[known]]  # one copy: the next refresh changes the cached grid in place
        start = pd.Timestamp(end - timedelta(minutes=minutes))
        return Panel(np.asarray(ids, dtype=object)[known], start, STEP, grid)

    def _watermark(self, engine: Engine) -> int:
        return batch_watermark(engine)

    def _full(self, engine: Engine, ids: list[str], end: datetime, minutes: int, database: str) -> _State:
        watermark = self._watermark(engine)  # before reading: a batch after it is re-read next time
        _, _, grid = read_grid(engine, ids, end - timedelta(minutes=minutes), end)
        self.last_read = {"kind": "full", "models": len(ids), "minutes": minutes}
        return _State(database, minutes, end, list(ids), grid, watermark, end)

    def _refresh(self, engine: Engine, ids: list[str], end: datetime, minutes: int) -> _State:
        database = engine.url.render_as_string(hide_password=True)
        state = self._state
        shift = None if state is None else int((end - state.end) / timedelta(minutes=1))
        if (state is None or state.database != database or state.minutes != minutes or shift is None
                or shift < 0 or shift >= minutes or end - state.full_read_at >= timedelta(minutes=self.full_refresh_min)):
            self._state = self._full(engine, ids, end, minutes, database)
            return self._state

        # 1. move the window: drop the oldest `shift` minutes, append unknown ones
        if shift:
            state.grid = np.concatenate([state.grid[:, shift:], np.full((len(state.ids), shift), np.nan)], axis=1)
        state.end = end
        # 2. models registered since: their whole look-back; models gone: dropped
        new = sorted(set(ids) - set(state.ids))
        if new or len(ids) != len(state.ids) + len(new):
            _, _, extra = read_grid(engine, new, end - timedelta(minutes=minutes), end) if new else (
                None, None, np.empty((0, minutes)))
            merged_ids = state.ids + new
            merged = np.concatenate([state.grid, extra], axis=0)
            order = pd.Index(merged_ids).get_indexer(ids)
            state.ids, state.grid = list(ids), merged[order]
        # 3. re-read the trailing minutes, and back to the earliest window of any batch since the watermark
        watermark = self._watermark(engine)
        reread_from = end - timedelta(minutes=min(max(self.reread_min, shift), minutes))
        if watermark > state.watermark:
            earliest = earliest_window_since(engine, state.watermark)
            if earliest is not None:
                earliest = pd.Timestamp(earliest).tz_convert("UTC").floor(STEP).to_pydatetime()
                reread_from = max(min(reread_from, earliest), end - timedelta(minutes=minutes))
        _, _, recent = read_grid(engine, state.ids, reread_from, end)
        state.grid[:, minutes - recent.shape[1]:] = recent
        state.watermark = watermark
        self.last_read = {"kind": "incremental", "models": len(state.ids), "minutes": recent.shape[1],
                          "new_models": len(new)}
        return state


ROW_BLOCK = 4096  # rows per block of _any_known (a few MB of booleans each, not one grid-sized temporary)


def _any_known(grid: np.ndarray) -> np.ndarray:
    """Per row: whether any cell is known (not NaN), without a grid-sized boolean temporary."""
    out = np.empty(grid.shape[0], dtype=bool)
    for lo in range(0, grid.shape[0], ROW_BLOCK):
        out[lo:lo + ROW_BLOCK] = ~np.isnan(grid[lo:lo + ROW_BLOCK]).all(axis=1)
    return out
