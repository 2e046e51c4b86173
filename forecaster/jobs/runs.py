"""Run a job at most once per time slot, recording the outcome in ``job_runs``.

APScheduler decides *when*; this module makes sure a slot (the minute of an
every-minute job, the day of the nightly one) runs once even if a restarted
scheduler, or a second scheduler replica, fires it again, and that a job runs
in one process at a time:

* the run holds the job's session-level advisory lock
  (``pg_try_advisory_lock``) on a connection of its own from before its claim
  until its outcome is recorded: a scheduler in another process that fires the
  job meanwhile (the next slot of a job that outlasts its period) skips it, as
  ``max_instances=1`` does inside one process; the lock goes with the holder's
  connection when its process dies;
* the claim names its process and holds a lease of :data:`LEASE_S` seconds that
  a heartbeat thread extends on that connection while the job runs. A claim
  past its lease, or of a process of this host that is gone, is dead: it is
  marked ``abandoned`` (``/metrics`` reports it, and ``PrewarmJobFailing``
  fires on it) and its slot may run again (``attempt`` 2). The first run of a
  process marks the dead claims of every job that no process runs;
* an outcome that cannot be recorded (the database went away for longer than
  the slot's wait) is kept in memory and recorded by the next run that reaches
  the database; if the process dies first, the lease runs out.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import Connection, Engine

from forecaster.settings import Settings
from forecaster.store.db import ping
from forecaster.store.job_runs import (
    Claim,
    abandon_claims,
    abandon_dead_claims,
    claim_slot,
    extend_lease,
    finish_slot,
    job_lock_held,
    release_job_lock,
    try_job_lock,
    live_claim_elsewhere,
    owner_is_gone,
    process_owner,
    running_claims,
)

log = logging.getLogger(__name__)

#: Seconds a claim lives without a heartbeat; the heartbeat extends it every third of that. A run whose process was
#: killed reads ``abandoned`` on ``/metrics`` this long after, and its slot can be claimed again.
LEASE_S = 60.0

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



class _JobLock:
    """A job's session-level advisory lock on a connection of its own (out of the pool, autocommit), and the
    heartbeat thread that extends the run's lease on it.

    Closing the connection frees the lock; so does the server when the holder's process or connection dies. When
    the heartbeat finds the connection gone (the database restarted), it opens another and takes the lock again.
    """

    def __init__(self, engine: Engine, job_name: str, owner: str, lease_s: float) -> None:
        self.engine = engine
        self.job_name = job_name
        self.owner = owner
        self.lease_s = lease_s
        self.conn: Connection | None = None
        self.locked = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> bool:
        """Take the lock on a new connection (True), or close it again when another session holds it (False)."""
        self.close()
        conn = self.engine.connect()
        try:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.detach()  # its own: not a pool slot for the whole run, really closed (and unlocked) at the end
            self.conn = conn
            self.locked = try_job_lock(conn, self.job_name)
        except BaseException:
            self.close()
            raise
        return self.locked

    def close(self) -> None:
        conn, locked, self.conn, self.locked = self.conn, self.locked, None, False
        if conn is None:
            return
        try:
            if locked:  # at once: a closed session's backend lets go of its locks only as it exits, a bit later
                release_job_lock(conn, self.job_name)
        except Exception:  # noqa: BLE001 - a dead connection: the server has dropped the lock with it
            log.debug("job %s: unlocking failed", self.job_name, exc_info=True)
        finally:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                log.debug("job %s: closing its lock connection failed", self.job_name, exc_info=True)

    def start_heartbeat(self, slot: datetime) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, args=(slot,), daemon=True,
                                        name=f"job-lease-{self.job_name}")
        self._thread.start()

    def stop_heartbeat(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _beat(self, slot: datetime) -> None:
        every_s = max(self.lease_s / 3, 0.05)
        pause = every_s
        lost = False
        while not self._stop.wait(pause):
            try:
                if self.conn is None:
                    if not self.acquire():
                        log.warning("job %s slot %s: took a new connection after losing the database, but another "
                                    "process holds the job's lock now; this run goes on", self.job_name,
                                    slot.isoformat())
                elif not self.locked:
                    self.locked = try_job_lock(self.conn, self.job_name)
                if not extend_lease(self.conn, self.job_name, slot, owner=self.owner, lease_s=self.lease_s) \
                        and not lost:
                    lost = True
                    log.warning("job %s slot %s: its claim was taken over after its lease ran out; this run goes on "
                                "and its outcome will not be recorded", self.job_name, slot.isoformat())
                pause = every_s
            except Exception as exc:  # noqa: BLE001 - the heartbeat keeps trying while the job runs
                log.warning("job %s slot %s: lease not extended (%s: %s); trying again", self.job_name,
                            slot.isoformat(), type(exc).__name__, exc)
                self.close()
                pause = min(every_s, 1.0)


@dataclass
class _Outcome:
    """A run's outcome that could not be recorded yet."""

    owner: str
    status: str
    detail: dict
    ended: float  # time.monotonic() when the run ended


