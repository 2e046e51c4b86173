"""The audit trail in the store: plans, actions (spec + status), and the kill switch.

Plain functions over a connection, each a small piece of one transaction; the
actuator composes them. Statuses and reasons are the fixed sets of
:mod:`forecaster.contracts.actions`.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta

from sqlalchemy import Connection, Engine, text

from forecaster.contracts.actions import Action, ActionKind, ActionStatus, FailureReason, Plan

OPEN = (ActionStatus.PENDING, ActionStatus.RUNNING)
FINISHED = (ActionStatus.SUCCEEDED, ActionStatus.FAILED, ActionStatus.DROPPED)
ACTION_COLUMNS = ("id, plan_id, kind, model_id, node_id, target, spec, not_before, deadline, reason, status, "
                  "status_reason, attempts, key, backend, detail, next_attempt_at, started_at, finished_at")


# --- kill switch ---------------------------------------------------------------------------------------------


def set_paused(engine: Engine, paused: bool, *, now: datetime, reason: str | None = None,
               by: str | None = None) -> None:
    """Turn the global kill switch on (``paused``) or off; every actuating process reads it before each action."""
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO actuator_control (id, paused, reason, updated_by, updated_at) "
                          "VALUES (1, :p, :r, :b, :t) ON CONFLICT (id) DO UPDATE SET paused = :p, reason = :r, "
                          "updated_by = :b, updated_at = :t"),
                     {"p": paused, "r": reason, "b": by, "t": now})


def is_paused(conn: Connection | Engine) -> bool:
    if isinstance(conn, Engine):
        with conn.connect() as c:
            return is_paused(c)
    return bool(conn.execute(text("SELECT paused FROM actuator_control WHERE id = 1")).scalar())


# --- writing plans and actions -------------------------------------------------------------------------------


def record_plan(conn: Connection, plan: Plan) -> int:
    summary = {**plan.summary, "actions": len(plan.actions)}
    return conn.execute(text("INSERT INTO plans (planned_at, summary) VALUES (:t, CAST(:s AS jsonb)) RETURNING id"),
                        {"t": plan.planned_at, "s": json.dumps(summary, default=str)}).scalar_one()


def newest_plan_budget(conn: Connection) -> tuple[datetime, object] | None:
    """(planned_at, summary["budget"]) of the newest plan that carries budget mode's controller state, if any."""
    row = conn.execute(text("SELECT planned_at, summary->'budget' FROM plans WHERE summary->'budget' IS NOT NULL "
                            "ORDER BY id DESC LIMIT 1")).first()
    return None if row is None else (row[0], row[1])


def plan_budget_states(conn: Connection, *, since: datetime | None = None, until: datetime | None = None,
                       limit: int = 1440) -> list[tuple[datetime, object]]:
    """(planned_at, summary["budget"]) of the newest ``limit`` plans carrying budget mode's state, planned at or after
    ``since`` and before ``until``, oldest first; without the controller's discounted curve sum (``curve_sum``),
    which only the next update reads."""
    rows = conn.execute(text("SELECT planned_at, (summary->'budget') - 'curve_sum' FROM plans "
                             "WHERE summary->'budget' IS NOT NULL "
                             "AND (CAST(:since AS timestamptz) IS NULL OR planned_at >= :since) "
                             "AND (CAST(:until AS timestamptz) IS NULL OR planned_at < :until) "
                             "ORDER BY id DESC LIMIT :limit"),
                        {"since": since, "until": until, "limit": int(limit)}).all()
    return [(r[0], r[1]) for r in reversed(rows)]


