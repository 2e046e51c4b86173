"""Backtest runs and their per-series, per-horizon results (``backtest_runs``, ``backtest_results``)."""

from __future__ import annotations

import io
import json
from datetime import datetime

import numpy as np
import pandas as pd
from sqlalchemy import Engine, text

from forecaster.store.db import driver_errors

RESULT_COLUMNS = ["method", "unique_id", "h", "busy", "points", "mae", "mase", "wql", "coverage_q90",
                  "spike_recall", "spikes"]


def ingested_window(engine: Engine, step_seconds: int) -> tuple[datetime, datetime]:
    """The span of all coverage at this step width."""
    with engine.connect() as conn:
        row = conn.execute(text("SELECT min(lower(ranges)), max(upper(ranges)) FROM coverage "
                                "WHERE :step % step_seconds = 0"), {"step": step_seconds}).one()
    if row[0] is None:
        raise ValueError(f"nothing ingested at a {step_seconds} s step")
    return row[0], row[1]


def store_result(engine: Engine, table: pd.DataFrame, summary: list[dict], *, protocol: dict, start: datetime,
                 end: datetime, step_seconds: int) -> int:
    """One backtest run and its per-series table (``RESULT_COLUMNS``, bulk COPY) in one transaction."""
    table = table.reindex(columns=RESULT_COLUMNS).copy()
    table = table.replace([np.inf, -np.inf], np.nan)
    for column in ("h", "points", "spikes"):
        table[column] = table[column].astype("int64")
    buffer = io.StringIO()
    with engine.begin() as conn:
        run_id = conn.execute(
            text("INSERT INTO backtest_runs (data_start, data_end, step_seconds, protocol, summary) "
                 "VALUES (:s, :e, :step, CAST(:p AS jsonb), CAST(:sm AS jsonb)) RETURNING id"),
            {"s": start, "e": end, "step": step_seconds, "p": json.dumps(protocol, default=str),
             "sm": json.dumps(summary)},
        ).scalar_one()
        table.insert(0, "run_id", run_id)
        table.to_csv(buffer, sep="\t", header=False, index=False, na_rep="\\N")
        raw = conn.connection.driver_connection
        with driver_errors(conn, "COPY backtest_results"), raw.cursor() as cur, cur.copy(
            f"COPY backtest_results (run_id, {', '.join(RESULT_COLUMNS)}) FROM STDIN "
            "(FORMAT csv, DELIMITER E'\\t', NULL '\\N')"  # CSV format: an id's backslash is not an escape
        ) as copy:
            copy.write(buffer.getvalue())
    return run_id
