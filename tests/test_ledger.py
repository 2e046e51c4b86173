"""The two action ledgers hold the same records the same way: one table of cases, run on the store and in memory."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from forecaster.actuation.backends.base import ModelTarget
from forecaster.actuation.ledger import MemoryLedger, StoreLedger
from forecaster.contracts.actions import Action, ActionKind, ActionStatus, FailureReason, Plan, Reason
from forecaster.store.catalog import ServingModelSpec, upsert_models

NOW = datetime(2026, 12, 1, 10, 0, tzinfo=timezone.utc)
MIN = timedelta(minutes=1)


def scale(model: str, replicas: int, *, at: datetime = NOW, deadline_min: int = 10) -> Action:
    return Action(kind=ActionKind.SCALE, model_id=model, reason=Reason.FORECAST_SPIKE, not_before=at,
                  deadline=at + deadline_min * MIN, replicas=replicas)


@pytest.fixture(params=["store", "memory"])
def ledger(request):
    targets = {m: ModelTarget(model_id=m, gpus_per_replica=2) for m in ("a", "b")}
    if request.param == "memory":
        return MemoryLedger(targets)
    engine = request.getfixturevalue("engine")
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m, gpus_per_replica=2) for m in ("a", "b")])
    return StoreLedger(engine)


def test_same_work_is_merged_into_one_open_unit(ledger):
    with ledger.session() as s:
        plan_id = s.record_plan(Plan(planned_at=NOW))
        first, merged_first = s.submit_action(plan_id, scale("a", 3, at=NOW + 2 * MIN), backend="t", now=NOW)
        second, merged_second = s.submit_action(plan_id, scale("a", 3, at=NOW + MIN, deadline_min=30), backend="t",
                                                now=NOW)
        other, _ = s.submit_action(plan_id, scale("a", 4), backend="t", now=NOW)
    assert (merged_first, merged_second) == (False, True) and first == second and other != first
    with ledger.session() as s:
        due = s.due_actions(NOW + MIN, 10)
    # the merged unit now starts at the earlier not-before and ends at the later deadline; "other" is due too,
    # ordered by deadline
    assert [r["id"] for r in due] == [other, first]
    assert datetime.fromisoformat(str(due[1]["deadline"])) == NOW + MIN + 30 * MIN


def test_due_respects_not_before_and_retry_times(ledger):
    with ledger.session() as s:
        later, _ = s.submit_action(None, scale("a", 2, at=NOW + 5 * MIN), backend="t", now=NOW)
        now_id, _ = s.submit_action(None, scale("b", 2), backend="t", now=NOW)
    with ledger.session() as s:
        assert [r["id"] for r in s.due_actions(NOW, 10)] == [now_id]
        s.mark(now_id, ActionStatus.RUNNING, now=NOW, start=True)
        s.mark(now_id, ActionStatus.PENDING, now=NOW, reason=FailureReason.INTERNAL, next_attempt_at=NOW + 2 * MIN)
    with ledger.session() as s:
        assert s.due_actions(NOW + MIN, 10) == []
        # both due now, the earlier deadline first; asking again returns the same (nothing is taken until marked)
        assert [r["id"] for r in s.due_actions(NOW + 5 * MIN, 10)] == [now_id, later]
        assert [r["id"] for r in s.due_actions(NOW + 5 * MIN, 1)] == [now_id]


def test_starts_are_counted_per_minute(ledger):
    with ledger.session() as s:
        ids = [s.submit_action(None, scale("a", r), backend="t", now=NOW)[0] for r in (1, 2, 3)]
        for i, action_id in enumerate(ids):
            s.mark(action_id, ActionStatus.RUNNING, now=NOW + i * 40 * timedelta(seconds=1), start=True)
    with ledger.session() as s:
        assert s.started_since(NOW, NOW + 2 * MIN) == 3
        # starts after the clock are not "in the last minute" (a re-run replay over a longer one's history)
        assert s.started_since(NOW - MIN, NOW + timedelta(seconds=40)) == 2
        assert s.started_since(NOW + timedelta(seconds=30), NOW + 2 * MIN) == 2
        assert s.started_since(NOW + 2 * MIN, NOW + 3 * MIN) == 0


def test_gpus_ahead_follow_the_latest_counted_scale(ledger):
    with ledger.session() as s:
        a1, _ = s.submit_action(None, scale("a", 2), backend="t", now=NOW)
        s.mark(a1, ActionStatus.RUNNING, now=NOW, start=True)
        s.mark(a1, ActionStatus.SUCCEEDED, now=NOW, detail={"ahead_gpus": 4})
        b1, _ = s.submit_action(None, scale("b", 3), backend="t", now=NOW)
        s.mark(b1, ActionStatus.RUNNING, now=NOW, start=True, detail={"ahead_gpus": 6})
    with ledger.session() as s:
        assert s.ahead_gpus_total() == 10
        assert s.ahead_gpus_total(excluding="a") == 6
        a2, _ = s.submit_action(None, scale("a", 5), backend="t", now=NOW + MIN)
        s.mark(a2, ActionStatus.RUNNING, now=NOW + MIN, start=True, detail={"ahead_gpus": 8})
    with ledger.session() as s:
        assert s.ahead_gpus_total() == 14
        # the newer scale of "a" fails: its older, succeeded one counts again
        s.mark(a2, ActionStatus.FAILED, now=NOW + MIN, reason=FailureReason.INTERNAL)
    with ledger.session() as s:
        assert s.ahead_gpus_total() == 10


def test_lost_running_actions_are_reaped(ledger):
    with ledger.session() as s:
        action_id, _ = s.submit_action(None, scale("a", 2, deadline_min=1), backend="t", now=NOW)
        s.mark(action_id, ActionStatus.RUNNING, now=NOW, start=True)
    with ledger.session() as s:
        assert s.reap_lost(NOW + 3 * MIN) == 0  # inside the grace after the deadline
        assert s.reap_lost(NOW + 7 * MIN) == 1
        # a reaped unit is closed: the same work is a new unit
        again, merged = s.submit_action(None, scale("a", 2), backend="t", now=NOW + 7 * MIN)
    assert not merged and again != action_id


def test_model_targets_come_from_the_catalogue(ledger):
    targets = ledger.model_targets({"a", "zzz"})
    assert set(targets) == {"a"} and targets["a"].gpus_per_replica == 2


#: What the store read for the GPUs ahead before migration 0015 kept them per model: the whole history's latest.
HISTORY_AHEAD = (
    "SELECT DISTINCT ON (model_id) model_id, COALESCE((detail->>'ahead_gpus')::int, 0) FROM actions "
    "WHERE kind IN ('scale', 'release') AND status IN ('succeeded', 'running') AND detail ? 'ahead_gpus' "
    "ORDER BY model_id, COALESCE(finished_at, started_at) DESC NULLS LAST, id DESC")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("keep_finished", [True, False])
def test_gpus_ahead_kept_per_model_equal_the_history_and_the_memory_ledger(engine, seed, keep_finished):
    """Random scales and releases of three models, their open ones marked to any status (ties in time included),
    and reaped: after each step the store's per-model rows equal the latest-counted rule read over the
    whole history, its action counts the count over the table, and both ledgers give the same totals."""
    import random

    from sqlalchemy import text

    from forecaster.store import actions as store_actions

    rng = random.Random(seed)
    models = ("a", "b", "c")
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m, gpus_per_replica=2) for m in models])
    store = StoreLedger(engine)
    memory = MemoryLedger({m: ModelTarget(model_id=m, gpus_per_replica=2) for m in models},
                          keep_finished=keep_finished)
    pairs: list[tuple[int, int]] = []
    at = NOW
    statuses = (ActionStatus.RUNNING, ActionStatus.SUCCEEDED, ActionStatus.FAILED, ActionStatus.DROPPED,
                ActionStatus.PENDING)
    for _ in range(40):
        at += timedelta(seconds=rng.choice((0, 0, 1, 30)))
        with store.session() as s, memory.session() as m:
            if not pairs or rng.random() < 0.35:
                kind = rng.choice((ActionKind.SCALE, ActionKind.RELEASE))
                action = Action(kind=kind, model_id=rng.choice(models), reason=Reason.FORECAST_SPIKE,
                                not_before=at, deadline=at + rng.choice((1, 10)) * MIN, replicas=rng.randint(0, 4))
                (sid, merged), (mid, _) = (s.submit_action(None, action, backend="t", now=at),
                                           m.submit_action(None, action, backend="t", now=at))
                if not merged:
                    pairs.append((sid, mid))
            else:
                sid, mid = rng.choice(pairs)
                status = rng.choice(statuses)
                detail = rng.choice((None, {"ahead_gpus": rng.randint(0, 6)}, {"ahead_gpus": 0}, {"note": 1}))
                kwargs = dict(now=at, detail=detail, start=status is ActionStatus.RUNNING,
                              reason=None if status is not ActionStatus.FAILED else FailureReason.INTERNAL)
                s.mark(sid, status, **kwargs)
                m.mark(mid, status, **kwargs)
            if rng.random() < 0.1:  # running past its deadline: failed as lost
                assert s.reap_lost(at + 20 * MIN) == m.reap_lost(at + 20 * MIN)
        with engine.connect() as conn:
            history = {model: gpus for model, gpus in conn.execute(text(HISTORY_AHEAD)) if gpus}
            assert store_actions.ahead_gpus(conn) == history
            assert store_actions.action_counts(conn) == [tuple(r) for r in conn.execute(text(
                "SELECT kind, status, count(*), 0 FROM actions GROUP BY 1, 2 ORDER BY 1, 2"))]
        with store.session() as s, memory.session() as m:
            for excluded in (None, *models):
                assert s.ahead_gpus_total(excluding=excluded) == m.ahead_gpus_total(excluding=excluded)
        with engine.connect() as conn:  # a finished action is never marked again (the actuator revives none)
            open_ids = set(conn.execute(text("SELECT id FROM actions WHERE status IN ('pending', 'running')"))
                           .scalars())
        pairs = [(sid, mid) for sid, mid in pairs if sid in open_ids]


def test_two_sessions_marking_the_same_models_in_opposite_orders_both_commit(engine):
    """Two actuator processes marking scales of models x and y, one x then y and the other y then x, at the same
    time: each session locks its models' GPUs-ahead rows once, in id order, when it ends, so neither waits on the
    other's half (locked as each mark came, the two would deadlock and PostgreSQL would abort one)."""
    import threading

    from sqlalchemy import text

    from forecaster.store import actions as store_actions

    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m, gpus_per_replica=2) for m in ("x", "y")])
    ledger = StoreLedger(engine)
    with ledger.session() as s:
        ids = {(who, m): s.submit_action(None, scale(m, 2 + (who == "b")), backend="t", now=NOW)[0]
               for who in ("a", "b") for m in ("x", "y")}
    both_marked_once = threading.Barrier(2, timeout=30)
    errors: list[BaseException] = []

    def actuator(who: str, order: tuple[str, str], gpus: int) -> None:
        try:
            with ledger.session() as s:
                for i, model in enumerate(order):
                    s.mark(ids[(who, model)], ActionStatus.RUNNING, now=NOW, start=True,
                           detail={"ahead_gpus": gpus})
                    if i == 0:
                        both_marked_once.wait()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=actuator, args=("a", ("x", "y"), 4)),
               threading.Thread(target=actuator, args=("b", ("y", "x"), 6))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    with engine.connect() as conn:
        history = {model: gpus for model, gpus in conn.execute(text(HISTORY_AHEAD)) if gpus}
        assert store_actions.ahead_gpus(conn) == history and set(history) == {"x", "y"}


