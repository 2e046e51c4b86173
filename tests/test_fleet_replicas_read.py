"""The plan job's fleet read: a model's replicas are the level the actuator last set, after a release too."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import text

from forecaster.actuation.actuator import Actuator
from forecaster.actuation.backends.base import ModelTarget, Outcome, ReplicaState
from forecaster.contracts.actions import Action, ActionKind, Plan, Reason
from forecaster.store.fleet import read_fleet_inputs

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)


class FloorBackend:
    """A cluster whose floor is what was last set (an HPA's minReplicas), with a fixed reactive ask."""

    name = "floor"

    def __init__(self, ask: int = 0) -> None:
        self.floor = 0
        self.ask = ask

    def replica_state(self, model: ModelTarget) -> ReplicaState:
        return ReplicaState(current=self.floor, reactive_ask=self.ask, floor_kind="min_replicas")

    def carry_out(self, action, *, model, replicas, deadline_s):
        self.floor = int(replicas)
        return Outcome.ok(f"floor -> {replicas}")


def _act(kind: ActionKind, replicas: int, at: datetime) -> Plan:
    return Plan(planned_at=at, actions=(Action(kind=kind, model_id="m", reason=Reason.FORECAST_SPIKE, not_before=at,
                                               deadline=at + timedelta(minutes=5), replicas=replicas),))


def _replicas(engine, at: datetime) -> int:
    with engine.connect() as conn:
        models, _, _ = read_fleet_inputs(conn, now=at)
    return int(models.loc["m", "replicas"])


def test_a_release_leaves_the_level_it_set_not_the_replicas_it_gave_back(engine, settings):
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id, gpus_per_replica) VALUES ('m', 1)"))
    backend = FloorBackend()
    actuator = Actuator(engine, settings, backend)
    actuator.apply(_act(ActionKind.SCALE, 5, NOW), now=NOW)
    assert backend.floor == 5 and _replicas(engine, NOW) == 5
    later = NOW + timedelta(minutes=1)
    actuator.apply(_act(ActionKind.RELEASE, 3, later), now=later)  # give back 3 of 5
    assert backend.floor == 2
    assert _replicas(engine, later) == 2


def test_a_noop_leaves_the_level_it_found_and_a_legacy_release_row_reads_its_target(engine, settings):
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id, gpus_per_replica) VALUES ('m', 1)"))
    backend = FloorBackend()
    backend.floor = 4  # set by someone else (the operator)
    actuator = Actuator(engine, settings, backend)
    actuator.apply(_act(ActionKind.SCALE, 3, NOW), now=NOW)  # already 4 >= 3: nothing to do
    assert _replicas(engine, NOW) == 4
    later = NOW + timedelta(minutes=1)
    actuator.apply(_act(ActionKind.RELEASE, 1, later), now=later)
    assert _replicas(engine, later) == 3
    # a row written before ``replicas_after`` existed: the target the actuator set
    with engine.begin() as conn:
        conn.execute(text("UPDATE actions SET detail = detail - 'replicas_after'"))
    assert _replicas(engine, later) == 3


def test_the_dry_run_releases_from_the_level_it_would_have_set(engine, settings):
    from forecaster.actuation.backends.dryrun import DryRunBackend

    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id, gpus_per_replica) VALUES ('m', 1)"))
    actuator = Actuator(engine, settings, DryRunBackend())
    actuator.apply(_act(ActionKind.SCALE, 5, NOW), now=NOW)
    later = NOW + timedelta(minutes=1)
    _, [report] = actuator.apply(_act(ActionKind.RELEASE, 3, later), now=later)
    assert report.status.value == "succeeded", report
    assert "to 2 replicas" in report.message
    assert _replicas(engine, later) == 2
