"""``/v1/plans`` and ``/v1/actions``: the audit trail of what the planner asked and the actuator did."""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import text

from api.deps import AdminToken, ClockDep, EngineDep, ReadToken, SettingsDep
from forecaster.planning.budget import BudgetState, budget_history
from forecaster.planning.step import waste_budget
from forecaster.store.actions import plan_budget_states, set_paused
from api.schemas import ActionRecord, ListPublic, SafeId, SafeText, UtcTime

#: Largest id accepted in a bigint query parameter.
BIGINT_MAX = 2**63 - 1

router = APIRouter(prefix="/v1", tags=["audit"])


class PlanPublic(BaseModel):
    id: int
    planned_at: datetime
    summary: dict
    actions: int


class ActionPublic(ActionRecord):
    """An action of the audit trail, with its model and what the backend reported."""

    model_id: str | None
    backend: str | None = None
    detail: dict | None = None


@router.get("/plans", response_model=ListPublic[PlanPublic])
def list_plans(engine: EngineDep, _: ReadToken, limit: int = Query(50, ge=1, le=1000),
               since: UtcTime | None = Query(None, description="ISO 8601; no zone = UTC.")
               ) -> ListPublic[PlanPublic]:
    """The newest plans first; ``count`` is how many match ``since`` (all of them without it), as on ``/v1/actions``."""
    where = "WHERE (CAST(:since AS timestamptz) IS NULL OR p.planned_at >= :since)"
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT p.id, p.planned_at, p.summary, (SELECT count(*) FROM actions a WHERE a.plan_id = p.id) "
                 f"FROM plans p {where} ORDER BY p.planned_at DESC, p.id DESC LIMIT :limit"),
            {"since": since, "limit": limit},
        ).all()
        count = conn.execute(text(f"SELECT count(*) FROM plans p {where}"), {"since": since}).scalar()
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
    with engine.connect() as conn:  # the newest updated first, through actions_updated (migration 0016)
        rows = conn.execute(text(f"SELECT {columns} FROM actions {where} ORDER BY updated_at DESC, id DESC "
                                 "LIMIT :limit"), {**params, "limit": limit}).mappings().all()
        if model_id is None and plan_id is None:  # the kept counts per kind and status, not a scan of every action
            count = conn.execute(text("SELECT coalesce(sum(n), 0) FROM action_counts "
                                      "WHERE CAST(:status AS text) IS NULL OR status = :status"), params).scalar()
        else:
            count = conn.execute(text(f"SELECT count(*) FROM actions {where}"), params).scalar()
    return ListPublic(data=[ActionPublic(**r) for r in rows], count=count)


class BudgetConfigPublic(BaseModel):
    gpu_seconds_per_hour: float | None
    pct: float | None
    reference_min: int
    window_min: float
    max_factor: float


class BudgetPointPublic(BaseModel):
    planned_at: datetime
    factor: float
    status: str
    interval_min: float
    spent_gpu_s: float
    allowed_gpu_s: float
    predicted_gpu_s: float | None
    window_spent_pct: float | None


class BudgetPublic(BaseModel):
    enabled: bool = Field(description="The settings of this service set a waste budget (PREWARM_PLANNER_WASTE_BUDGET_*)")
    configured: BudgetConfigPublic | None
    as_of: datetime | None = Field(None, description="The newest plan with a budget state (None: no update yet)")
    status: str | None = Field(None, description="on_budget, settling, over_budget or infeasible")
    factor: float | None = Field(None, description="Multiplier on every model's cold cost")
    over_minutes: float | None = Field(None, description="Minutes in a row over budget")
    window_spent_gpu_s: float | None = Field(None, description="Discounted idle GPU-seconds over the pacing window")
    window_allowed_gpu_s: float | None = Field(None, description="Discounted allowance over the pacing window")
    spent_total_gpu_s: float | None = None
    allowed_total_gpu_s: float | None = None
    predicted_next_minute_gpu_s: float | None = Field(
        None, description="Idle GPU-seconds the newest plan's spend curve predicts for its next minute")
    points: list[BudgetPointPublic] = Field(description="One per controller update, oldest first")


@router.get("/budget", response_model=BudgetPublic)
def get_budget(engine: EngineDep, settings: SettingsDep, _: ReadToken,
               limit: int = Query(1440, ge=1, le=10080, description="Updates at most (newest kept)"),
               since: UtcTime | None = Query(None, description="ISO 8601; no zone = UTC."),
               until: UtcTime | None = Query(None, description="End, exclusive; ISO 8601, no zone = UTC; default: "
                                                               "the newest")) -> BudgetPublic:
    """Budget mode as the plan job runs it: spend against allowance, the cold-cost factor and the status, per plan.

    States stored while a budget was set stay readable after it is unset (``enabled`` says which holds now). With
    ``until`` the newest state is the last one before it (the dashboard's window end).
    """
    budget = waste_budget(settings)
    configured = None if budget is None else BudgetConfigPublic(
        gpu_seconds_per_hour=budget.gpu_seconds_per_hour, pct=budget.pct, reference_min=budget.reference_min,
        window_min=budget.window_min, max_factor=budget.max_factor)
    with engine.connect() as conn:
        rows = plan_budget_states(conn, since=since, until=until, limit=limit)
    points = [BudgetPointPublic(**asdict(p)) for p in budget_history(rows)]
    newest = {}
    if rows and (state := BudgetState.from_dict(rows[-1][1])).updates:
        newest = dict(as_of=rows[-1][0], status=state.status, factor=state.factor, over_minutes=state.over_minutes,
                      window_spent_gpu_s=state.spent, window_allowed_gpu_s=state.allowed,
                      spent_total_gpu_s=state.spent_total, allowed_total_gpu_s=state.allowed_total,
                      predicted_next_minute_gpu_s=state.predicted_next_minute())
    return BudgetPublic(enabled=budget is not None, configured=configured, points=points, **newest)


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