def submit_action(conn: Connection, plan_id: int | None, action: Action, *, backend: str,
                  now: datetime) -> tuple[int, bool]:
    """Record ``action`` as pending, or merge it into the open unit with the same key.

    A merge keeps one unit of work: while it is pending its deadline becomes the
    later of the two and its not-before the earlier. A running unit keeps its
    deadline: the backend call under way has it, and a unit whose process died
    must still pass it, so that :func:`reap_lost` fails it (extended by every
    plan that asks for the same work, it never would, and it would block that
    work and hold its GPUs ahead for good). A transaction-scoped advisory lock on the
    key serialises concurrent submitters; the partial unique index
    ``actions_open_key`` backs it up.

    Returns:
        (action id, merged).
    """
    key = action.key
    conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"), {"k": key})
    open_row = conn.execute(text("SELECT id, deadline, not_before FROM actions WHERE key = :k "
                                 "AND status IN ('pending', 'running') FOR UPDATE"), {"k": key}).first()
    if open_row is not None:
        conn.execute(text("UPDATE actions SET "
                          "deadline = CASE WHEN status = 'pending' THEN GREATEST(deadline, :d) ELSE deadline END, "
                          "not_before = CASE WHEN status = 'pending' THEN LEAST(not_before, :nb) ELSE not_before END, "
                          "detail = detail || jsonb_build_object('merged_plans', "
                          "  COALESCE(detail->'merged_plans', '[]'::jsonb) || to_jsonb(CAST(:p AS bigint))), "
                          "updated_at = :now WHERE id = :id"),
                     {"d": action.deadline, "nb": action.not_before, "p": plan_id, "now": now, "id": open_row[0]})
        return open_row[0], True
    spec = {**action.to_spec(), "key": key}
    new_id = conn.execute(
        text("INSERT INTO actions (plan_id, kind, model_id, node_id, target, spec, not_before, deadline, reason, "
             "expected_benefit, expected_cost, status, key, backend, detail, updated_at, created_at) VALUES "
             "(:plan, :kind, :model, :node, :target, CAST(:spec AS jsonb), :nb, :dl, :reason, :benefit, :cost, "
             "'pending', :key, :backend, '{}'::jsonb, :now, :now) RETURNING id"),
        {"plan": plan_id, "kind": str(action.kind), "model": action.model_id, "node": action.node_id,
         "target": action.target, "spec": json.dumps(spec), "nb": action.not_before, "dl": action.deadline,
         "reason": str(action.reason), "benefit": action.expected_benefit_s, "cost": action.expected_cost,
         "key": key, "backend": backend, "now": now},
    ).scalar_one()
    return new_id, False


def due_actions(conn: Connection, now: datetime, limit: int) -> list[dict]:
    """Pending actions whose time has come (not-before, or the retry time), locked for this transaction."""
    rows = conn.execute(
        text(f"SELECT {ACTION_COLUMNS} FROM actions WHERE status = 'pending' "
             "AND COALESCE(next_attempt_at, not_before, :now) <= :now "
             "ORDER BY deadline NULLS LAST, id LIMIT :limit FOR UPDATE SKIP LOCKED"),
        {"now": now, "limit": limit},
    ).mappings().all()
    return [dict(r) for r in rows]


def started_since(conn: Connection, since: datetime, until: datetime) -> int:
    """Actions started (any attempt) in ``[since, until]``: what the per-minute limit counts.

    Bounded above too: a store can hold starts later than ``until`` (a replay re-run over a store whose earlier,
    longer replay started actions beyond this one's clock; a clock that stepped back), and counting them made every
    action of the re-run ``rate_limited``."""
    return conn.execute(text("SELECT count(*) FROM actions WHERE started_at >= :s AND started_at <= :u"),
                        {"s": since, "u": until}).scalar_one()


