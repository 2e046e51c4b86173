"""The actuator with a stepped clock: audit trail, idempotency, guardrails, retries; fakes of the cluster only."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import text

from forecaster.actuation import guardrails
from forecaster.actuation.actuator import Actuator, build_backend
from forecaster.actuation.backends.base import ModelTarget, Outcome, ReplicaState
from forecaster.actuation.backends.dryrun import DryRunBackend
from forecaster.store.actions import is_paused, list_actions, set_paused
from forecaster.contracts.actions import Action, ActionKind, ActionStatus, FailureReason, Plan, Reason, Tier

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def prepull(node="n1", image="reg/img:1", model="m", not_before=NOW, minutes=10):
    return Action(kind=ActionKind.PREPULL, model_id=model, reason=Reason.CACHE_WARM, not_before=not_before,
                  deadline=not_before + timedelta(minutes=minutes), node_id=node, target=image,
                  expected_benefit_s=12.0, expected_cost=3e9)


def scale(model, replicas, kind=ActionKind.SCALE):
    return Action(kind=kind, model_id=model, reason=Reason.FORECAST_SPIKE, not_before=NOW,
                  deadline=NOW + timedelta(minutes=10), replicas=replicas)


@pytest.fixture
def models(engine):
    with engine.begin() as conn:
        for model, gpus in (("m", 1), ("big", 4)):
            conn.execute(text("INSERT INTO serving_models (id, gpus_per_replica) VALUES (:i, :g)"),
                         {"i": model, "g": gpus})


def test_dry_run_records_spec_and_what_it_would_do(engine, settings, models):
    actuator = Actuator(engine, settings, build_backend(settings))
    assert settings.actuator_backend == "dry-run"
    action = Action(kind=ActionKind.PRELOAD, model_id="m", reason=Reason.SLO_COVER, not_before=NOW,
                    deadline=NOW + timedelta(minutes=5), node_id="n1", target="s3://w/m.bin", tier=Tier.HOST)
    submitted, reports = actuator.apply(Plan(planned_at=NOW, actions=(action,), summary={"models": 1}), now=NOW)
    assert [r.status for r in reports] == [ActionStatus.SUCCEEDED]
    [row] = list_actions(engine, plan_id=submitted.plan_id)
    assert row["spec"]["target"] == "s3://w/m.bin" and row["spec"]["tier"] == "host"
    assert row["spec"]["key"] == action.key and row["reason"] == "slo_cover" and row["backend"] == "dry-run"
    assert row["status"] == "succeeded" and row["attempts"] == 1 and row["finished_at"] == NOW
    assert "would pre-load s3://w/m.bin into host on node n1" in row["detail"]["message"]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT summary FROM plans")).scalar() == {"models": 1, "actions": 1}


def test_same_open_work_from_two_plans_is_one_unit(engine, settings, models):
    actuator = Actuator(engine, settings, DryRunBackend())
    later = NOW + timedelta(minutes=5)
    first = actuator.submit(Plan(planned_at=NOW, actions=(prepull(not_before=later),)), now=NOW)
    second = actuator.submit(Plan(planned_at=NOW + timedelta(minutes=1),
                                  actions=(prepull(not_before=later, minutes=20),)), now=NOW + timedelta(minutes=1))
    assert second.merged == first.action_ids
    [row] = list_actions(engine)
    assert row["deadline"] == later + timedelta(minutes=20)  # the later deadline wins
    assert row["detail"]["merged_plans"] == [second.plan_id]
    # Not before its time: nothing runs at NOW, it runs at `later`.
    assert actuator.run_due(now=NOW + timedelta(minutes=1)) == []
    assert [r.status for r in actuator.run_due(now=later)] == [ActionStatus.SUCCEEDED]
    # Once done, the same work may be asked again: a new unit (the backend's own idempotency makes it cheap).
    third = actuator.submit(Plan(planned_at=later, actions=(prepull(not_before=later),)), now=later)
    assert third.merged == () and len(list_actions(engine)) == 2


@pytest.mark.parametrize("case, expected", [
    ("deadline_passed", FailureReason.DEADLINE_PASSED),
    ("kill_switch_store", FailureReason.KILL_SWITCH),
    ("kill_switch_setting", FailureReason.KILL_SWITCH),
])
def test_actions_are_dropped_with_a_recorded_reason(engine, settings, models, case, expected):
    if case == "kill_switch_setting":
        settings = settings.model_copy(update={"actuator_kill_switch": True})
    if case == "kill_switch_store":
        set_paused(engine, True, now=NOW, reason="incident 42", by="oncall")
        assert is_paused(engine)
    actuator = Actuator(engine, settings, DryRunBackend())
    when = NOW + timedelta(minutes=11) if case == "deadline_passed" else NOW
    actuator.submit(Plan(planned_at=NOW, actions=(prepull(),)), now=NOW)
    reports = actuator.run_due(now=when)
    assert [(r.status, r.reason) for r in reports] == [(ActionStatus.DROPPED, expected)]
    [row] = list_actions(engine)
    assert row["status"] == "dropped" and row["status_reason"] == str(expected) and row["attempts"] == 0


def test_kill_switch_resumes(engine, settings, models):
    actuator = Actuator(engine, settings, DryRunBackend())
    set_paused(engine, True, now=NOW)
    set_paused(engine, False, now=NOW)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(prepull(),)), now=NOW)
    assert reports[0].status is ActionStatus.SUCCEEDED


def test_at_most_n_actions_start_per_minute(engine, settings, models):
    settings = settings.model_copy(update={"actuator_max_actions_per_minute": 2})
    actuator = Actuator(engine, settings, DryRunBackend())
    plan = Plan(planned_at=NOW, actions=tuple(prepull(node=f"n{i}") for i in range(3)))
    _, reports = actuator.apply(plan, now=NOW)
    assert sorted((r.status, r.reason) for r in reports) == sorted(
        [(ActionStatus.SUCCEEDED, None)] * 2 + [(ActionStatus.DROPPED, FailureReason.RATE_LIMITED)])
    # 30 s later the window still holds two starts; a minute later it is free again.
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(prepull(node="n9"),)), now=NOW + timedelta(seconds=30))
    assert reports[0].reason is FailureReason.RATE_LIMITED
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(prepull(node="n9"),)), now=NOW + timedelta(seconds=61))
    assert reports[0].status is ActionStatus.SUCCEEDED


class ScriptedBackend:
    """A fake cluster: answers each carry_out with the next scripted outcome."""

    name = "scripted"

    def __init__(self, outcomes, state=None):
        self.outcomes = list(outcomes)
        self.calls = []
        self.state = state

    def replica_state(self, model: ModelTarget):
        return self.state

    def carry_out(self, action, *, model, replicas, deadline_s):
        self.calls.append((action.kind, replicas, round(deadline_s, 3)))
        return self.outcomes.pop(0)


def test_temporary_errors_retry_with_backoff_and_permanent_ones_do_not(engine, settings, models):
    settings = settings.model_copy(update={"actuator_retry_base_delay_s": 10.0, "actuator_max_attempts": 4})
    flaky = ScriptedBackend([Outcome.failed(FailureReason.RUNTIME_UNAVAILABLE, "agent down", temporary=True),
                             Outcome.failed(FailureReason.TIMEOUT, "slow", temporary=True),
                             Outcome.ok("pulled")])
    actuator = Actuator(engine, settings, flaky)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(prepull(),)), now=NOW)
    assert reports[0].status is ActionStatus.PENDING and reports[0].detail["retry_at"] == (
        NOW + timedelta(seconds=10)).isoformat()
    assert actuator.run_due(now=NOW + timedelta(seconds=9)) == []  # backing off
    reports = actuator.run_due(now=NOW + timedelta(seconds=10))
    assert reports[0].status is ActionStatus.PENDING
    assert reports[0].detail["retry_at"] == (NOW + timedelta(seconds=30)).isoformat()  # doubled
    reports = actuator.run_due(now=NOW + timedelta(seconds=30))
    assert reports[0].status is ActionStatus.SUCCEEDED
    [row] = list_actions(engine)
    assert row["attempts"] == 3 and row["status_reason"] is None
    assert [c[2] for c in flaky.calls] == [600.0, 590.0, 570.0]  # each call gets the time left to its deadline

    broken = ScriptedBackend([Outcome.failed(FailureReason.NOT_FOUND, "no such image")])
    actuator = Actuator(engine, settings, broken)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(prepull(node="n2"),)), now=NOW)
    assert reports[0].status is ActionStatus.FAILED and reports[0].reason is FailureReason.NOT_FOUND
    assert actuator.run_due(now=NOW + timedelta(minutes=5)) == []


def test_no_retry_past_the_deadline_or_the_attempt_limit():
    args = dict(now=NOW, base_delay_s=10.0, deadline=NOW + timedelta(seconds=15), temporary=True)
    assert guardrails.retry_at(attempts=1, max_attempts=3, **args) == NOW + timedelta(seconds=10)
    assert guardrails.retry_at(attempts=2, max_attempts=3, **args) is None  # 20 s back-off passes the deadline
    assert guardrails.retry_at(attempts=3, max_attempts=3, **{**args, "deadline": NOW + timedelta(hours=1)}) is None
    assert guardrails.retry_at(attempts=1, max_attempts=3, **{**args, "temporary": False}) is None


@pytest.mark.parametrize("kind, planned, current, ask, elsewhere, budget, expected", [
    # scale: never below the reactive ask, within the budget, never a scale-down
    (ActionKind.SCALE, 5, 2, 0, 0, 8, (5, None, False)),
    (ActionKind.SCALE, 2, 1, 4, 0, 8, (4, None, False)),  # the autoscaler asks for more than the plan
    (ActionKind.SCALE, 3, 5, 0, 0, 8, (None, None, True)),  # already there
    (ActionKind.SCALE, 10, 1, 1, 4, 8, (5, None, False)),  # clamped to the 4 GPUs left
    (ActionKind.SCALE, 10, 5, 1, 4, 8, (None, FailureReason.GPU_BUDGET, False)),
    (ActionKind.SCALE, 3, 0, 3, 8, 8, (3, None, False)),  # replicas the autoscaler asks for cost no budget
    # release: never below the reactive ask
    (ActionKind.RELEASE, 2, 6, 1, 0, 8, (4, None, False)),
    (ActionKind.RELEASE, 5, 6, 3, 0, 8, (3, None, False)),
    (ActionKind.RELEASE, 2, 3, 3, 0, 8, (None, FailureReason.BELOW_REACTIVE, False)),
    (ActionKind.RELEASE, 0, 3, 0, 0, 8, (None, None, True)),
])
def test_replica_bounds(kind, planned, current, ask, elsewhere, budget, expected):
    bound = guardrails.bound_replicas(scale("m", planned, kind), ReplicaState(current=current, reactive_ask=ask),
                                      gpus_per_replica=1, gpus_ahead_elsewhere=elsewhere, gpu_budget=budget)
    assert (bound.target, bound.dropped, bound.noop) == expected


def test_gpu_budget_is_shared_across_models_in_one_batch(engine, settings, models):
    settings = settings.model_copy(update={"actuator_gpu_budget": 8})
    backend = ScriptedBackend([Outcome.ok("scaled")] * 2, state=ReplicaState(current=0, reactive_ask=0))
    actuator = Actuator(engine, settings, backend)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(scale("big", 1), scale("m", 6))), now=NOW)
    by_model = {r.detail["guardrails"]["gpus_per_replica"]: r for r in reports}
    assert by_model[4].status is ActionStatus.SUCCEEDED and by_model[4].detail["ahead_gpus"] == 4
    assert by_model[1].detail["ahead_gpus"] == 4 and by_model[1].detail["guardrails"]["clamped_from"] == 6
    assert sorted(c[1] for c in backend.calls) == [1, 4]


def test_a_backend_that_cannot_scale_says_unsupported(engine, settings, models):
    from forecaster.actuation.backends.agent import AgentBackend

    actuator = Actuator(engine, settings, AgentBackend(url_template="http://{node}:1", token="t"))
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(scale("m", 2),)), now=NOW)
    assert reports[0].status is ActionStatus.FAILED and reports[0].reason is FailureReason.UNSUPPORTED


def test_lost_running_actions_are_failed_after_their_deadline(engine, settings, models):
    actuator = Actuator(engine, settings, DryRunBackend())
    submitted = actuator.submit(Plan(planned_at=NOW, actions=(prepull(),)), now=NOW)
    with engine.begin() as conn:
        conn.execute(text("UPDATE actions SET status = 'running', started_at = :t WHERE id = :i"),
                     {"t": NOW, "i": submitted.action_ids[0]})
    actuator.run_due(now=NOW + timedelta(minutes=16))
    [row] = list_actions(engine)
    assert row["status"] == "failed" and row["status_reason"] == "timeout" and "lost" in row["detail"]


@pytest.mark.parametrize("ledger_kind", ["store", "memory"])
def test_a_merged_later_deadline_is_the_one_the_retry_and_the_backend_get(engine, settings, models, ledger_kind):
    """A later plan asks for the same pre-pull with a later deadline while it waits to retry: the merge moves the
    row's deadline, and the retry must run to it (it was dropped at the first plan's deadline, the spec's)."""
    from forecaster.actuation.ledger import MemoryLedger

    settings = settings.model_copy(update={"actuator_retry_base_delay_s": 90.0, "actuator_max_attempts": 4})
    backend = ScriptedBackend([Outcome.failed(FailureReason.RUNTIME_UNAVAILABLE, "agent down", temporary=True),
                               Outcome.ok("pulled")])
    ledger = engine if ledger_kind == "store" else MemoryLedger({"m": ModelTarget(model_id="m")})
    actuator = Actuator(ledger, settings, backend)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=(prepull(minutes=2),)), now=NOW)
    assert reports[0].status is ActionStatus.PENDING  # retry due at 12:01:30, before its deadline (12:02)
    later = NOW + timedelta(minutes=1)
    merged = actuator.submit(Plan(planned_at=later, actions=(prepull(not_before=later, minutes=20),)), now=later)
    assert merged.merged  # the same unit, deadline now 12:21
    reports = actuator.run_due(now=NOW + timedelta(seconds=150))  # the next run, at 12:02:30
    assert [r.status for r in reports] == [ActionStatus.SUCCEEDED], reports
    assert backend.calls[1][2] == 1110.0  # 12:21 - 12:02:30


