"""Retention of the audit trail, the scheduler's history and the latency model's events: plans, finished actions,
job runs, cold starts and transfers.

Nothing else deletes them, and they grow with the fleet (at 100,000 models the plan job records about 360,000
actions a day, the scheduler about 5,800 job runs; every replica start is a cold start). The hourly retention job
deletes what is older than its setting, oldest first, in batches of :data:`BATCH_ROWS` rows, each batch its own
short transaction, so that the plan job and the actuator writing beside it wait at most one batch's row locks
(none: a finished action is never written again), and a run that meets a large backlog (the first run on an old
store) stops after ``budget_s`` and leaves the rest to the next run.

What stays whatever its age, because a read of the present depends on it:

* actions not finished (pending, running): the actuator's open work;
* per model, its newest succeeded scale or release (the replicas the plan job reads it runs,
  :data:`~forecaster.store.actions.REPLICAS_SET`) and its latest scale or release counting GPUs ahead (what
  ``model_ahead_gpus`` is recomputed from, :data:`~forecaster.store.actions.AHEAD_COUNTS`): deleting either
  would make an old model look scaled to its default, or move its GPUs ahead;
* plans an action still belongs to (deleting one would only null the action's ``plan_id``);
* each job's newest finished run (``/metrics``' ``prewarm_job_last_duration_seconds``);
* each model's newest 20 cold starts (its rolling cold-start figures,
  :func:`forecaster.store.coldstarts.recent_cold_start_percentiles`).

Ages of plans and actions count back from the newest plan (never after ``now``), as invocation days' count from
their sources' newest data (:func:`forecaster.store.retention.retention_reference`): a store the plan job stopped
writing to (a demo's replay of a trace day years ago, a deployment paused for a month) is not emptied by the mere
passing of time; cold starts' and transfers' from the newest of each (the latency retrain's window,
``PREWARM_LATENCY_TRAIN_DAYS``, counts back from there too). Job runs' slots are the scheduler's wall clock and age
from ``now``.

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
from forecaster.store.coldstarts import RECENT_COLD_STARTS
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


def _prune_in_batches(engine: Engine, read_sql: str, params: dict, delete_batch, *, batch_rows: int,
                      deadline: float | None) -> Pruned:
    """The walk every table but ``job_runs`` shares: read the next ``batch_rows`` rows past the cutoff oldest first
    (``read_sql`` returns ``(id, time, ...)`` after the keyset ``(:t, :id)``, at most ``:n``), hand them to
    ``delete_batch(conn, rows) -> ids kept`` in the same transaction, until none is left or ``deadline`` (a
    :func:`time.monotonic` time) has passed; kept rows are read once a run."""
    result, after = Pruned(), (_START, 0)
    while True:
        with engine.begin() as conn:
            rows = conn.execute(text(read_sql), {**params, "t": after[0], "id": after[1], "n": batch_rows}).all()
            if not rows:
                break
            after = (rows[-1][1], rows[-1][0])
            deleted, kept = delete_batch(conn, rows)
        result.deleted += deleted
        result.kept += kept
        if len(rows) < batch_rows:
            break
        if deadline is not None and time.monotonic() >= deadline:
            result.more = True
            break
    return result


def prune_actions(engine: Engine, *, before: datetime, batch_rows: int = BATCH_ROWS,
                  deadline: float | None = None) -> Pruned:
    """Delete the actions that finished before ``before``, but those the present reads (module docstring); oldest
    first through ``actions_finished_age``."""
    def delete_batch(conn: Connection, rows) -> tuple[int, int]:
        kept = _kept_actions(conn, {m for _, _, kind, m in rows if kind in ("scale", "release") and m is not None})
        doomed = [r[0] for r in rows if r[0] not in kept]
        deleted = conn.execute(text(f"DELETE FROM actions WHERE id = ANY(:ids) AND {FINISHED_SQL} "
                                    "RETURNING kind, status"), {"ids": doomed}).all()
        count_deleted(conn, deleted)
        return len(deleted), len(rows) - len(doomed)

    return _prune_in_batches(engine, (
        f"SELECT id, {ACTION_AGE}, kind, model_id FROM actions WHERE {FINISHED_SQL} AND {ACTION_AGE} < :before "
        f"AND ({ACTION_AGE}, id) > (:t, :id) ORDER BY {ACTION_AGE}, id LIMIT :n"),
        {"before": before}, delete_batch, batch_rows=batch_rows, deadline=deadline)


def prune_plans(engine: Engine, *, before: datetime, batch_rows: int = BATCH_ROWS,
                deadline: float | None = None) -> Pruned:
    """Delete the plans made before ``before`` that no action belongs to any more (``plans_planned_at``, then one
    ``actions_plan`` probe per plan)."""
    def delete_batch(conn: Connection, rows) -> tuple[int, int]:
        deleted = conn.execute(text(
            "DELETE FROM plans p WHERE id = ANY(:ids) AND NOT EXISTS (SELECT 1 FROM actions a "
            "WHERE a.plan_id = p.id)"), {"ids": [r[0] for r in rows]}).rowcount
        return deleted, len(rows) - deleted

    return _prune_in_batches(engine, (
        "SELECT id, planned_at FROM plans WHERE planned_at < :before AND (planned_at, id) > (:t, :id) "
        "ORDER BY planned_at, id LIMIT :n"), {"before": before}, delete_batch, batch_rows=batch_rows,
        deadline=deadline)


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


def prune_cold_starts(engine: Engine, *, before: datetime, batch_rows: int = BATCH_ROWS,
                      deadline: float | None = None) -> Pruned:
    """Delete the cold starts that began before ``before``, but each model's newest :data:`RECENT_COLD_STARTS`
    (its rolling figures on the dashboard and in the recommendations read them; one ``cold_starts_model_time``
    walk per model of a batch)."""
    def delete_batch(conn: Connection, rows) -> tuple[int, int]:
        kept = set(conn.execute(text(
            "SELECT r.id FROM unnest(CAST(:models AS text[])) AS m(id) CROSS JOIN LATERAL (SELECT c.id FROM "
            "cold_starts c WHERE c.model_id = m.id ORDER BY c.started_at DESC, c.id DESC LIMIT :keep) r"),
            {"models": sorted({r[2] for r in rows}), "keep": RECENT_COLD_STARTS}).scalars())
        doomed = [r[0] for r in rows if r[0] not in kept]
        return conn.execute(text("DELETE FROM cold_starts WHERE id = ANY(:ids)"), {"ids": doomed}).rowcount, \
            len(rows) - len(doomed)

    return _prune_in_batches(engine, (
        "SELECT id, started_at, model_id FROM cold_starts WHERE started_at < :before "
        "AND (started_at, id) > (:t, :id) ORDER BY started_at, id LIMIT :n"), {"before": before}, delete_batch,
        batch_rows=batch_rows, deadline=deadline)


def prune_transfers(engine: Engine, *, before: datetime, batch_rows: int = BATCH_ROWS,
                    deadline: float | None = None) -> Pruned:
    """Delete the transfers that began before ``before`` (``transfers_started_at``)."""
    def delete_batch(conn: Connection, rows) -> tuple[int, int]:
        return conn.execute(text("DELETE FROM transfers WHERE id = ANY(:ids)"),
                            {"ids": [r[0] for r in rows]}).rowcount, 0

    return _prune_in_batches(engine, (
        "SELECT id, started_at FROM transfers WHERE started_at < :before AND (started_at, id) > (:t, :id) "
        "ORDER BY started_at, id LIMIT :n"), {"before": before}, delete_batch, batch_rows=batch_rows,
        deadline=deadline)


def apply_history_retention(engine: Engine, *, now: datetime, settings: Settings,
                            budget_s: float = RUN_BUDGET_S) -> dict:
    """One run of the retention job over plans, actions, job runs, cold starts and transfers: what each setting's
    days allow (0 keeps forever), counted from the newest row of the table that dates them (``now`` for job runs;
    module docstring); actions before plans, so plans whose actions went can go in the same run. Returns, per
    table, :class:`Pruned` as a dict (``skipped`` where kept forever)."""
    deadline = time.monotonic() + budget_s
    with engine.connect() as conn:  # the newest of each, through an index on its time
        newest = {table: conn.execute(text(f"SELECT max({column}) FROM {table}")).scalar()
                  for table, column in (("plans", "planned_at"), ("cold_starts", "started_at"),
                                        ("transfers", "started_at"))}
    since = {table: now if t is None else min(now, t) for table, t in newest.items()}
    detail: dict[str, dict] = {}
    steps = (("actions", prune_actions, settings.plans_retention_days, since["plans"]),
             ("plans", prune_plans, settings.plans_retention_days, since["plans"]),
             ("job_runs", prune_job_runs, settings.job_runs_retention_days, now),
             ("cold_starts", prune_cold_starts, settings.cold_starts_retention_days, since["cold_starts"]),
             ("transfers", prune_transfers, settings.cold_starts_retention_days, since["transfers"]))
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
