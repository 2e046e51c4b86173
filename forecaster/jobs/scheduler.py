"""The scheduler: APScheduler 3 with its job store in PostgreSQL, wiring jobs together.

Jobs live in :data:`JOBS`, keyed by name: ingest (every minute), partition
maintenance (hourly), retention (hourly: forecasts, plans, actions, job runs,
invocations), forecast (every minute), plan (every
minute), coldstarts (every minute: replica cold starts observed in the cluster,
see :mod:`forecaster.jobs.coldstarts`), forecast_errors (every minute: the
dashboard's error rollup), nightly retrain; more can be added with
:func:`register_job`.

APScheduler stores jobs as pickled references, so the stored job is the
module-level :func:`fire` with the job's name; the engine and settings are
process state set by :func:`build_scheduler`.

The schedulers built here (:class:`GuardedBlockingScheduler`, :class:`GuardedBackgroundScheduler`) survive a
database error in APScheduler's own bookkeeping (APScheduler 3 catches only those of ``get_due_jobs``: one from
``update_job`` or ``get_next_run_time`` ended its loop, and with it every job, for good) and keep a
:class:`SchedulerHeartbeat` that ``/healthz`` reads. A restart keeps what the job store holds: an unchanged job
keeps its stored next run time (a nightly retrain that fell due while the process was down runs within its grace
time), and interval jobs fire on boundaries counted from the epoch, not from the start.
"""

from __future__ import annotations

import logging
import pickle
from datetime import datetime, timedelta, timezone

from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.base import STATE_STOPPED, BaseScheduler
from apscheduler.schedulers.blocking import BlockingScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger
from apscheduler.util import obj_to_ref
from sqlalchemy import Engine

from forecaster.jobs.heartbeat import HEARTBEAT_EVERY_S, SchedulerHeartbeat
from forecaster.jobs.runs import JobSpec, run_once, slot_for
from forecaster.settings import Settings
from forecaster.store.job_runs import last_ok_slot, stored_scheduler_jobs

log = logging.getLogger(__name__)

JOBS: dict[str, JobSpec] = {}
_context: dict[str, object] = {}


def register_job(spec: JobSpec) -> None:
    JOBS[spec.name] = spec


def ingest_job(engine: Engine, settings: Settings, now: datetime) -> dict:
    """Every minute: pull new minutes from Prometheus, when one is configured."""
    if not settings.prometheus_url:
        return {"skipped": "PREWARM_PROMETHEUS_URL not set"}
    from forecaster.ingest.service import ingest_prometheus

    return ingest_prometheus(engine, settings, now=now)


def partition_job(engine: Engine, settings: Settings, now: datetime) -> dict:
    """Hourly: create the invocation partitions of the coming days."""
    from forecaster.store.partitions import maintain_partitions

    created = maintain_partitions(engine, now=now, days_ahead=settings.partition_days_ahead)
    return {"created": created}


def retention_job(engine: Engine, settings: Settings, now: datetime) -> dict:
    """Hourly: keep forecast partitions ahead and pruned; delete old model versions, plans, finished actions and job
    runs; roll old invocation days up, drop the oldest.

    Forecast partitions go first: they are cheap and the forecast job needs the
    coming days' partitions even when an invocation day fails to roll up; then
    old model versions' files (a failure there is logged and reported, and the
    store's retention still runs); the history next, before the invocation days
    that may fail.
    """
    from forecaster.store.forecasts import maintain_forecast_partitions
    from forecaster.store.history_retention import apply_history_retention
    from forecaster.store.model_retention import prune_model_versions
    from forecaster.store.retention import apply_retention

    detail: dict = {"forecasts": maintain_forecast_partitions(
        engine, now=now, days_ahead=settings.partition_days_ahead, retention_days=settings.forecast_retention_days)}
    try:
        detail["model_versions"] = prune_model_versions(
            engine, settings.models_dir, now=now, retention_days=settings.model_versions_retention_days,
            kept=settings.model_versions_kept)
    except Exception as error:  # noqa: BLE001 - old model files must not hold back the tables' retention
        log.exception("retention: model versions not pruned")
        detail["model_versions"] = {"error": f"{type(error).__name__}: {error}"}
    detail["history"] = apply_history_retention(engine, now=now, settings=settings)
    detail["invocations"] = apply_retention(engine, now=now, settings=settings)
    return detail