#: Outcomes the database was away for, keyed by (database, job, slot): recorded by the next run that reaches it.
_unrecorded: dict[tuple[str, str, datetime], _Outcome] = {}
_unrecorded_lock = threading.Lock()
#: The pid whose first run marked the dead claims of every job (see :func:`abandon_dead_runs`).
_swept: dict[str, int] = {}


def record_unrecorded(engine: Engine) -> int:
    """Record the outcomes kept in memory while the database was away; the number recorded (those taken over
    meanwhile are dropped with a warning). Raises when the database is still away (the rest stay kept); an
    outcome the database refuses otherwise is dropped with an error."""
    database = _database_of(engine)
    with _unrecorded_lock:
        pending = [(key, outcome) for key, outcome in _unrecorded.items() if key[0] == database]
    done = 0
    for (_, job_name, slot), outcome in pending:
        try:
            mine = finish_slot(engine, job_name, slot, status=outcome.status, detail=outcome.detail,
                               owner=outcome.owner, ended_s_ago=time.monotonic() - outcome.ended)
        except Exception as exc:
            if _is_outage(exc):
                raise
            log.exception("job %s slot %s: its outcome (%s), kept while the database was away, cannot be recorded",
                          job_name, slot.isoformat(), outcome.status)
            mine = None
        with _unrecorded_lock:
            _unrecorded.pop((database, job_name, slot), None)
        if mine is None:
            continue
        if mine:
            done += 1
            log.warning("job %s slot %s: its outcome (%s), kept while the database was away, is recorded now",
                        job_name, slot.isoformat(), outcome.status)
        else:
            log.warning("job %s slot %s: its outcome (%s) was not recorded: the slot was taken over after its lease "
                        "ran out", job_name, slot.isoformat(), outcome.status)
    return done


def _database_of(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=True)


def abandon_dead_runs(engine: Engine) -> dict[str, list[datetime]]:
    """Mark ``abandoned`` the dead claims of the jobs that no process runs now (their lock is free): claims past
    their lease, or of a process of this host that is gone (a previous life of this container). A job whose lock
    is held is left to its holder, which marks its dead claims when it next runs. Returns the slots marked, by job.

    The locks are read from ``pg_locks``, not taken: taking one would make that job's run, fired at that moment,
    skip its slot as if the job ran elsewhere.
    """
    owner = process_owner()
    marked: dict[str, list[datetime]] = {}
    for job_name, claims in running_claims(engine, owner=owner).items():
        if job_lock_held(engine, job_name):
            continue
        dead = [(slot, other) for slot, other, expired in claims if expired or owner_is_gone(other, owner)]
        if dead and (slots := abandon_claims(engine, job_name, dead)):
            marked[job_name] = slots
    if marked:
        log.warning("claims of processes that died mid-run marked abandoned: %s",
                    {job: [slot.isoformat() for slot in slots] for job, slots in marked.items()})
    return marked


def _sweep_once(engine: Engine) -> None:
    """:func:`abandon_dead_runs` on the first run of this process that reaches the database."""
    if _swept.get("pid") == os.getpid():
        return
    try:
        abandon_dead_runs(engine)
        _swept["pid"] = os.getpid()
    except Exception as exc:  # noqa: BLE001 - the next run tries again
        log.warning("dead claims not marked yet: %s: %s", type(exc).__name__, exc)


#: What starting a run found instead of a claim: the job's lock held by another session (it runs elsewhere).
_LOCKED = "locked"

#: One lock per job name in this process. The advisory lock is per database session, and each run takes it on a
#: connection of its own, so two runs of one job in this process (the scheduler's catch-up run at start,
#: ``<name>@start``, and the job's next boundary) would see each other as "another process" and the later one
#: would skip its slot. The later run waits for the earlier one here instead, then claims its own slot.
_RUNNING_HERE: dict[str, threading.Lock] = {}
_RUNNING_HERE_GUARD = threading.Lock()


def _running_here(job_name: str) -> threading.Lock:
    with _RUNNING_HERE_GUARD:
        return _RUNNING_HERE.setdefault(job_name, threading.Lock())


