"""Retention of plans, finished actions and job runs (:mod:`forecaster.store.history_retention`) on a real
PostgreSQL: what goes, what the present still reads and therefore stays, and the counts ``/metrics`` reports."""

from __future__ import annotations

import random
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import text

from forecaster.actuation.ledger import StoreLedger
from forecaster.contracts.actions import Action, ActionKind, ActionStatus, FailureReason, Plan, Reason
from forecaster.settings import Settings
from forecaster.store import actions as store_actions
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.history_retention import apply_history_retention, prune_actions, prune_job_runs, prune_plans
from forecaster.store.job_runs import LATEST_JOB_RUNS_SQL
from tests.test_ledger import HISTORY_AHEAD

NOW = datetime(2026, 12, 1, 10, 0, tzinfo=timezone.utc)
DAY = timedelta(days=1)
MODELS = ("a", "b", "c", "d")
#: What the plan job's fleet read takes as a model's replicas: its newest succeeded scale or release.
HISTORY_REPLICAS = ("SELECT DISTINCT ON (model_id) model_id, spec->>'replicas' FROM actions WHERE kind IN "
                    "('scale', 'release') AND status = 'succeeded' ORDER BY model_id, updated_at DESC, id DESC")
FINISHED = {"succeeded", "failed", "dropped"}


def action(kind: ActionKind, model: str, at: datetime, replicas: int) -> Action:
    if kind in (ActionKind.SCALE, ActionKind.RELEASE):
        return Action(kind=kind, model_id=model, reason=Reason.FORECAST_SPIKE, not_before=at,
                      deadline=at + timedelta(minutes=10), replicas=replicas)
    return Action(kind=kind, model_id=model, node_id="n1", target=f"registry/{model}:1", reason=Reason.FORECAST_SPIKE,
                  not_before=at, deadline=at + timedelta(minutes=10))


def random_history(engine, rng: random.Random, steps: int = 150) -> datetime:
    """Plans and actions of four models through the real ledger over about 60 days (ties in time included); returns
    the last moment."""
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m, gpus_per_replica=2) for m in MODELS])
    ledger = StoreLedger(engine)
    at, open_ids = NOW - 60 * DAY, []
    kinds = (ActionKind.SCALE, ActionKind.RELEASE, ActionKind.SCALE, ActionKind.PREPULL)
    statuses = (ActionStatus.RUNNING, ActionStatus.SUCCEEDED, ActionStatus.SUCCEEDED, ActionStatus.FAILED,
                ActionStatus.DROPPED, ActionStatus.PENDING)
    for _ in range(steps):
        at += rng.choice((timedelta(0), timedelta(seconds=1), timedelta(hours=3), DAY))
        with ledger.session() as s:
            if not open_ids or rng.random() < 0.4:
                plan_id = s.record_plan(Plan(planned_at=at)) if rng.random() < 0.7 else None
                new_id, merged = s.submit_action(plan_id, action(rng.choice(kinds), rng.choice(MODELS), at,
                                                                 rng.randint(0, 4)), backend="t", now=at)
                if not merged:
                    open_ids.append(new_id)
            else:
                chosen = rng.choice(open_ids)
                status = rng.choice(statuses)
                s.mark(chosen, status, now=at, start=status is ActionStatus.RUNNING,
                       detail=rng.choice((None, {"ahead_gpus": rng.randint(0, 6)}, {"ahead_gpus": 0})),
                       reason=FailureReason.INTERNAL if status is ActionStatus.FAILED else None)
                if status not in (ActionStatus.PENDING, ActionStatus.RUNNING):
                    open_ids.remove(chosen)
    return at


def state(conn) -> dict:
    """What the present reads of the history, and the counts."""
    counts = store_actions.action_counts(conn)
    return {
        "replicas": dict(conn.execute(text(HISTORY_REPLICAS)).all()),
        "ahead_history": {m: g for m, g in conn.execute(text(HISTORY_AHEAD)) if g},
        "ahead_kept": store_actions.ahead_gpus(conn),
        "finished": {(k, s): n + p for k, s, n, p in counts if s in FINISHED},
        "open": {(k, s): n for k, s, n, _ in counts if s not in FINISHED and n},
        "in_table": {(k, s): n for k, s, n, _ in counts if n},
        "group_by": {(k, s): n for k, s, n in conn.execute(text(
            "SELECT kind, status, count(*) FROM actions GROUP BY 1, 2"))},
    }


