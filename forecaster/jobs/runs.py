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
from forecaster.store.db import ping
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


def _is_outage(exc: BaseException) -> bool:
    """True when ``exc`` (or an error it was raised from) says the database is away, not that the job is wrong."""
    from sqlalchemy.exc import DBAPIError

    from forecaster.store.db import DatabaseUnavailable, is_transient

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DatabaseUnavailable) or (isinstance(exc, DBAPIError) and is_transient(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class _Waiter:
    """Back-off while the database is away, within one budget of seconds shared by the whole slot."""

    def __init__(self, budget_s: float, sleep: Callable[[float], None]) -> None:
        self.left_s = budget_s
        self.sleep = sleep
        self.delay_s = 0.5

    def wait(self, what: str, exc: BaseException) -> bool:
        """Sleep before the next try; False when the budget is spent."""
        if self.left_s <= 0:
            return False
        pause = min(self.delay_s, self.left_s)
        log.warning("%s: database unavailable (%s); trying again in %.1f s (%.0f s left of the slot's wait)",
                    what, type(exc).__name__, pause, self.left_s)
        self.sleep(pause)
        self.left_s -= pause
        self.delay_s = min(self.delay_s * 2, 10.0)
        return True


def _wait_for_database(engine: Engine, waiter: _Waiter, what: str, exc: BaseException) -> bool:
    """Back off until ``SELECT 1`` answers (True) or the slot's wait is spent (False): the job is not rerun blind."""
    while waiter.wait(what, exc):
        try:
            ping(engine)
            return True
        except Exception as again:  # noqa: BLE001 - only outages keep waiting
            if not _is_outage(again):
                return False
            exc = again
    return False


def _with_database(operation: Callable[[], object], waiter: _Waiter, what: str):
    while True:
        try:
            return operation()
        except Exception as exc:
            if not _is_outage(exc) or not waiter.wait(what, exc):
                raise


def run_once(engine: Engine, settings: Settings, spec: JobSpec, *, now: datetime,
             sleep: Callable[[float], None] = time.sleep, db_wait_s: float | None = None) -> dict | None:
    """Run ``spec`` for the slot containing ``now`` unless that slot already ran.

    A failing job is recorded as failed with its error; it never raises into
    the scheduler, so one bad run does not stop the others.

    While the database is away (an outage, a restart) the slot is not lost:
    claiming it, the job itself (when it failed on the outage) and recording
    the outcome are tried again with back-off for up to ``db_wait_s`` seconds
    in all (default ``PREWARM_JOB_DB_WAIT_S``). The job is rerun only when it
    failed on the outage; its writes are whole transactions, so a rerun never
    double-counts. The claim in ``job_runs`` still makes a slot run at most
    once.

    Args:
        sleep: injectable so that tests step a clock instead of sleeping.
        db_wait_s: overrides the setting.

    Returns:
        The job's summary (with ``seconds``), or None when the slot was taken
        (or the database stayed away for the whole wait).
    """
    slot = slot_for(now, spec.every_s, spec.offset_s)
    budget = settings.job_db_wait_s if db_wait_s is None else db_wait_s
    waiter = _Waiter(budget, sleep)
    what = f"job {spec.name} slot {slot.isoformat()}"
    try:
        claimed = _with_database(lambda: claim_slot(engine, spec.name, slot), waiter, what)
    except Exception as exc:  # noqa: BLE001 - the scheduler thread must survive; logged with the reason
        log.error("%s not run: could not claim it (%s: %s)", what, type(exc).__name__, exc)
        return None
    if not claimed:
        log.info("job %s: slot %s already ran, skipping", spec.name, slot.isoformat())
        return None
    started = time.perf_counter()
    attempts = 0
    while True:
        attempts += 1
        try:
            detail = spec.function(engine, settings, now) or {}
            status = "ok"
            break
        except Exception as exc:  # recorded, not swallowed: status failed with the error text
            if _is_outage(exc) and _wait_for_database(engine, waiter, what, exc):
                continue  # the database went away under the job: run it again, once, now that it is back
            log.exception("job %s failed for slot %s", spec.name, slot.isoformat())
            detail, status = {"error": f"{type(exc).__name__}: {exc}"}, "failed"
            break
    detail = {**detail, "seconds": round(time.perf_counter() - started, 3)}
    if attempts > 1:
        detail["attempts"] = attempts
    try:
        _with_database(lambda: finish_slot(engine, spec.name, slot, status=status, detail=detail), waiter, what)
    except Exception as exc:  # noqa: BLE001
        log.error("%s ran (%s) but its outcome could not be recorded: %s: %s", what, status, type(exc).__name__, exc)
    return detail
