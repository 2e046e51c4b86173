"""Retention of the audit trail and the scheduler's history: plans, finished actions and job runs.

Nothing else deletes them, and they grow with the fleet (at 100,000 models the plan job records about 360,000
actions a day, the scheduler about 5,800 job runs). The hourly retention job deletes what is older than its
setting, oldest first, in batches of :data:`BATCH_ROWS` rows, each batch its own short transaction, so that the
plan job and the actuator writing beside it wait at most one batch's row locks (none: a finished action is never
written again), and a run that meets a large backlog (the first run on an old store) stops after
``budget_s`` and leaves the rest to the next run.

What stays whatever its age, because a read of the present depends on it:

* actions not finished (pending, running): the actuator's open work;
* per model, its newest succeeded scale or release (the replicas the plan job reads it runs,
  :data:`~forecaster.store.actions.REPLICAS_SET`) and its latest scale or release counting GPUs ahead (what
  ``model_ahead_gpus`` is recomputed from, :data:`~forecaster.store.actions.AHEAD_COUNTS`): deleting either
  would make an old model look scaled to its default, or move its GPUs ahead;
* plans an action still belongs to (deleting one would only null the action's ``plan_id``);
* each job's newest finished run (``/metrics``' ``prewarm_job_last_duration_seconds``).

Ages of plans and actions count back from the newest plan (never after ``now``), as invocation days' count from
their sources' newest data (:func:`forecaster.store.retention.retention_reference`): a store the plan job stopped
writing to (a demo's replay of a trace day years ago, a deployment paused for a month) is not emptied by the mere
passing of time. Job runs' slots are the scheduler's wall clock and age from ``now``.

An action's age is ``coalesce(finished_at, updated_at)``: when it finished. A deleted action leaves the counts
``n`` of ``action_counts`` for their ``pruned`` (:func:`forecaster.store.actions.count_deleted`), in the batch's
transaction, so ``/metrics``' counter of finished actions never falls.

Concurrent writers cannot make a deleted action one of the kept kinds after the batch read it: an action that
finished is not written again, and a newer scale or release only makes the kept one older. (A demo replay that
deletes its own window's dry-run actions meanwhile could; it only ever runs on a replay's store.)
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import Connection, Engine, text

from forecaster.settings import Settings
from forecaster.store.actions import AHEAD_COUNTS, LATEST_FIRST, NEWEST_FIRST, REPLICAS_SET, count_deleted
from forecaster.store.job_runs import JOB_NAMES_CTE

log = logging.getLogger(__name__)

#: Rows a batch reads and deletes in one transaction.
BATCH_ROWS = 5_000
#: Seconds a run spends deleting before it leaves the rest to the next run.
RUN_BUDGET_S = 300.0
#: An action's age: when it finished (``updated_at`` for rows from before ``finished_at`` was written).
ACTION_AGE = "coalesce(finished_at, updated_at)"
FINISHED_SQL = "status IN ('succeeded', 'failed', 'dropped')"  # the partial index actions_finished_age's predicate
#: Before every stored time: where a keyset walk starts.
_START = datetime(1, 1, 1, tzinfo=timezone.utc)


@dataclass
class Pruned:
    """What one table's pruning did in one run.

    Attributes:
        deleted: rows deleted.
        kept: rows past the cutoff that stay (see the module's list).
        more: the run's time was spent before the table's old rows were all read; the next run goes on.
    """

    deleted: int = 0
    kept: int = 0
    more: bool = False


def _kept_actions(conn: Connection, model_ids: set[str]) -> set[int]:
    """The ids of ``model_ids``' newest succeeded scale or release and latest scale or release counting GPUs
    ahead: two index probes per model (``actions_replicas_newest``, ``actions_scale_latest``)."""
    if not model_ids:
        return set()
    rows = conn.execute(text(
        "SELECT kept.id FROM unnest(CAST(:models AS text[])) AS m(model_id) CROSS JOIN LATERAL ("
        f" (SELECT id FROM actions WHERE model_id = m.model_id AND {REPLICAS_SET} ORDER BY {NEWEST_FIRST} LIMIT 1)"
        " UNION ALL"
        f" (SELECT id FROM actions WHERE model_id = m.model_id AND {AHEAD_COUNTS} ORDER BY {LATEST_FIRST} LIMIT 1)"
        ") kept"), {"models": sorted(model_ids)}).all()
    return {r[0] for r in rows}


def prune_actions(engine: Engine, *, before: datetime, batch_rows: int = BATCH_ROWS,
                  deadline: float | None = None) -> Pruned:
    """Delete the actions that finished before ``before``, but those the present reads (module docstring).

    Walks the finished actions oldest first through ``actions_finished_age`` (a keyset on age and id, so kept
    rows are read once a run); ``deadline`` is a :func:`time.monotonic` time after which no new batch starts."""
    result, after = Pruned(), (_START, 0)
    while True:
        with engine.begin() as conn:
            rows = conn.execute(text(
                f"SELECT id, kind, model_id, {ACTION_AGE} FROM actions WHERE {FINISHED_SQL} "
                f"AND {ACTION_AGE} < :before AND ({ACTION_AGE}, id) > (:age, :id) "
                f"ORDER BY {ACTION_AGE}, id LIMIT :n"),
                {"before": before, "age": after[0], "id": after[1], "n": batch_rows}).all()
            if not rows:
                break
            after = (rows[-1][3], rows[-1][0])
            kept = _kept_actions(conn, {m for _, kind, m, _ in rows if kind in ("scale", "release") and m is not None})
            doomed = [r[0] for r in rows if r[0] not in kept]
            deleted = conn.execute(text(f"DELETE FROM actions WHERE id = ANY(:ids) AND {FINISHED_SQL} "
                                        "RETURNING kind, status"), {"ids": doomed}).all()
            count_deleted(conn, deleted)
        result.deleted += len(deleted)
        result.kept += len(rows) - len(doomed)
        if len(rows) < batch_rows:
            break
        if deadline is not None and time.monotonic() >= deadline:
            result.more = True
            break
    return result


def prune_plans(engine: Engine, *, before: datetime, batch_rows: int = BATCH_ROWS,
                deadline: float | None = None) -> Pruned:
    """Delete the plans made before ``before`` that no action belongs to any more (``plans_planned_at``, then one
    ``actions_plan`` probe per plan)."""
    result, after = Pruned(), (_START, 0)
    while True:
        with engine.begin() as conn:
            rows = conn.execute(text(
                "SELECT id, planned_at FROM plans WHERE planned_at < :before AND (planned_at, id) > (:t, :id) "
                "ORDER BY planned_at, id LIMIT :n"),
                {"before": before, "t": after[0], "id": after[1], "n": batch_rows}).all()
            if not rows:
                break
            after = (rows[-1][1], rows[-1][0])
            deleted = conn.execute(text(
                "DELETE FROM plans p WHERE id = ANY(:ids) AND NOT EXISTS (SELECT 1 FROM actions a "
                "WHERE a.plan_id = p.id)"), {"ids": [r[0] for r in rows]}).rowcount
        result.deleted += deleted
        result.kept += len(rows) - deleted
        if len(rows) < batch_rows:
            break
        if deadline is not None and time.monotonic() >= deadline:
            result.more = True
            break
    return result


def prune_job_runs(engine: Engine, *, before: datetime, batch_rows: int = BATCH_ROWS,
                   deadline: float | None = None) -> Pruned:
    """Delete the job runs of slots before ``before``, each job's newest finished run excepted (through the
    primary key ``(job_name, slot)``, one job at a time)."""
    result = Pruned()
    with engine.connect() as conn:
        jobs = conn.execute(text(
            f"WITH RECURSIVE {JOB_NAMES_CTE} SELECT jobs.name, (SELECT max(slot) FROM job_runs "
            "WHERE job_name = jobs.name AND finished_at IS NOT NULL) FROM jobs WHERE jobs.name IS NOT NULL")).all()
    for name, newest_finished in jobs:
        while True:
            with engine.begin() as conn:
                deleted = conn.execute(text(
                    "DELETE FROM job_runs WHERE job_name = :j AND slot IN (SELECT slot FROM job_runs "
                    "WHERE job_name = :j AND slot < :before AND slot IS DISTINCT FROM :keep ORDER BY slot LIMIT :n)"),
                    {"j": name, "before": before, "keep": newest_finished, "n": batch_rows}).rowcount
            result.deleted += deleted
            if deleted < batch_rows:
                break
            if deadline is not None and time.monotonic() >= deadline:
                result.more = True
                return result
    return result


def apply_history_retention(engine: Engine, *, now: datetime, settings: Settings,
                            budget_s: float = RUN_BUDGET_S) -> dict:
    """One run of the retention job over plans, actions and job runs: what each setting's days allow (0 keeps
    forever), counted from the newest plan for plans and actions and from ``now`` for job runs (module
    docstring); actions before plans, so plans whose actions went can go in the same run. Returns, per table,
    :class:`Pruned` as a dict (``skipped`` where kept forever)."""
    deadline = time.monotonic() + budget_s
    with engine.connect() as conn:  # the newest plan, through plans_planned_at
        newest_plan = conn.execute(text("SELECT max(planned_at) FROM plans")).scalar()
    plans_now = now if newest_plan is None else min(now, newest_plan)
    detail: dict[str, dict] = {}
    steps = (("actions", prune_actions, settings.plans_retention_days, plans_now),
             ("plans", prune_plans, settings.plans_retention_days, plans_now),
             ("job_runs", prune_job_runs, settings.job_runs_retention_days, now))
    for table, prune, days, reference in steps:
        if days == 0:
            detail[table] = {"skipped": "kept forever (retention days 0)"}
            continue
        pruned = prune(engine, before=reference - timedelta(days=days), deadline=deadline)
        detail[table] = asdict(pruned)
        if pruned.deleted:
            log.info("retention: deleted %d %s older than %d days (%d kept%s)", pruned.deleted, table, days,
                     pruned.kept, "; more next run" if pruned.more else "")
    return detail