def action_rows(conn) -> dict[int, tuple]:
    return {r[0]: tuple(r[1:]) for r in conn.execute(text(
        "SELECT id, kind, model_id, status, coalesce(finished_at, updated_at) FROM actions"))}


@pytest.mark.parametrize("seed", range(5))
def test_old_finished_actions_go_but_what_the_present_reads_stays(engine, seed):
    """After pruning (in batches of 1 to 7 rows): only finished actions older than the cutoff are gone; each
    model's replicas and GPUs ahead read the same from the history, the counts equal the table, and each finished
    status' count for /metrics (in the table + pruned) is what it was. A second run deletes nothing."""
    rng = random.Random(seed)
    last = random_history(engine, rng)
    before = last - timedelta(days=rng.choice((5, 20, 40)))
    with engine.connect() as conn:
        was, rows_before = state(conn), action_rows(conn)
    assert was["in_table"] == was["group_by"]
    pruned = prune_actions(engine, before=before, batch_rows=rng.randint(1, 7))
    with engine.connect() as conn:
        now, rows_after = state(conn), action_rows(conn)
    gone = set(rows_before) - set(rows_after)
    assert pruned.deleted == len(gone) > 0 and not pruned.more
    assert all(rows_before[i][2] in FINISHED and rows_before[i][3] < before for i in gone)
    old_left = [i for i, row in rows_after.items() if row[2] in FINISHED and row[3] < before]
    assert pruned.kept == len(old_left)
    assert all(rows_after[i][0] in ("scale", "release") for i in old_left)  # only a model's newest scale kinds stay
    assert now["replicas"] == was["replicas"]
    assert now["ahead_history"] == was["ahead_history"] == now["ahead_kept"] == was["ahead_kept"]
    assert now["in_table"] == now["group_by"]
    assert now["finished"] == was["finished"] and now["open"] == was["open"]
    store_actions.reconcile_action_state(engine)  # the scheduler's recount at start: same counts, pruned kept
    with engine.connect() as conn:
        assert state(conn) == now
    assert prune_actions(engine, before=before).deleted == 0


def test_the_newest_scale_of_a_model_idle_for_months_stays(engine):
    """A model scaled to 3 sixty days ago and not since: its scale stays (the plan job reads 3 replicas, the
    actuator 2 GPUs ahead), its older scale and pre-pull go, its open action stays."""
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="m", gpus_per_replica=2)])
    ledger = StoreLedger(engine)
    ids = {}
    for name, kind, at, replicas in (("old", ActionKind.SCALE, NOW - 62 * DAY, 1),
                                     ("pull", ActionKind.PREPULL, NOW - 61 * DAY, 0),
                                     ("newest", ActionKind.SCALE, NOW - 60 * DAY, 3)):
        with ledger.session() as s:
            ids[name] = s.submit_action(None, action(kind, "m", at, replicas), backend="t", now=at)[0]
            s.mark(ids[name], ActionStatus.SUCCEEDED, now=at, detail={"ahead_gpus": 2 * replicas - 2})
    with ledger.session() as s:
        ids["open"] = s.submit_action(None, action(ActionKind.PREPULL, "m", NOW - 59 * DAY, 0), backend="t",
                                      now=NOW - 59 * DAY)[0]
    assert prune_actions(engine, before=NOW - 30 * DAY).deleted == 2
    with engine.connect() as conn:
        assert sorted(conn.execute(text("SELECT id FROM actions")).scalars()) == sorted([ids["newest"], ids["open"]])
        assert dict(conn.execute(text(HISTORY_REPLICAS)).all()) == {"m": "3"}
        assert store_actions.ahead_gpus(conn) == {"m": 4}
        assert store_actions.action_counts(conn) == [("prepull", "pending", 1, 0), ("prepull", "succeeded", 0, 1),
                                                     ("scale", "succeeded", 1, 1)]


def test_a_replay_window_forgotten_moves_its_finished_actions_to_pruned(engine):
    """A demo re-run deleting its window's finished dry-run actions does not lower /metrics' counter either."""
    from forecaster.store.replays import forget_replay_window

    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="m", gpus_per_replica=2)])
    ledger = StoreLedger(engine)
    with ledger.session() as s:
        done = s.submit_action(None, action(ActionKind.PREPULL, "m", NOW, 0), backend="dry-run", now=NOW)[0]
        s.mark(done, ActionStatus.SUCCEEDED, now=NOW)
    with engine.begin() as conn:
        forget_replay_window(conn, start=NOW - DAY, cold_start_source="x")
    with engine.connect() as conn:
        assert store_actions.action_counts(conn) == [("prepull", "succeeded", 0, 1)]


