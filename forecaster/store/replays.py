"""Replays on a simulated cluster and their outcome per policy and model (tables ``replays``, ``replay_outcomes``).

``prewarm demo`` replays a trace through prewarm's loop onto one fleet simulator and through a reactive
autoscaler onto another, on the same minutes, and writes here what each simulator measured so far; the API
serves the newest replay (:func:`read_latest_replay`) with, per model, the cold-start requests prewarm avoided
and the request wait it saved against the baseline. The store only keeps and compares the figures; it does
not know how they were simulated.

Units: ``requests`` and ``cold_requests`` are requests (a cold request arrived while its model had no ready
replica); ``replica_starts`` counts replicas that started and became ready; waits are seconds from a request's
arrival to the start of its service.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Connection, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.sql import bindparam

from forecaster.store.actions import ahead_models, count_deleted, refresh_ahead

OUTCOME_COLUMNS = ("requests", "cold_requests", "replica_starts", "wait_total_s", "wait_max_s")


def start_replay(conn: Connection, *, source: str, window_start: datetime, window_end: datetime,
                 policies: tuple[str, str], summary: dict | None = None) -> int:
    """Record a new replay of ``[window_start, window_end)``; ``policies`` is (subject, baseline). Returns its id."""
    return conn.execute(
        text("INSERT INTO replays (source, window_start, window_end, scored_until, policies, summary) "
             "VALUES (:src, :s, :e, :s, :p, :sum) RETURNING id").bindparams(
            bindparam("p", type_=JSONB), bindparam("sum", type_=JSONB)),
        {"src": source, "s": window_start, "e": window_end, "p": list(policies), "sum": summary or {}},
    ).scalar_one()


def write_replay_outcomes(conn: Connection, *, replay_id: int, scored_until: datetime,
                          outcomes: Mapping[str, Iterable[Mapping]], summary: dict) -> int:
    """Replace the replay's outcome rows with ``outcomes`` (policy -> rows with ``model_id`` and
    :data:`OUTCOME_COLUMNS`) measured up to ``scored_until``; returns the rows written."""
    rows = [{"r": replay_id, "policy": policy, "model_id": str(row["model_id"]),
             **{c: row[c] for c in OUTCOME_COLUMNS}}
            for policy, table in outcomes.items() for row in table]
    conn.execute(text("DELETE FROM replay_outcomes WHERE replay_id = :r"), {"r": replay_id})
    if rows:
        conn.execute(text(
            f"INSERT INTO replay_outcomes (replay_id, policy, model_id, {', '.join(OUTCOME_COLUMNS)}) "
            f"VALUES (:r, :policy, :model_id, {', '.join(':' + c for c in OUTCOME_COLUMNS)})"), rows)
    conn.execute(text("UPDATE replays SET scored_until = :u, summary = :sum, updated_at = now() WHERE id = :r")
                 .bindparams(bindparam("sum", type_=JSONB)), {"u": scored_until, "sum": summary, "r": replay_id})
    return len(rows)


@dataclass(frozen=True)
class ModelComparison:
    """One model's outcome under the subject policy (prewarm) and the baseline (reactive).

    Attributes:
        model_id: the serving model.
        subject: :data:`OUTCOME_COLUMNS` under the subject policy (zeros when it has no row).
        baseline: the same under the baseline.
        cold_requests_avoided: baseline cold requests minus the subject's (negative: the subject had more).
        wait_saved_s: baseline total wait minus the subject's, seconds.
    """

    model_id: str
    subject: dict
    baseline: dict
    cold_requests_avoided: int
    wait_saved_s: float


@dataclass(frozen=True)
class ReplayView:
    """The newest replay: its window, how far both simulators got, totals per policy and one page of the
    per-model rows (``models``) of the ``model_count`` models asked for."""

    id: int
    source: str
    window_start: datetime
    window_end: datetime
    scored_until: datetime
    subject: str
    baseline: str
    summary: dict
    totals: dict[str, dict]
    models: list[ModelComparison] = field(default_factory=list)
    model_count: int = 0


def _zero() -> dict:
    return {c: 0 for c in OUTCOME_COLUMNS[:3]} | {"wait_total_s": 0.0, "wait_max_s": 0.0}


#: Per policy, the whole replay: counts and waits summed, the longest wait.
_TOTALS_SQL = """
SELECT policy, CAST(sum(requests) AS bigint) AS requests, CAST(sum(cold_requests) AS bigint) AS cold_requests,
       CAST(sum(replica_starts) AS bigint) AS replica_starts, sum(wait_total_s) AS wait_total_s,
       max(wait_max_s) AS wait_max_s
