"""Days of history for a report's tests and benchmark, made from the shipped one-day sample.

The shipped sample (:data:`forecaster.data.AZURE2019_TOP100`) holds one day of the 100 busiest Azure Functions
2019 functions. :func:`sample_history` makes ``days`` days of ``models`` of them: day ``d`` of a function is its
own day resampled, each minute's count drawn from a Poisson law with the observed count as its mean (seed ``d``),
so every day keeps the function's daily shape and sparsity (a silent minute stays silent) but none repeats
another exactly. ``models`` beyond 100 reuse the functions under new ids (``<hash>~k``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from forecaster.data import AZURE2019_TOP100, sample_path
from forecaster.ingest.traces import read_trace

SAMPLE_START = pd.Timestamp("2019-07-15", tz="UTC")


def sample_history(models: int, days: int, *, seed: int = 0, start: pd.Timestamp = SAMPLE_START) -> pd.DataFrame:
    """A long ``unique_id, ds, y`` frame of ``days`` x 1,440 minutes for ``models`` series (non-zero rows only)."""
    raw = read_trace(sample_path(AZURE2019_TOP100), fmt="azure2019").raw
    raw = raw.assign(y=pd.to_numeric(raw["y"], errors="coerce").fillna(0.0))
    ids = sorted(raw["unique_id"].astype(str).unique(), key=lambda m: -raw.loc[raw["unique_id"] == m, "y"].sum())
    grid = raw.pivot_table(index="unique_id", columns="ds", values="y", aggfunc="sum", fill_value=0.0)
    base = grid.loc[ids].to_numpy(dtype="float64")  # busiest first
    minutes = base.shape[1]
    frames = []
    for d in range(days):
        rng = np.random.default_rng(seed + d)
        for k in range(models):
            counts = rng.poisson(base[k % len(ids)])
            cols = np.flatnonzero(counts)
            name = ids[k % len(ids)] + ("" if k < len(ids) else f"~{k // len(ids)}")
            frames.append(pd.DataFrame({
                "unique_id": name,
                "ds": start + pd.to_timedelta(d * minutes + cols, unit="min"),
                "y": counts[cols].astype(np.int64)}))
    return pd.concat(frames, ignore_index=True).sort_values(["unique_id", "ds"], ignore_index=True)


def sample_windows(history: pd.DataFrame, days: int, *, start: pd.Timestamp = SAMPLE_START) -> pd.DataFrame:
    """Coverage windows for :func:`sample_history`: every series covers the whole ``days`` (silent minutes are
    known zeros, not unknown)."""
    ids = history["unique_id"].unique()
    return pd.DataFrame({"unique_id": ids, "start": start, "end": start + pd.Timedelta(days=days)})