def test_old_plans_go_unless_an_action_still_belongs_to_them(engine):
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="m", gpus_per_replica=2)])
    ledger = StoreLedger(engine)
    plans = {}
    with ledger.session() as s:
        for name, days in (("empty_old", 40), ("kept_by_scale", 39), ("young", 3)):
            plans[name] = s.record_plan(Plan(planned_at=NOW - days * DAY))
        scaled = s.submit_action(plans["kept_by_scale"], action(ActionKind.SCALE, "m", NOW - 39 * DAY, 2),
                                 backend="t", now=NOW - 39 * DAY)[0]
        s.mark(scaled, ActionStatus.SUCCEEDED, now=NOW - 39 * DAY)
    assert prune_actions(engine, before=NOW - 30 * DAY).deleted == 0  # the model's newest scale
    pruned = prune_plans(engine, before=NOW - 30 * DAY, batch_rows=1)
    assert (pruned.deleted, pruned.kept) == (1, 1)
    with engine.connect() as conn:
        assert set(conn.execute(text("SELECT id FROM plans")).scalars()) == {plans["kept_by_scale"], plans["young"]}
        assert conn.execute(text("SELECT plan_id FROM actions")).scalar_one() == plans["kept_by_scale"]


def test_old_job_runs_go_but_each_jobs_newest_finished_run(engine):
    """Runs older than the cutoff go in batches; a job whose last finished run is older (stopped for months)
    keeps it, so /metrics still reports it; the answer of /metrics' read is what it was."""
    with engine.begin() as conn:
        for job, first, count in (("plan", 50, 50), ("nightly", 90, 3)):
            for i in range(count):
                slot = NOW - (first - i) * DAY
                conn.execute(text("INSERT INTO job_runs (job_name, slot, started_at, finished_at, status) VALUES "
                                  "(:j, :s, :s, :f, :st)"),
                             {"j": job, "s": slot, "f": slot + timedelta(seconds=5 + i), "st": "ok"})
        conn.execute(text("INSERT INTO job_runs (job_name, slot, status) VALUES ('plan', :s, 'running')"),
                     {"s": NOW - 45 * DAY + timedelta(minutes=1)})  # its process died: not a finished run
        newest = conn.execute(text(LATEST_JOB_RUNS_SQL)).all()
    pruned = prune_job_runs(engine, before=NOW - 30 * DAY, batch_rows=4)
    assert pruned.deleted == 20 + 1 + 2  # plan: days 50..31 and the dead run; nightly: all but its newest
    with engine.connect() as conn:
        assert conn.execute(text(LATEST_JOB_RUNS_SQL)).all() == newest
        left = conn.execute(text("SELECT job_name, count(*), min(slot) FROM job_runs GROUP BY 1 ORDER BY 1")).all()
    assert left == [("nightly", 1, NOW - 88 * DAY), ("plan", 30, NOW - 30 * DAY)]


def test_ages_count_from_the_newest_plan_so_a_stopped_store_keeps_its_history(engine, settings):
    """A demo's replay of a trace day years ago, read by a scheduler started today: its plans and actions stay;
    job runs age by the wall clock."""
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="m", gpus_per_replica=2)])
    replayed = datetime(2019, 7, 18, 12, 0, tzinfo=timezone.utc)
    ledger = StoreLedger(engine)
    with ledger.session() as s:
        plan_id = s.record_plan(Plan(planned_at=replayed))
        pulled = s.submit_action(plan_id, action(ActionKind.PREPULL, "m", replayed, 0), backend="t", now=replayed)[0]
        s.mark(pulled, ActionStatus.SUCCEEDED, now=replayed)
        s.record_plan(Plan(planned_at=replayed - 40 * DAY))  # 40 days before the newest plan: goes
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO job_runs (job_name, slot, finished_at, status) VALUES ('plan', :s, :s, 'ok'), "
                          "('plan', :newest, :newest, 'ok')"), {"s": NOW - 41 * DAY, "newest": NOW - 40 * DAY})
    detail = apply_history_retention(engine, now=NOW, settings=settings)
    assert detail["actions"]["deleted"] == 0 and detail["plans"]["deleted"] == 1
    assert detail["job_runs"]["deleted"] == 1  # the older one; the newest finished run stays
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM actions")).scalar_one() == 1