def test_action_counts_follow_a_replay_window_forgotten(engine):
    """A re-run replay deletes its window's dry-run actions: the counts /metrics reads drop by what was deleted
    (a running one: it leaves the open gauge, and nothing finished to count)."""
    from sqlalchemy import text

    from forecaster.store import actions as store_actions
    from forecaster.store.replays import forget_replay_window

    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m, gpus_per_replica=2) for m in ("a", "b")])
    ledger = StoreLedger(engine)
    with ledger.session() as s:
        kept, _ = s.submit_action(None, scale("a", 2, at=NOW - 60 * MIN), backend="kubernetes", now=NOW)
        replayed, _ = s.submit_action(None, scale("b", 3), backend="dry-run", now=NOW)
        s.mark(replayed, ActionStatus.RUNNING, now=NOW, start=True, detail={"ahead_gpus": 2})
    with engine.begin() as conn:
        assert store_actions.action_counts(conn) == [("scale", "pending", 1, 0), ("scale", "running", 1, 0)]
        assert store_actions.ahead_gpus(conn) == {"b": 2}
        assert forget_replay_window(conn, start=NOW - MIN, cold_start_source="x")["actions"] == 1
    with engine.connect() as conn:
        assert store_actions.action_counts(conn) == [tuple(r) for r in conn.execute(text(
            "SELECT kind, status, count(*), 0 FROM actions GROUP BY 1, 2 ORDER BY 1, 2"))] == [("scale", "pending", 1, 0)]
        assert store_actions.ahead_gpus(conn) == {}