#: The actions whose ``ahead_gpus`` counts for their model (the latest of them, in :data:`LATEST_FIRST` order).
AHEAD_COUNTS = "kind IN ('scale', 'release') AND status IN ('succeeded', 'running') AND detail ? 'ahead_gpus'"
LATEST_FIRST = "coalesce(finished_at, started_at) DESC NULLS LAST, id DESC"
#: The actions that set what a model runs (the newest of them, in :data:`NEWEST_FIRST` order; the plan job's fleet
#: read, through the partial index ``actions_replicas_newest``).
REPLICAS_SET = "kind IN ('scale', 'release') AND status = 'succeeded'"
#: The level such an action left its model at: ``replicas_after`` as the actuator records it; on rows written before
#: it did, the target it set, else (a no-op) the level it found, else a scale's own ``replicas``. Never a release's
#: ``spec.replicas``: those are the replicas it gave back.
REPLICAS_AFTER = ("coalesce((detail->>'replicas_after')::int, (detail->>'target_replicas')::int, "
                  "(detail->'guardrails'->>'current')::int, "
                  "CASE WHEN kind = 'scale' THEN (spec->>'replicas')::int END)")
NEWEST_FIRST = "updated_at DESC, id DESC"


def ahead_gpus(conn: Connection, *, excluding: str | None = None) -> dict[str, int]:
    """GPUs each model holds above its reactive ask after its latest scale or release (applied or in flight);
    models at 0 are left out. Read from ``model_ahead_gpus`` (:func:`refresh_ahead` keeps it), not from the
    whole action history."""
    rows = conn.execute(
        text("SELECT model_id, ahead_gpus FROM model_ahead_gpus WHERE CAST(:ex AS text) IS NULL OR model_id <> :ex"),
        {"ex": excluding},
    ).all()
    return {r[0]: r[1] for r in rows}


def ahead_gpus_total(conn: Connection, *, excluding: str | None = None) -> int:
    """The sum of :func:`ahead_gpus` (what the GPU-budget guardrail reads once per scale or release it binds)."""
    return int(conn.execute(
        text("SELECT coalesce(sum(ahead_gpus), 0) FROM model_ahead_gpus "
             "WHERE CAST(:ex AS text) IS NULL OR model_id <> :ex"), {"ex": excluding}).scalar_one())


def refresh_ahead(conn: Connection, model_ids) -> None:
    """Set each model's ``model_ahead_gpus`` row from its latest counting scale or release (no row for 0).

    Called in the transaction that changed one of the model's scales or releases (marked, reaped or deleted), once
    for all the models it changed, just before it commits (``StoreLedger.session``), so the row is what the
    history says. A per-model advisory lock makes two transactions changing one model's actions at once write in
    turn, the second seeing the first's rows; taken in id order in one call, so two transactions never wait on
    each other's models. One index probe per model (``actions_scale_latest``, migration 0015).
    """
    for model_id in sorted({m for m in model_ids if m is not None}):
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended('prewarm.ahead_gpus:' || :m, 0))"),
                     {"m": model_id})
        latest = conn.execute(
            text(f"SELECT id, coalesce((detail->>'ahead_gpus')::int, 0) FROM actions WHERE model_id = :m "
                 f"AND {AHEAD_COUNTS} ORDER BY {LATEST_FIRST} LIMIT 1"), {"m": model_id}).first()
        if latest is None or latest[1] == 0:
            conn.execute(text("DELETE FROM model_ahead_gpus WHERE model_id = :m"), {"m": model_id})
        else:
            conn.execute(
                text("INSERT INTO model_ahead_gpus (model_id, ahead_gpus, action_id, updated_at) "
                     "VALUES (:m, :g, :id, now()) ON CONFLICT (model_id) DO UPDATE SET "
                     "ahead_gpus = excluded.ahead_gpus, action_id = excluded.action_id, updated_at = now()"),
                {"m": model_id, "g": latest[1], "id": latest[0]})