def test_zero_days_keeps_forever_and_one_day_is_refused(engine, settings):
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO plans (planned_at, summary) VALUES (:t, '{}'), (:old, '{}')"),
                     {"t": NOW, "old": NOW - 400 * DAY})
    forever = settings.model_copy(update={"plans_retention_days": 0, "job_runs_retention_days": 0,
                                          "cold_starts_retention_days": 0})
    detail = apply_history_retention(engine, now=NOW, settings=forever)
    assert set(detail) == {"actions", "plans", "job_runs", "cold_starts", "transfers"}
    assert all("skipped" in v for v in detail.values())
    with pytest.raises(ValueError, match="PREWARM_PLANS_RETENTION_DAYS=1"):
        Settings(plans_retention_days=1)
    with pytest.raises(ValueError, match="shorter than PREWARM_LATENCY_TRAIN_DAYS=30"):
        Settings(cold_starts_retention_days=20)
    assert Settings(cold_starts_retention_days=0, latency_train_days=60).cold_starts_retention_days == 0
    assert apply_history_retention(engine, now=NOW, settings=settings)["plans"]["deleted"] == 1


def test_a_run_out_of_time_stops_and_the_next_goes_on(engine):
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO plans (planned_at, summary) SELECT :t - make_interval(mins => g), '{}' "
                          "FROM generate_series(1, 25) g"), {"t": NOW - 40 * DAY})
    first = prune_plans(engine, before=NOW - 30 * DAY, batch_rows=10, deadline=time.monotonic())
    assert (first.deleted, first.more) == (10, True)
    second = prune_plans(engine, before=NOW - 30 * DAY, batch_rows=10)
    assert (second.deleted, second.more) == (15, False)


def test_the_retention_job_prunes_the_history(engine, settings):
    from forecaster.jobs.scheduler import retention_job

    with engine.begin() as conn:
        conn.execute(text("INSERT INTO plans (planned_at, summary) VALUES (:t, '{}'), (:old, '{}')"),
                     {"t": NOW, "old": NOW - 31 * DAY})
    detail = retention_job(engine, settings, NOW)
    assert detail["history"]["plans"]["deleted"] == 1 and "invocations" in detail


def test_pruning_beside_a_busy_actuator_loses_no_count(engine):
    """Retention deleting (one row a batch) while an actuator submits and finishes actions of the same models in
    its own sessions: both finish without a deadlock or a lock wait error, and the counts equal the table, every
    finished action counted once."""
    rng = random.Random(7)
    random_history(engine, rng, steps=120)
    with engine.connect() as conn:
        finished_before = sum(n + p for _, s, n, p in store_actions.action_counts(conn) if s in FINISHED)
    ledger = StoreLedger(engine)
    errors: list[BaseException] = []
    finished_by_actuator = 0

    def actuator() -> None:
        nonlocal finished_by_actuator
        try:
            for i in range(60):
                at = NOW + timedelta(minutes=i)
                with ledger.session() as s:
                    new_id, merged = s.submit_action(None, action(ActionKind.SCALE, MODELS[i % 4], at, i % 3),
                                                     backend="t", now=at)
                    if not merged:
                        s.mark(new_id, ActionStatus.SUCCEEDED, now=at, detail={"ahead_gpus": i % 3})
                        finished_by_actuator += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    worker = threading.Thread(target=actuator)
    worker.start()
    pruned = prune_actions(engine, before=NOW, batch_rows=1)
    worker.join(60)
    assert not errors, errors
    with engine.connect() as conn:
        after = state(conn)
    assert after["in_table"] == after["group_by"] and after["ahead_kept"] == after["ahead_history"]
    assert sum(after["finished"].values()) == finished_before + finished_by_actuator
    assert pruned.deleted > 0


def insert_cold_starts(engine, model: str, days_before: list[float], newest: datetime = NOW) -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id) VALUES (:m) ON CONFLICT DO NOTHING"), {"m": model})
        # with a tier: the latency model never learns from a start of unknown tier (skipped, unknown_cache_state)
        conn.execute(text("INSERT INTO cold_starts (model_id, node_id, started_at, total_seconds, cache_state, "
                          "source) VALUES (:m, 'n1', :t, :s, 'none', 'test')"),
                     [{"m": model, "t": newest - d * DAY, "s": 10.0 + i} for i, d in enumerate(days_before)])


