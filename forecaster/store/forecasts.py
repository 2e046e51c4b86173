"""Forecasts in the store: written each minute by the forecast job, read by the API and planner.

A forecast row is one model's demand in one target minute as seen at
``issued_at``: the point forecast, the probability of any invocation, and the
quantiles as a JSON object ``{"0.1": x, "0.5": y, "0.9": z}`` (invocations per
minute).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from datetime import datetime

import numpy as np
import pandas as pd
from sqlalchemy import Connection, Engine, text


def quantile_columns(frame: pd.DataFrame) -> dict[str, float]:
    """Map ``q0.9``-style column names to their levels."""
    levels = {}
    for column in frame.columns:
        if isinstance(column, str) and column.startswith("q"):
            try:
                levels[column] = float(column[1:])
            except ValueError:
                continue
    return levels


def write_forecasts(
    engine: Engine,
    frame: pd.DataFrame,
    *,
    issued_at: datetime,
    model_version_id: str | None,
) -> int:
    """Store one forecast run with COPY; re-running the same ``issued_at`` replaces it.

    Args:
        frame: ``unique_id, ds`` (target minute, UTC), ``point``, optional
            ``p_any``, and quantile columns named ``q<level>`` (``q0.9``).
        issued_at: when the forecast was made (the job's ``now``).
        model_version_id: the registry version that produced it.

    Returns:
        Rows written.
    """
    if frame.empty:
        return 0
    levels = quantile_columns(frame)
    q = frame[list(levels)].to_numpy(dtype="float64") if levels else np.empty((len(frame), 0))
    if np.isnan(frame["point"].to_numpy(dtype="float64")).any() or np.isnan(q).any():
        raise ValueError("forecast has NaN values; the forecast job must fall back, not store NaN")
    names = [f"{levels[c]:g}" for c in levels]
    quantiles_json = [json.dumps(dict(zip(names, map(float, row)))) for row in q]
    p_any = frame["p_any"].to_numpy(dtype="float64") if "p_any" in frame else np.full(len(frame), np.nan)
    out = pd.DataFrame(
        {
            "model_id": frame["unique_id"].to_numpy(),
            "issued_at": issued_at.isoformat(),
            "target_minute": np.char.add(
                np.datetime_as_string(pd.to_datetime(frame["ds"], utc=True).dt.tz_convert(None).to_numpy(),
                                      unit="s"), "+00:00"),
            "model_version_id": model_version_id if model_version_id is not None else "\\N",
            "point": frame["point"].to_numpy(dtype="float64"),
            "p_any": ["\\N" if np.isnan(v) else repr(float(v)) for v in p_any],
            "quantiles": quantiles_json,
        }
    )
    buffer = io.StringIO()
    # JSON text contains no tabs or newlines; backslashes in it would need escaping for COPY text format.
    out.to_csv(buffer, sep="\t", header=False, index=False, quoting=3, escapechar=None)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM forecasts WHERE issued_at = :t AND model_id = ANY(CAST(:ids AS text[]))"),
                     {"t": issued_at, "ids": sorted(set(out["model_id"]))})
        raw = conn.connection.driver_connection
        with raw.cursor() as cur, cur.copy(
            "COPY forecasts (model_id, issued_at, target_minute, model_version_id, point, p_any, quantiles) "
            "FROM STDIN"
        ) as copy:
            copy.write(buffer.getvalue())
    return len(out)


@dataclass(frozen=True)
class StoredForecast:
    """The latest forecast of one model."""

    model_id: str
    issued_at: datetime
    model_version_id: str | None
    frame: pd.DataFrame  # target_minute, point, p_any, q<level> columns


def latest_forecast(conn: Connection, *, model_id: str, horizon_min: int | None = None) -> StoredForecast | None:
    """The most recent forecast run of ``model_id`` (first ``horizon_min`` minutes), or None."""
    issued = conn.execute(
        text("SELECT max(issued_at) FROM forecasts WHERE model_id = :m"), {"m": model_id}
    ).scalar()
    if issued is None:
        return None
    rows = conn.execute(
        text("SELECT target_minute, point, p_any, quantiles, model_version_id FROM forecasts "
             "WHERE model_id = :m AND issued_at = :t ORDER BY target_minute"
             + (" LIMIT :h" if horizon_min else "")),
        {"m": model_id, "t": issued, **({"h": horizon_min} if horizon_min else {})},
    ).all()
    frame = pd.DataFrame({"target_minute": [r[0] for r in rows], "point": [r[1] for r in rows],
                          "p_any": [r[2] for r in rows]})
    for level in sorted({k for r in rows for k in r[3]}, key=float):
        frame[f"q{level}"] = [r[3].get(level) for r in rows]
    return StoredForecast(model_id=model_id, issued_at=issued, model_version_id=rows[0][4] if rows else None,
                          frame=frame)