def test_a_running_action_whose_process_died_is_reaped_although_plans_keep_asking_for_it(engine, settings, models):
    """The process died mid-call: the row stays running. Every plan asks for the same scale again and merges into
    it; had each merge moved the deadline on, the reaper would never fail it, and the work (and its GPUs ahead)
    would be held for good."""
    actuator = Actuator(engine, settings, DryRunBackend())
    submitted = actuator.submit(Plan(planned_at=NOW, actions=(scale("m", 3),)), now=NOW)
    with engine.begin() as conn:
        conn.execute(text("UPDATE actions SET status = 'running', started_at = :t, detail = '{\"ahead_gpus\": 2}' "
                          "WHERE id = :i"), {"t": NOW, "i": submitted.action_ids[0]})
    for minute in range(1, 17):
        at = NOW + timedelta(minutes=minute)
        again = Action(kind=ActionKind.SCALE, model_id="m", reason=Reason.FORECAST_SPIKE, not_before=at,
                       deadline=at + timedelta(minutes=10), replicas=3)
        actuator.apply(Plan(planned_at=at, actions=(again,)), now=at)
    first = list_actions(engine)[0]
    assert first["status"] == "failed" and first["status_reason"] == "timeout" and "lost" in first["detail"]
    assert first["deadline"] == NOW + timedelta(minutes=10)