def test_old_cold_starts_go_but_each_models_newest_twenty(engine):
    """Cold starts older than the cutoff go, in batches; a model's newest 20 stay however old (a model not
    started for half a year keeps its rolling p90), so every model's rolling figures read the same after."""
    from forecaster.store.coldstarts import recent_cold_start_percentiles
    from forecaster.store.history_retention import prune_cold_starts

    insert_cold_starts(engine, "idle", [200 - i for i in range(30)])  # all old: the 10 oldest go
    insert_cold_starts(engine, "busy", [150 - i for i in range(25)] + [5, 4, 3, 2, 1])  # 10 oldest of 30 go
    insert_cold_starts(engine, "young", [3, 2, 1])
    with engine.connect() as conn:
        before = recent_cold_start_percentiles(conn, model_ids=["idle", "busy", "young"])
    pruned = prune_cold_starts(engine, before=NOW - 90 * DAY, batch_rows=7)
    assert (pruned.deleted, pruned.kept) == (20, 35)
    with engine.connect() as conn:
        assert recent_cold_start_percentiles(conn, model_ids=["idle", "busy", "young"]).equals(before)
        left = dict(conn.execute(text("SELECT model_id, count(*) FROM cold_starts GROUP BY 1")).all())
        oldest_left = conn.execute(text("SELECT min(total_seconds) FROM cold_starts WHERE model_id = 'idle'")).scalar()
    assert left == {"idle": 20, "busy": 20, "young": 3} and oldest_left == 20.0  # the newest 20 of idle's


def test_cold_starts_and_transfers_age_from_their_newest(engine, settings):
    """An imported trace of 2019's cold starts and transfers, read by the retention job in 2026: 90 days count back
    from each table's newest row, so only what is 90 days older than that goes."""
    newest = datetime(2019, 7, 18, tzinfo=timezone.utc)
    insert_cold_starts(engine, "m", [0] + [100 + i for i in range(25)], newest=newest)  # 5 beyond the newest 20 go
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO transfers (model_id, node_id, kind, tier, ref, bytes, started_at, seconds, source) "
            "VALUES ('m', 'n1', 'prepull', 'image', 'r', 1000, :t, 2.0, 'test')"),
            [{"t": newest - d * DAY} for d in (0, 10, 91, 95)])
    detail = apply_history_retention(engine, now=NOW, settings=settings)
    assert detail["cold_starts"]["deleted"] == 6 and detail["transfers"]["deleted"] == 2


def test_the_latency_retrain_learns_from_its_window_and_cap(engine, settings):
    """The newest ``latency_train_days`` before the newest cold start, at most ``latency_train_max_events`` of
    them: what the fit reads, recorded with the version."""
    from forecaster.coldstart.model import load_cold_starts
    from forecaster.store.transfers import read_transfers

    insert_cold_starts(engine, "m", [0.5 * i for i in range(100)])  # 50 days, two a day
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO transfers (model_id, node_id, kind, tier, ref, bytes, started_at, seconds, source) "
            "VALUES ('m', 'n1', 'prepull', 'image', 'r', 1000, :t, 2.0, 'test')"),
            [{"t": NOW - d * DAY} for d in (0, 10, 29, 31, 45)])
    window = load_cold_starts(engine, days=30)
    assert len(window) == 61 and window["started_at"].min() == NOW - 30 * DAY  # days 0, 0.5, ..., 30
    assert window["started_at"].is_monotonic_increasing
    capped = load_cold_starts(engine, days=30, max_events=7)
    assert list(capped["started_at"]) == [NOW - 0.5 * i * DAY for i in range(6, -1, -1)]
    assert len(load_cold_starts(engine)) == 100
    # counted back from `until` where it is before the newest (a row dated in the future moves nothing)
    assert load_cold_starts(engine, days=10, until=NOW - 20 * DAY)["started_at"].min() == NOW - 30 * DAY
    assert len(read_transfers(engine, days=30)) == 3 and len(read_transfers(engine)) == 5
    assert list(read_transfers(engine, max_rows=2)["started_at"]) == [NOW - 10 * DAY, NOW]
    from forecaster.coldstart.service import train_latency_model
    from forecaster.store.registry import champion_version
    from tests.test_lead_time import SMALL_TREES

    train_latency_model(engine, settings.model_copy(update={"latency_train_max_events": 40}), NOW,
                        tree_params=SMALL_TREES)
    scores = champion_version(engine, kind="latency").scores
    assert (scores["n_events"], scores["n_transfers"], scores["train_days"], scores["max_events"]) == (40, 3, 30, 40)