def count_actions(conn: Connection, deltas: dict[tuple[str, str], int],
                  pruned: dict[tuple[str, str], int] | None = None) -> None:
    """Add ``deltas`` (``(kind, status) -> change``) to ``action_counts.n`` and ``pruned`` (actions deleted from the
    table) to its ``pruned``, in key order (so two transactions lock the counts' rows in one order and never wait
    on each other). What ``/metrics`` reports as ``prewarm_actions_total`` and ``prewarm_actions_open``, kept where
    actions are recorded, marked, reaped or deleted instead of counted over the whole table per scrape
    (migrations 0015, 0016)."""
    pruned = pruned or {}
    moved = sorted((key, deltas.get(key, 0), pruned.get(key, 0)) for key in {*deltas, *pruned}
                   if deltas.get(key, 0) or pruned.get(key, 0))
    if not moved:
        return
    conn.execute(
        text("INSERT INTO action_counts (kind, status, n, pruned) VALUES (:kind, :status, :n, :pruned) "
             "ON CONFLICT (kind, status) DO UPDATE SET n = action_counts.n + excluded.n, "
             "pruned = action_counts.pruned + excluded.pruned"),
        [{"kind": kind, "status": status, "n": n, "pruned": gone} for (kind, status), n, gone in moved])


def count_deleted(conn: Connection, deleted) -> None:
    """Take the actions just deleted (``(kind, status)`` per row) off ``n``; a finished one moves to ``pruned``, so a
    finished status' ``n + pruned`` never falls: ``/metrics``' counter counts every action that finished."""
    gone: dict[tuple[str, str], int] = {}
    for kind, status in deleted:
        gone[(kind, status)] = gone.get((kind, status), 0) + 1
    count_actions(conn, {key: -n for key, n in gone.items()},
                  {key: n for key, n in gone.items() if key[1] in FINISHED})


def action_counts(conn: Connection) -> list[tuple[str, str, int, int]]:
    """``(kind, status, actions in the table, actions deleted since)`` for every kind and status with either
    (``/metrics``)."""
    return [tuple(r) for r in conn.execute(
        text("SELECT kind, status, n, pruned FROM action_counts WHERE n <> 0 OR pruned <> 0 "
             "ORDER BY kind, status")).all()]


def reconcile_action_state(engine: Engine) -> dict[str, int]:
    """Recount ``action_counts.n`` and recompute ``model_ahead_gpus`` from the whole history, once (the scheduler
    calls it when it starts); the counts of deleted actions (``pruned``) are kept as they are.

    Both tables are moved by the transactions that write actions; this heals whatever moved actions without them
    (a scheduler of the code before migration 0015 still running while it ran, a hand-made fix in SQL). The two
    tables are locked against writers while they are rewritten: a writer whose actions are not committed yet
    applies its own change after this, to counts that do not hold it; one that has written its change holds its
    rows, and this waits for it to commit. It reads every action: about 0.1 s per million.
    """
    with engine.begin() as conn:
        # in the order a ledger session writes them (GPUs ahead, then counts), so that neither waits on the other
        conn.execute(text("LOCK TABLE model_ahead_gpus, action_counts IN EXCLUSIVE MODE"))
        conn.execute(text("UPDATE action_counts SET n = 0"))  # ``pruned`` stays: the deleted rows are not here
        counted = conn.execute(text("INSERT INTO action_counts (kind, status, n) "
                                    "SELECT kind, status, count(*) FROM actions GROUP BY kind, status "
                                    "ON CONFLICT (kind, status) DO UPDATE SET n = excluded.n")).rowcount
        conn.execute(text("DELETE FROM model_ahead_gpus"))
        ahead = conn.execute(text(
            f"INSERT INTO model_ahead_gpus (model_id, ahead_gpus, action_id) SELECT model_id, gpus, id FROM "
            f"(SELECT DISTINCT ON (model_id) model_id, id, coalesce((detail->>'ahead_gpus')::int, 0) AS gpus "
            f"FROM actions WHERE {AHEAD_COUNTS} AND model_id IS NOT NULL ORDER BY model_id, {LATEST_FIRST}) latest "
            f"WHERE gpus <> 0")).rowcount
    return {"action_counts": counted, "models_ahead": ahead}


