"""``/v1/plans`` and ``/v1/actions``: the audit trail of what the planner asked and the actuator did."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import text

from api.deps import AdminToken, ClockDep, EngineDep, ReadToken
from forecaster.store.actions import set_paused
from api.schemas import ListPublic, SafeId, SafeText, UtcTime

#: Largest id accepted in a bigint query parameter.
BIGINT_MAX = 2**63 - 1

router = APIRouter(prefix="/v1", tags=["audit"])


class PlanPublic(BaseModel):
    id: int
    planned_at: datetime
    summary: dict
    actions: int


class ActionPublic(BaseModel):
    id: int
    plan_id: int | None
    kind: str
    model_id: str | None
    node_id: str | None
    target: str | None
    spec: dict
    not_before: datetime | None
    deadline: datetime | None
    reason: str | None
    expected_benefit: float | None
    expected_cost: float | None
    status: str
    status_reason: str | None
    attempts: int
    backend: str | None = None
    detail: dict | None = None
    updated_at: datetime


@router.get("/plans", response_model=ListPublic[PlanPublic])
def list_plans(engine: EngineDep, _: ReadToken, limit: int = Query(50, ge=1, le=1000),
               since: UtcTime | None = Query(None, description="ISO 8601; no zone = UTC.")
               ) -> ListPublic[PlanPublic]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT p.id, p.planned_at, p.summary, (SELECT count(*) FROM actions a WHERE a.plan_id = p.id) "
                 "FROM plans p WHERE (CAST(:since AS timestamptz) IS NULL OR p.planned_at >= :since) "
                 "ORDER BY p.planned_at DESC, p.id DESC LIMIT :limit"),
            {"since": since, "limit": limit},
        ).all()
        count = conn.execute(text("SELECT count(*) FROM plans")).scalar()
    return ListPublic(data=[PlanPublic(id=r[0], planned_at=r[1], summary=r[2], actions=r[3]) for r in rows],
                      count=count)


@router.get("/actions", response_model=ListPublic[ActionPublic])
def list_actions(engine: EngineDep, _: ReadToken, limit: int = Query(100, ge=1, le=5000),
                 status: SafeId | None = Query(None, max_length=64), model_id: SafeId | None = None,
                 plan_id: int | None = Query(None, ge=1, le=BIGINT_MAX)) -> ListPublic[ActionPublic]:
    where = ("WHERE (CAST(:status AS text) IS NULL OR status = :status) "
             "AND (CAST(:model AS text) IS NULL OR model_id = :model) "
             "AND (CAST(:plan AS bigint) IS NULL OR plan_id = :plan)")
    params = {"status": status, "model": model_id, "plan": plan_id}
    columns = ", ".join(ActionPublic.model_fields)
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT {columns} FROM actions {where} ORDER BY updated_at DESC, id DESC "
                                 "LIMIT :limit"), {**params, "limit": limit}).mappings().all()
        count = conn.execute(text(f"SELECT count(*) FROM actions {where}"), params).scalar()
    return ListPublic(data=[ActionPublic(**r) for r in rows], count=count)


class ActuatorStatePublic(BaseModel):
    paused: bool
    reason: str | None
    updated_by: str | None
    updated_at: datetime | None


class PauseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: SafeText | None = Field(default=None, max_length=512)


def _actuator_state(engine) -> ActuatorStatePublic:
    with engine.connect() as conn:
        row = conn.execute(text("SELECT paused, reason, updated_by, updated_at FROM actuator_control "
                                "WHERE id = 1")).first()
    if row is None:
        return ActuatorStatePublic(paused=False, reason=None, updated_by=None, updated_at=None)
    return ActuatorStatePublic(paused=row[0], reason=row[1], updated_by=row[2], updated_at=row[3])


@router.get("/actuator", response_model=ActuatorStatePublic)
def get_actuator(engine: EngineDep, _: ReadToken) -> ActuatorStatePublic:
    """Whether the global kill switch is on."""
    return _actuator_state(engine)


@router.post("/actuator/pause", response_model=ActuatorStatePublic)
def pause_actuator(engine: EngineDep, clock: ClockDep, token: AdminToken,
                   body: PauseBody | None = None) -> ActuatorStatePublic:
    """Kill switch on: every actuating process stops starting actions (pending ones wait, then expire)."""
    set_paused(engine, True, now=clock(), reason=(body.reason if body else None) or "paused via API", by=token.name)
    return _actuator_state(engine)


@router.post("/actuator/resume", response_model=ActuatorStatePublic)
def resume_actuator(engine: EngineDep, clock: ClockDep, token: AdminToken) -> ActuatorStatePublic:
    set_paused(engine, False, now=clock(), reason="resumed via API", by=token.name)
    return _actuator_state(engine)