def test_the_scheduler_start_heals_counts_and_gpus_ahead_moved_without_them(engine, settings):
    """Actions written past the tables (a scheduler of older code running while migration 0015 ran, SQL by hand):
    the scheduler's start recounts both from the history."""
    from sqlalchemy import text

    from forecaster.jobs.scheduler import build_scheduler
    from forecaster.store import actions as store_actions

    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m, gpus_per_replica=2) for m in ("a", "b")])
        for model, status, detail in (("a", "succeeded", '{"ahead_gpus": 4}'), ("b", "failed", '{"ahead_gpus": 2}'),
                                      ("b", "pending", "{}")):
            conn.execute(text("INSERT INTO actions (kind, model_id, status, detail, started_at, finished_at) VALUES "
                              "('scale', :m, :s, CAST(:d AS jsonb), :t, :t)"), {"m": model, "s": status, "d": detail,
                                                                                 "t": NOW})
    with engine.connect() as conn:
        assert store_actions.action_counts(conn) == [] and store_actions.ahead_gpus(conn) == {}
    from apscheduler.schedulers.background import BackgroundScheduler

    build_scheduler(engine, settings, BackgroundScheduler())
    with engine.connect() as conn:
        assert store_actions.action_counts(conn) == [("scale", "failed", 1, 0), ("scale", "pending", 1, 0),
                                                     ("scale", "succeeded", 1, 0)]
        assert store_actions.ahead_gpus(conn) == {"a": 4}