def ahead_models(rows) -> list[str]:
    """The models of ``(kind, model_id)`` rows that are scales or releases: those whose GPUs ahead may have changed
    (:func:`refresh_ahead` them before the transaction commits)."""
    return [row[1] for row in rows if row[0] in ("scale", "release") and row[1] is not None]


def mark(conn: Connection, action_id: int, status: ActionStatus, *, now: datetime,
         reason: FailureReason | str | None = None, detail: dict | None = None, start: bool = False,
         next_attempt_at: datetime | None = None) -> list[tuple[str, str | None, str]]:
    """Move an action to ``status``; ``start`` counts an attempt; ``detail`` is merged into the record.

    Returns the action's ``(kind, model_id, status before)`` (none when no such action): the caller moves the
    action counts (:func:`count_actions`) and, for a scale or release, refreshes its model's GPUs ahead
    (:func:`ahead_models`, :func:`refresh_ahead`) before committing."""
    finished = status in FINISHED
    rows = conn.execute(
        text("UPDATE actions a SET status = :status, status_reason = :reason, updated_at = :now, "
             "detail = a.detail || CAST(:detail AS jsonb), next_attempt_at = :next, "
             "attempts = a.attempts + CASE WHEN :start THEN 1 ELSE 0 END, "
             "started_at = CASE WHEN :start THEN :now ELSE a.started_at END, "
             "finished_at = CASE WHEN :finished THEN :now ELSE a.finished_at END "
             "FROM (SELECT id, status FROM actions WHERE id = :id FOR UPDATE) was WHERE a.id = was.id "
             "RETURNING a.kind, a.model_id, was.status"),
        {"status": str(status), "reason": None if reason is None else str(reason), "now": now,
         "detail": json.dumps(detail or {}, default=str), "next": next_attempt_at, "start": start,
         "finished": finished, "id": action_id},
    ).all()
    return [tuple(r) for r in rows]


def reap_lost(conn: Connection, now: datetime, *, grace: timedelta = timedelta(minutes=5)
              ) -> list[tuple[str, str | None]]:
    """Fail actions left ``running`` past their deadline (the process that ran them died); their ``(kind,
    model_id)``, each moved from running to failed (see :func:`mark`)."""
    rows = conn.execute(
        text("UPDATE actions SET status = 'failed', status_reason = 'timeout', finished_at = :now, updated_at = :now,"
             " detail = detail || '{\"lost\": \"still running past its deadline: the actuator stopped?\"}'::jsonb "
             "WHERE status = 'running' AND deadline < :cutoff RETURNING kind, model_id"),
        {"now": now, "cutoff": now - grace},
    ).all()
    return [tuple(r) for r in rows]


def list_actions(engine: Engine, *, plan_id: int | None = None, model_id: str | None = None,
                 kind: ActionKind | None = None) -> list[dict]:
    """Recorded actions, oldest first (for tests, the CLI and the API)."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(f"SELECT {ACTION_COLUMNS} FROM actions WHERE (CAST(:p AS bigint) IS NULL OR plan_id = :p) "
                 "AND (CAST(:m AS text) IS NULL OR model_id = :m) AND (CAST(:k AS text) IS NULL OR kind = :k) "
                 "ORDER BY id"),
            {"p": plan_id, "m": model_id, "k": None if kind is None else str(kind)},
        ).mappings().all()
    return [dict(r) for r in rows]


def catalogue_targets(conn: Connection, ids: list[str]) -> list[dict]:
    """Per model id: GPUs per replica, labels, image and weights (what a backend needs to find the workload)."""
    rows = conn.execute(text("SELECT id, gpus_per_replica, labels, image_ref, weights_uri FROM serving_models "
                             "WHERE id = ANY(CAST(:ids AS text[]))"), {"ids": sorted(ids)}).mappings().all()
    return [dict(r) for r in rows]