def forecast_job(engine: Engine, settings: Settings, now: datetime) -> dict:
    """Every minute: forecast every model with the champion and store the quantiles."""
    from forecaster.jobs.forecasting import forecast_job as run

    return run(engine, settings, now)


def retrain_job(engine: Engine, settings: Settings, now: datetime) -> dict:
    """Nightly: train a challenger and promote it if its backtest is not worse than the champion's."""
    from forecaster.jobs.forecasting import retrain_job as run

    return run(engine, settings, now)


def plan_job(engine: Engine, settings: Settings, now: datetime) -> dict:
    """Every minute: plan from the stored forecasts and carry the plan out through the actuator.

    On the first run with no latency model saved yet (the first start), one is
    trained from what the store holds; afterwards the nightly retrain refits it.
    """
    from forecaster.coldstart.service import ensure_latency_model
    from forecaster.jobs.planning import plan_job as run

    try:
        ensure_latency_model(engine, settings, now)
    except Exception:  # noqa: BLE001 - plan with the physics prior rather than not at all
        log.exception("first latency model could not be trained; planning with the prior")
    return run(engine, settings, now)


def error_rollup_job(engine: Engine, settings: Settings, now: datetime) -> dict:
    """Every minute: score the target hours that are due into the forecast-error rollup (the dashboard's)."""
    from forecaster.jobs.error_scoring import score_errors_job

    return score_errors_job(engine, settings, now)


def coldstarts_job(engine: Engine, settings: Settings, now: datetime) -> dict:
    """Every minute: store the cold starts of new replicas the actuator's backend observes in the cluster (a job
    of its own: a failing collector never fails a plan); skipped for a backend that cannot see them."""
    from forecaster.jobs.coldstarts import coldstarts_job as run

    return run(engine, settings, now)


def default_jobs(settings: Settings) -> list[JobSpec]:
    return [
        JobSpec("ingest", ingest_job, every_s=settings.ingest_interval_s),
        JobSpec("partitions", partition_job, every_s=settings.partition_maintenance_interval_s),
        JobSpec("retention", retention_job, every_s=settings.retention_interval_s),
        JobSpec("forecast", forecast_job, every_s=settings.forecast_interval_s),
        JobSpec("plan", plan_job, every_s=settings.forecast_interval_s),
        JobSpec("coldstarts", coldstarts_job, every_s=60),
        JobSpec("forecast_errors", error_rollup_job, every_s=60),
        JobSpec("retrain", retrain_job, every_s=86_400, offset_s=settings.retrain_hour_utc * 3600),
    ]


def fire(job_name: str) -> dict | None:
    """APScheduler entry point: run ``job_name`` for the current slot (at most once)."""
    engine = _context["engine"]
    settings = _context["settings"]
    return run_once(engine, settings, JOBS[job_name], now=datetime.now(timezone.utc))  # type: ignore[arg-type]


