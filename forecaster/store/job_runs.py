"""``job_runs``: one row per (job, slot), claimed before the job runs, so a slot never runs twice."""

from __future__ import annotations

import json
from datetime import datetime

from sqlalchemy import Engine, text


def claim_slot(engine: Engine, job_name: str, slot: datetime) -> bool:
    """Record the start of ``job_name`` for ``slot``; False if it ran (or runs) already."""
    with engine.begin() as conn:
        claimed = conn.execute(
            text("INSERT INTO job_runs (job_name, slot) VALUES (:n, :s) ON CONFLICT DO NOTHING RETURNING job_name"),
            {"n": job_name, "s": slot},
        ).first()
    return claimed is not None


def finish_slot(engine: Engine, job_name: str, slot: datetime, *, status: str, detail: dict) -> None:
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE job_runs SET status = :st, finished_at = now(), detail = CAST(:d AS jsonb) "
                 "WHERE job_name = :n AND slot = :s"),
            {"st": status, "d": _json(detail), "n": job_name, "s": slot},
        )


def _json(detail: dict) -> str:
    return json.dumps(detail, default=str)