FROM replay_outcomes WHERE replay_id = :r GROUP BY policy ORDER BY policy"""


def read_latest_replay(conn: Connection, *, source: str | None = None, model_id: str | None = None,
                       limit: int | None = None, offset: int = 0) -> ReplayView | None:
    """The newest replay (of ``source`` when given) and one page of its per-model comparison, or None when no
    replay is stored.

    The models (those with any outcome row; only ``model_id`` when given) are ordered by id; ``models`` holds
    ``limit`` of them (None: all) from ``offset`` on and ``model_count`` counts them all. Totals always cover
    every model. PostgreSQL sums the totals (GROUP BY policy) and reads the outcome rows of the page's models
    only: a fleet page reads no model's row (``limit=0``), a model's page its own two.
    """
    replay = conn.execute(text(
        "SELECT id, source, window_start, window_end, scored_until, policies, summary FROM replays "
        "WHERE (CAST(:src AS text) IS NULL OR source = :src) ORDER BY created_at DESC, id DESC LIMIT 1"),
        {"src": source}).mappings().first()
    if replay is None:
        return None
    subject, baseline = replay["policies"][:2]
    params = {"r": replay["id"], "m": model_id, "n": limit, "o": offset, "subject": subject, "baseline": baseline}
    totals = {subject: _zero(), baseline: _zero()}
    for row in conn.execute(text(_TOTALS_SQL), params).mappings():
        totals[row["policy"]] = {c: row[c] for c in OUTCOME_COLUMNS[:3]} | {
            "wait_total_s": float(row["wait_total_s"]), "wait_max_s": max(0.0, float(row["wait_max_s"]))}
    which = "replay_id = :r" + ("" if model_id is None else " AND model_id = :m")
    # grouped, not count(DISTINCT): hashed, where count(DISTINCT) sorts every id by the collation
    count = conn.execute(text(f"SELECT count(*) FROM (SELECT model_id FROM replay_outcomes WHERE {which} "
                              "GROUP BY model_id) m"), params).scalar_one()
    by_model: dict[str, dict[str, dict]] = {}
    if limit is None or limit > 0:
        rows = conn.execute(text(
            f"WITH page AS (SELECT model_id FROM replay_outcomes WHERE {which} GROUP BY model_id "
            "ORDER BY model_id LIMIT CAST(:n AS bigint) OFFSET :o) "
            f"SELECT page.model_id, o.policy, {', '.join('o.' + c for c in OUTCOME_COLUMNS)} FROM page "
            "LEFT JOIN replay_outcomes o ON o.replay_id = :r AND o.model_id = page.model_id "
            "AND o.policy IN (:subject, :baseline) ORDER BY page.model_id"), params).mappings()
        for row in rows:
            figures = by_model.setdefault(row["model_id"], {})
            if row["policy"] is not None:
                figures[row["policy"]] = {c: row[c] for c in OUTCOME_COLUMNS}
    models = []
    for mid, policies in by_model.items():
        mine, theirs = policies.get(subject, _zero()), policies.get(baseline, _zero())
        models.append(ModelComparison(model_id=mid, subject=mine, baseline=theirs,
                                      cold_requests_avoided=int(theirs["cold_requests"] - mine["cold_requests"]),
                                      wait_saved_s=float(theirs["wait_total_s"] - mine["wait_total_s"])))
    return ReplayView(id=replay["id"], source=replay["source"], window_start=replay["window_start"],
                      window_end=replay["window_end"], scored_until=replay["scored_until"], subject=subject,
                      baseline=baseline, summary=dict(replay["summary"] or {}), totals=totals, models=models,
                      model_count=int(count))


#: Actuator backends whose records a demo replay may clear from its window (neither touches a real cluster).
REPLAY_BACKENDS = ("dry-run", "simulated")


def forget_replay_window(conn: Connection, *, start: datetime, cold_start_source: str,
                         stale_nodes_like: str | None = None) -> dict:
    """Clear what earlier replays left from ``start`` on, so a re-run's dashboard and state are this run's only.

    Deletes the plans made from ``start`` on, the dry-run and simulated actions due from then on, the cold starts
    ``cold_start_source`` recorded from then on and (``stale_nodes_like``, a SQL ``LIKE`` pattern) nodes an earlier
    demo registered under other names. Real backends' actions and other sources' cold starts stay.

    Everything from ``start`` on, not only the new run's window: a shorter re-run over a longer replay's history
    otherwise met that history's later actions as the present (the fleet read's newest succeeded scale of a model,
    the actuator's starts in the last minute), and a 120-minute demo after a 6-hour one had every action dropped as
    ``rate_limited``.
    """
    window = {"s": start}
    deleted = conn.execute(text(
        "DELETE FROM actions WHERE backend = ANY(:b) AND coalesce(not_before, updated_at) >= :s "
        "RETURNING kind, model_id, status"), {"s": start, "b": list(REPLAY_BACKENDS)}).all()
    actions = len(deleted)
    refresh_ahead(conn, ahead_models(deleted))
    count_deleted(conn, [(kind, status) for kind, _, status in deleted])
    plans = conn.execute(text(
        "DELETE FROM plans p WHERE planned_at >= :s "
        "AND NOT EXISTS (SELECT 1 FROM actions a WHERE a.plan_id = p.id)"), window).rowcount
    cold = conn.execute(text(
        "DELETE FROM cold_starts WHERE source = :src AND started_at >= :s"),
        {**window, "src": cold_start_source}).rowcount
    nodes = 0
    if stale_nodes_like:
        nodes = conn.execute(text("DELETE FROM nodes WHERE id LIKE :like"), {"like": stale_nodes_like}).rowcount
    return {"actions": actions, "plans": plans, "cold_starts": cold, "nodes": nodes}


def next_pending_at(conn: Connection) -> datetime | None:
    """When the earliest pending action falls due (its retry time, else its not-before; 1970 when it has neither,
    i.e. due now), or None when nothing is pending. A replay polls the actuator only then."""
    return conn.execute(text(
        "SELECT min(COALESCE(next_attempt_at, not_before, TIMESTAMPTZ '1970-01-01 00:00+00')) FROM actions "
        "WHERE status = 'pending'")).scalar()


def replay_action_statuses(conn: Connection, *, start: datetime, end: datetime,
                           backend: str = "simulated") -> dict[str, int]:
    """Actions ``backend`` carried (or refused to carry) out that were planned in ``[start, end)``, by final
    status, and by ``status:reason`` for those that did not succeed (``dropped:below_reactive``)."""
    rows = conn.execute(text(
        "SELECT status, status_reason, count(*) FROM actions WHERE backend = :b "
        "AND coalesce(not_before, updated_at) >= :s AND coalesce(not_before, updated_at) < :e "
        "GROUP BY status, status_reason"), {"b": backend, "s": start, "e": end}).all()
    out: dict[str, int] = {}
    for status, reason, n in rows:
        out[status] = out.get(status, 0) + int(n)
        if status != "succeeded" and reason:
            out[f"{status}:{reason}"] = out.get(f"{status}:{reason}", 0) + int(n)
    return out