#: Where interval jobs count their periods from: they fire at the epoch plus whole periods (plus their offset), i.e.
#: on the boundaries of their slots (:func:`~forecaster.jobs.runs.slot_for`): second 0 of the minute, the top of the
#: hour. Counted from the start (APScheduler's default) each start pushed every job a whole period back: a
#: scheduler restarted more often than hourly never ran the hourly ones.
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _trigger(spec: JobSpec) -> IntervalTrigger | CronTrigger:
    """Daily jobs fire at their offset (e.g. 03:00 UTC); shorter ones every period, on the period's boundaries."""
    if spec.every_s == 86_400:
        return CronTrigger(hour=spec.offset_s // 3600, minute=(spec.offset_s % 3600) // 60, timezone=timezone.utc)
    return IntervalTrigger(seconds=spec.every_s, start_date=EPOCH + timedelta(seconds=spec.offset_s % spec.every_s),
                           timezone=timezone.utc)


class _GuardedLoop:
    """APScheduler 3's loop, kept alive through errors of its own bookkeeping and watched by a heartbeat.

    ``BaseScheduler._process_jobs`` catches only the errors of ``jobstore.get_due_jobs``; one raised by
    ``jobstore.update_job`` (the due job's next run time written back) or ``get_next_run_time`` (the database gone
    in between) left ``_main_loop``, and the loop's thread ended for good: no job ran again while ``prewarm serve``
    kept answering (``prewarm scheduler`` exited 1). Here such an error is logged and the loop tries again after
    the job store's retry interval (``jobstore_retry_interval``, 10 s), as APScheduler does for ``get_due_jobs``: a
    job already handed to the executor before the error is handed again then, and its slot claim in ``job_runs``
    makes that a no-op. The loop also wakes at least every ``heartbeat_every_s``, so that its heartbeat shows it
    turning even when no job is due for hours, and takes no job once the scheduler is shut down.
    """

    heartbeat_every_s: float = HEARTBEAT_EVERY_S

    def __init__(self, *args, heartbeat: SchedulerHeartbeat | None = None, **kwargs) -> None:
        self.heartbeat = heartbeat or SchedulerHeartbeat()
        super().__init__(*args, **kwargs)

    def _main_loop(self) -> None:
        self.heartbeat.loop_started()
        try:
            super()._main_loop()  # type: ignore[misc]
        finally:
            self.heartbeat.loop_ended()

    def _process_jobs(self):
        self.heartbeat.beat()
        if self.state == STATE_STOPPED:  # type: ignore[attr-defined]
            # shutdown() woke the loop to end it, and APScheduler would process the due jobs once more first: hand
            # each to the executor already shut down ("cannot schedule new futures after shutdown") and still move
            # its stored next run time on, so that a slot due at that moment never ran, not even after a restart
            return None
        try:
            wait_s = super()._process_jobs()  # type: ignore[misc]
        except Exception as error:  # noqa: BLE001 - the loop must outlive the job store's errors
            retry_s = self.jobstore_retry_interval  # type: ignore[attr-defined]
            log.error("scheduler: the job store failed while APScheduler updated its jobs; trying again in %g s",
                      retry_s, exc_info=True)
            self.heartbeat.failed(error)
            wait_s = retry_s
        return self.heartbeat_every_s if wait_s is None else min(wait_s, self.heartbeat_every_s)


class GuardedBlockingScheduler(_GuardedLoop, BlockingScheduler):
    """:class:`BlockingScheduler` whose loop survives job store errors (``prewarm scheduler``)."""


class GuardedBackgroundScheduler(_GuardedLoop, BackgroundScheduler):
    """:class:`BackgroundScheduler` whose loop survives job store errors (``prewarm serve --scheduler``)."""


#: APScheduler's table in the database.
JOB_TABLE = "apscheduler_jobs"
#: Jobs run at start when the slot they are in has not run successfully, rather than at the next boundary up to a
#: period later: the hourly upkeep that a scheduler down across its boundary (longer than its grace time) or
#: started for the first time would otherwise leave for an hour. That run is a one-off job of its own (id
#: ``<name>@start``, removed once it fired), so the job's own run times stay on its boundaries; the slot claim makes
#: a slot that already runs (another process) a no-op.
CATCH_UP_AT_START = frozenset({"partitions", "retention"})


def _stored_jobs(engine: Engine) -> dict[str, dict]:
    """The jobs in the job store as APScheduler pickled them (``Job.__getstate__``: trigger, args, next run time...),
    by id; none before the first start. A job that cannot be read back is left out (it is replaced)."""
    stored = {}
    for job_id, job_state in stored_scheduler_jobs(engine, JOB_TABLE):
        try:
            stored[job_id] = pickle.loads(job_state)
        except Exception:  # noqa: BLE001 - a class since moved or renamed: the job is added afresh
            log.warning("stored job %s cannot be read back; it is replaced", job_id, exc_info=True)
    return stored


def _unchanged(state: dict, trigger: IntervalTrigger | CronTrigger, name: str, grace_s: int) -> bool:
    """Whether the stored job ``state`` is the job this code would add (its next run time aside)."""
    stored_trigger = state.get("trigger")
    return (type(stored_trigger) is type(trigger) and stored_trigger.__getstate__() == trigger.__getstate__()
            and state.get("func") == obj_to_ref(fire) and tuple(state.get("args") or ()) == (name,)
            and not state.get("kwargs") and state.get("executor") == "default"
            and state.get("misfire_grace_time") == grace_s and state.get("coalesce") is True
            and state.get("max_instances") == 1 and state.get("next_run_time") is not None)


def _slot_not_run(engine: Engine, spec: JobSpec, now: datetime) -> bool:
    """Whether ``spec``'s slot at ``now`` has no successful run (its newest successful slot is older)."""
    try:
        last = last_ok_slot(engine, spec.name)
    except Exception:  # noqa: BLE001 - no catch-up then: the job fires at its next boundary
        log.warning("job %s: its last run could not be read; no run at start", spec.name, exc_info=True)
        return False
    return last is None or last < slot_for(now, spec.every_s, spec.offset_s)


def _reconcile_action_state(engine: Engine) -> None:
    """The action counts and GPUs ahead recomputed from the history before the actuator runs (see
    :func:`forecaster.store.actions.reconcile_action_state`); a failure is logged, the jobs start regardless."""
    from forecaster.store.actions import reconcile_action_state

    try:
        log.info("action state reconciled with the history: %s", reconcile_action_state(engine))
    except Exception:  # noqa: BLE001 - the tables keep what the writers moved; the next start tries again
        log.exception("could not reconcile the action counts and GPUs ahead with the history")


def build_scheduler(engine: Engine, settings: Settings, scheduler: BaseScheduler | None = None, *,
                    background: bool = False, heartbeat: SchedulerHeartbeat | None = None) -> BaseScheduler:
    """Configure a scheduler whose job store is the ``apscheduler_jobs`` table.

    Without ``scheduler``, a :class:`GuardedBackgroundScheduler` (``background``) or a
    :class:`GuardedBlockingScheduler`, with ``heartbeat`` (a new one by default; ``scheduler.heartbeat``).

    Missed runs are coalesced into one and dropped when more than half a period late; the ``job_runs`` slot claim
    makes a re-fired slot a no-op. A job the store holds unchanged (trigger, arguments, options) is kept as stored,
    its next run time with it: a start no longer recomputes it from the start's moment (a nightly retrain that fell
    due while the process was down runs at start, within its 12 h grace time). A changed or new job is added
    (replacing the stored one). :data:`CATCH_UP_AT_START` jobs whose current slot has not run also run once at start.
    """
    for spec in default_jobs(settings):
        JOBS.setdefault(spec.name, spec)
    _context.update(engine=engine, settings=settings)
    _reconcile_action_state(engine)
    if scheduler is None:
        kind = GuardedBackgroundScheduler if background else GuardedBlockingScheduler
        scheduler = kind(timezone=timezone.utc, heartbeat=heartbeat)
    elif not isinstance(scheduler, _GuardedLoop):
        log.warning("%s is not guarded: a job store error during its bookkeeping ends its loop",
                    type(scheduler).__name__)
    scheduler.configure(
        jobstores={"default": SQLAlchemyJobStore(engine=engine, tablename=JOB_TABLE)},
        job_defaults={"coalesce": True, "max_instances": 1},
        timezone=timezone.utc,
    )
    stored = _stored_jobs(engine)
    now = datetime.now(timezone.utc)
    for name, spec in JOBS.items():
        trigger = _trigger(spec)
        grace_s = max(1, spec.every_s // 2)
        state = stored.get(name)
        if state is not None and _unchanged(state, trigger, name, grace_s):
            log.info("job %s kept as stored, next run at %s", name, state["next_run_time"])
        else:
            scheduler.add_job(fire, trigger, args=[name], id=name, name=name, replace_existing=True,
                              misfire_grace_time=grace_s)
        if name in CATCH_UP_AT_START and _slot_not_run(engine, spec, now):
            log.info("job %s: its slot at %s has not run; running it at start", name, slot_for(now, spec.every_s,
                                                                                                spec.offset_s))
            scheduler.add_job(fire, DateTrigger(run_date=now, timezone=timezone.utc), args=[name],
                              id=f"{name}@start", name=f"{name} (at start)", replace_existing=True,
                              misfire_grace_time=grace_s)
    return scheduler
