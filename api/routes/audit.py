"""``/v1/plans`` and ``/v1/actions``: the audit trail of what the planner asked and the actuator did."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, Query
from pydantic import BaseModel
from sqlalchemy import text

from api.deps import EngineDep, ReadToken
from api.schemas import ListPublic

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
    updated_at: datetime


@router.get("/plans", response_model=ListPublic[PlanPublic])
def list_plans(engine: EngineDep, _: ReadToken, limit: int = Query(50, ge=1, le=1000),
               since: datetime | None = None) -> ListPublic[PlanPublic]:
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
                 status: str | None = None, model_id: str | None = None,
                 plan_id: int | None = None) -> ListPublic[ActionPublic]:
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
