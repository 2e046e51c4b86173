"""``prewarm demo``: ingest a real trace and summarise it per model, read back from the store.

Later versions extend this into the whole loop (train, forecast, plan, actuate).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd
from sqlalchemy import Engine, text

from forecaster.data import AZURE2019_TOP100, sample_path
from forecaster.ingest.service import ingest_trace_file
from forecaster.settings import Settings
from forecaster.store.invocations import read_counts


def summarise(counts: pd.DataFrame) -> pd.DataFrame:
    """Per model: total, active share of known minutes, mean and peak per minute, peak-to-mean ratio."""
    known = counts.dropna(subset=["y"])
    grouped = known.groupby("unique_id")["y"]
    table = pd.DataFrame(
        {
            "total": grouped.sum().astype("int64"),
            "known_min": grouped.size(),
            "active_pct": grouped.apply(lambda s: 100.0 * float((s > 0).mean())),
            "mean_per_min": grouped.mean(),
            "peak_per_min": grouped.max().astype("int64"),
        }
    )
    table["peak_to_mean"] = table["peak_per_min"] / table["mean_per_min"].replace(0, np.nan)
    return table.sort_values("total", ascending=False)


def run_demo(
    engine: Engine,
    settings: Settings,
    *,
    now: datetime,
    trace: Path | None = None,
    top: int = 15,
    echo: Callable[[str], None] = print,
) -> pd.DataFrame:
    """Ingest ``trace`` (default: the shipped Azure 2019 top-100 sample) and print a summary."""
    path = trace or sample_path(AZURE2019_TOP100)
    result = ingest_trace_file(engine, settings, path, now=now, register=True)
    with engine.connect() as conn:
        window = conn.execute(
            text("SELECT window_start, window_end FROM ingest_batches WHERE id = :id"), {"id": result.batch_id}
        ).one()
        model_ids = conn.execute(
            text("SELECT model_id FROM coverage WHERE ranges && tstzmultirange(tstzrange(:s, :e))"),
            {"s": window[0], "e": window[1]},
        ).scalars().all()
    state = "already in the store (no change)" if result.duplicate else f"{result.rows_written:,} non-zero rows written"
    echo(f"ingested {path.name}: {result.models:,} models, {result.invocations:,} invocations, "
         f"{result.covered_steps:,} model-steps covered; {state}")
    echo(f"window {window[0]:%Y-%m-%d %H:%M} .. {window[1]:%Y-%m-%d %H:%M} UTC")
    counts = read_counts(engine, list(model_ids), window[0], window[1])
    table = summarise(counts)
    shown = table.head(top)
    echo(f"\n{'model':<18}{'total':>10}{'active%':>9}{'mean/min':>10}{'peak/min':>10}{'peak/mean':>10}")
    for row in shown.itertuples():
        model_id = row.Index
        name = model_id if len(model_id) <= 16 else model_id[:15] + "~"
        echo(f"{name:<18}{int(row.total):>10,}{row.active_pct:>9.1f}{row.mean_per_min:>10.1f}"
             f"{int(row.peak_per_min):>10,}{row.peak_to_mean:>10.1f}")
    if len(table) > top:
        echo(f"... and {len(table) - top} more models")
    echo(f"\nall models: {int(table.total.sum()):,} invocations; median model active "
         f"{table.active_pct.median():.1f}% of minutes; median peak/mean {table.peak_to_mean.median():.1f}")
    return table