class _StoreBlip:
    """A store ledger whose ``fail_on`` call (a ledger method, or one of a session's) raises a database error the
    first time: the store going away for a moment in the middle of a batch."""

    def __init__(self, ledger, fail_on: str) -> None:
        self.ledger, self.fail_on, self.failed = ledger, fail_on, False

    def _fail(self, *args, **kwargs):
        from sqlalchemy.exc import OperationalError

        self.failed = True
        raise OperationalError("SELECT", {}, Exception("server closed the connection unexpectedly"))

    def _wrap(self, target):
        blip = self

        class Wrapped:
            def __getattr__(self, attribute):
                if attribute == blip.fail_on and not blip.failed:
                    return blip._fail
                return getattr(target, attribute)
        return Wrapped()

    def session(self):
        from contextlib import contextmanager

        @contextmanager
        def session():
            with self.ledger.session() as inner:
                yield self._wrap(inner)
        return session()

    def __getattr__(self, attribute):
        return getattr(self._wrap(self.ledger), attribute)


@pytest.mark.parametrize("fail_on", ["model_targets", "ahead_gpus_total"])
def test_a_store_error_before_the_backend_call_never_leaves_actions_running_unattended(engine, settings, models,
                                                                                        fail_on):
    """The catalogue read (after the batch is taken) or the GPU budget's read (per scale) fails once, as a database
    blip would. Those actions are left pending, carried out on the job's rerun or at their retry time; never
    stranded ``running`` (a rerun does not take running rows; only the reaper would, past their deadlines)."""
    from forecaster.actuation.ledger import StoreLedger
    from forecaster.jobs.runs import JobSpec, run_once

    settings = settings.model_copy(update={"actuator_retry_base_delay_s": 10.0})
    backend = ScriptedBackend([Outcome.ok("done")] * 10, state=ReplicaState(current=1, reactive_ask=1))
    actuator = Actuator(_StoreBlip(StoreLedger(engine), fail_on), settings, backend)
    plan = Plan(planned_at=NOW, actions=(prepull(node="n1"), prepull(node="n2"), scale("m", 3), scale("big", 2)))
    job = JobSpec("plan", lambda e, s, now: {"reports": [str(r.status) for r in actuator.apply(plan, now=now)[1]]},
                  every_s=60)
    detail = run_once(engine, settings, job, now=NOW, sleep=lambda s: None, db_wait_s=5)
    rows = list_actions(engine)
    assert "running" not in {r["status"] for r in rows}
    if fail_on == "model_targets":  # the whole batch rolled back and ran on the rerun
        assert detail["attempts"] == 2 and detail["reports"] == ["succeeded"] * 4 and len(backend.calls) == 4
    else:  # one scale waits for its retry, the rest went on
        assert sorted(detail["reports"]) == ["pending", "succeeded", "succeeded", "succeeded"]
        [waiting] = [r for r in rows if r["status"] == "pending"]
        assert waiting["next_attempt_at"] == NOW + timedelta(seconds=10)
        assert [r.status for r in actuator.run_due(now=NOW + timedelta(seconds=10))] == [ActionStatus.SUCCEEDED]
    assert {r["status"] for r in list_actions(engine)} == {"succeeded"}


def test_a_pause_stops_a_batch_already_under_way(engine, settings, models):
    """The kill switch is thrown while a batch runs (during its first backend call): the actions not yet called
    are dropped as kill_switch, not carried out."""

    class PausingBackend(ScriptedBackend):
        sequential = True

        def carry_out(self, action, **kw):
            if not self.calls:
                set_paused(engine, True, now=NOW)
            return super().carry_out(action, **kw)

    backend = PausingBackend([Outcome.ok("pulled")] * 3)
    actuator = Actuator(engine, settings, backend)
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=tuple(prepull(node=f"n{i}") for i in range(3))),
                                now=NOW)
    assert len(backend.calls) == 1
    assert sorted((str(r.status), r.reason) for r in reports) == [
        ("dropped", FailureReason.KILL_SWITCH), ("dropped", FailureReason.KILL_SWITCH), ("succeeded", None)]