def run_once(engine: Engine, settings: Settings, spec: JobSpec, *, now: datetime,
             sleep: Callable[[float], None] = time.sleep, db_wait_s: float | None = None,
             lease_s: float | None = None) -> dict | None:
    """Run ``spec`` for the slot containing ``now`` unless that slot already ran or the job runs elsewhere.

    A failing job is recorded as failed with its error; it never raises into
    the scheduler, so one bad run does not stop the others.

    The run holds the job's advisory lock from before the claim until its
    outcome is recorded: when another process holds it (runs the job, any
    slot), this one skips; a run of the same job in this process is waited
    for instead (:data:`_RUNNING_HERE`). Under the lock, the job's dead claims are marked
    ``abandoned`` and a dead claim of this slot is taken over. While the job
    runs, a heartbeat extends the claim's lease (``lease_s``, default
    :data:`LEASE_S`).

    While the database is away (an outage, a restart) the slot is not lost:
    taking the lock and claiming the slot, the job itself (when it failed on
    the outage) and recording the outcome are tried again with back-off for up
    to ``db_wait_s`` seconds in all (default ``PREWARM_JOB_DB_WAIT_S``). The job
    is rerun only when it failed on the outage; its writes are whole
    transactions, so a rerun never double-counts. An outcome still unrecorded
    when the wait is spent is kept in memory and recorded by the next run that
    reaches the database. The claim in ``job_runs`` still makes a slot run at
    most once.

    Args:
        sleep: injectable so that tests step a clock instead of sleeping.
        db_wait_s: overrides the setting.
        lease_s: overrides :data:`LEASE_S`.

    Returns:
        The job's summary (with ``seconds``), or None when the slot was taken,
        the job runs in another process, or the database stayed away for the
        whole wait.
    """
    with _running_here(spec.name):  # a run of this job in this process first (see _RUNNING_HERE)
        return _run_once(engine, settings, spec, now=now, sleep=sleep, db_wait_s=db_wait_s, lease_s=lease_s)


def _run_once(engine: Engine, settings: Settings, spec: JobSpec, *, now: datetime, sleep: Callable[[float], None],
              db_wait_s: float | None, lease_s: float | None) -> dict | None:
    slot = slot_for(now, spec.every_s, spec.offset_s)
    budget = settings.job_db_wait_s if db_wait_s is None else db_wait_s
    lease_s = LEASE_S if lease_s is None else lease_s
    waiter = _Waiter(budget, sleep)
    what = f"job {spec.name} slot {slot.isoformat()}"
    owner = process_owner()
    lock = _JobLock(engine, spec.name, owner, lease_s)

    def start() -> Claim | tuple | str | None:
        # the outcomes kept while the database was away first: a slot of one of them is not the dead claim of a
        # run to take over, and a job whose lock is held elsewhere writes them too
        record_unrecorded(engine)
        if not lock.acquire():
            return _LOCKED
        abandon_dead_claims(lock.conn, spec.name, owner=owner)
        elsewhere = live_claim_elsewhere(lock.conn, spec.name, owner=owner)
        if elsewhere is not None:
            return tuple(elsewhere)
        return claim_slot(lock.conn, spec.name, slot, owner=owner, lease_s=lease_s)

    try:
        try:
            claim = _with_database(start, waiter, what)
        except Exception as exc:  # noqa: BLE001 - the scheduler thread must survive; logged with the reason
            log.error("%s not run: could not claim it (%s: %s)", what, type(exc).__name__, exc)
            return None
        _sweep_once(engine)
        if isinstance(claim, str):
            log.info("job %s: runs in another process (its lock is held); slot %s skipped", spec.name,
                     slot.isoformat())
            return None
        if isinstance(claim, tuple):
            log.warning("job %s: %s runs its slot %s within its lease, without the job's lock (it lost its "
                        "connection); slot %s skipped", spec.name, claim[0], claim[1].isoformat(), slot.isoformat())
            return None
        if claim is None:
            log.info("job %s: slot %s already ran, skipping", spec.name, slot.isoformat())
            return None
        if claim.took_over:
            log.warning("%s: taken over from %s, whose claim died (attempt %d)", what, claim.took_over, claim.attempt)
        lock.start_heartbeat(slot)
        try:
            status, detail = _run_job(engine, settings, spec, now, slot, waiter, what, claim)
        finally:
            lock.stop_heartbeat()
        _record(engine, spec.name, slot, owner, status, detail, waiter, what)
        return detail
    finally:
        lock.close()


def _run_job(engine: Engine, settings: Settings, spec: JobSpec, now: datetime, slot: datetime, waiter: _Waiter,
             what: str, claim: Claim) -> tuple[str, dict]:
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
    if claim.attempt > 1:
        detail["claim_attempt"] = claim.attempt
    return status, detail


def _record(engine: Engine, job_name: str, slot: datetime, owner: str, status: str, detail: dict, waiter: _Waiter,
            what: str) -> None:
    """Record the outcome within what is left of the slot's wait (one try at least); kept in memory otherwise."""
    ended = time.monotonic()
    try:
        mine = _with_database(lambda: finish_slot(engine, job_name, slot, status=status, detail=detail, owner=owner,
                                                  ended_s_ago=time.monotonic() - ended), waiter, what)
    except Exception as exc:  # noqa: BLE001
        with _unrecorded_lock:
            _unrecorded[(_database_of(engine), job_name, slot)] = _Outcome(owner, status, detail, ended)
        log.error("%s ran (%s) but its outcome could not be recorded yet (%s: %s): kept, the next run that reaches "
                  "the database records it", what, status, type(exc).__name__, exc)
        return
    if not mine:
        log.warning("%s ran (%s), but its claim was taken over after its lease ran out: outcome not recorded", what,
                    status)