def test_a_re_run_replay_forgets_what_a_longer_one_left_after_its_start(engine):
    """A 120-minute demo after a 6-hour one: the longer run's later actions, plans and cold starts go (they were
    read as the present: every action of the re-run was dropped as rate_limited); a real backend's stay, and so
    does what came before the re-run's start."""
    from sqlalchemy import text

    from forecaster.store.replays import forget_replay_window

    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m, gpus_per_replica=2) for m in ("a", "b")])
    ledger = StoreLedger(engine)
    later = NOW + 300 * MIN
    with ledger.session() as s:
        plan_id = s.record_plan(Plan(planned_at=later))
        stale, _ = s.submit_action(plan_id, scale("a", 3, at=later), backend="simulated", now=later)
        s.mark(stale, ActionStatus.SUCCEEDED, now=later, start=True)
        real, _ = s.submit_action(None, scale("b", 2, at=later), backend="kubernetes", now=later)
        before, _ = s.submit_action(None, scale("b", 4, at=NOW - 10 * MIN), backend="simulated", now=NOW - 10 * MIN)
        s.record_plan(Plan(planned_at=later + MIN))
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO cold_starts (model_id, node_id, started_at, total_seconds, cache_state, source) "
                          "VALUES ('a', 'n', :t, 40, 'none', 'demo')"), {"t": later})
        forgotten = forget_replay_window(conn, start=NOW, cold_start_source="demo")
    assert forgotten == {"actions": 1, "plans": 2, "cold_starts": 1, "nodes": 0}
    with engine.connect() as conn:
        assert sorted(conn.execute(text("SELECT id FROM actions")).scalars()) == sorted([real, before])
    with ledger.session() as s:
        assert s.started_since(NOW - MIN, NOW) == 0
