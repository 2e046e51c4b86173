"""Run a job at most once per time slot, recording the outcome in ``job_runs``.

APScheduler decides *when*; this module makes sure a slot (the minute of an
every-minute job, the day of the nightly one) runs once even if a restarted
scheduler, or a second scheduler replica, fires it again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import Engine

from forecaster.settings import Settings
from forecaster.store.job_runs import claim_slot, finish_slot

log = logging.getLogger(__name__)

JobFunction = Callable[[Engine, Settings, datetime], dict]


@dataclass(frozen=True)
class JobSpec:
    """A scheduled job: its function and how often it runs (seconds between slots)."""

    name: str
    function: JobFunction
    every_s: int
    offset_s: int = 0  # slot start within the period, e.g. 03:00 for a nightly job


def slot_for(now: datetime, every_s: int, offset_s: int = 0) -> datetime:
    """The start of the slot that ``now`` falls in (UTC)."""
    epoch = now.astimezone(timezone.utc).timestamp() - offset_s
    start = (epoch // every_s) * every_s + offset_s
    return datetime.fromtimestamp(start, tz=timezone.utc)


def run_once(engine: Engine, settings: Settings, spec: JobSpec, *, now: datetime) -> dict | None:
    """Run ``spec`` for the slot containing ``now`` unless that slot already ran.

    A failing job is recorded as failed with its error; it never raises into
    the scheduler, so one bad run does not stop the others.

    Returns:
        The job's summary (with ``seconds``), or None when the slot was taken.
    """
    slot = slot_for(now, spec.every_s, spec.offset_s)
    if not claim_slot(engine, spec.name, slot):
        log.info("job %s: slot %s already ran, skipping", spec.name, slot.isoformat())
        return None
    started = time.perf_counter()
    try:
        detail = spec.function(engine, settings, now) or {}
        status = "ok"
    except Exception as exc:  # recorded, not swallowed: status failed with the error text
        log.exception("job %s failed for slot %s", spec.name, slot.isoformat())
        detail, status = {"error": f"{type(exc).__name__}: {exc}"}, "failed"
    detail = {**detail, "seconds": round(time.perf_counter() - started, 3)}
    finish_slot(engine, spec.name, slot, status=status, detail=detail)
    return detail
