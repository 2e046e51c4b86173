"""``GET /v1/models/{id}/cold-start``: the cold-start horizon prewarm plans with, predicted and observed.

Data access lives in :mod:`api.coldstart_horizon`; this module does HTTP only.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import BaseModel, Field
from sqlalchemy.exc import OperationalError

from api.coldstart_horizon import OBSERVED_QUANTILE, observed_p90, predict_horizon
from api.deps import ClockDep, EngineDep, ReadToken, SettingsDep
from api.model_routes import ModelIdRoute
from api.routes.models import ModelIdPath
from api.snapshot import planner_settings_for
from forecaster.contracts.phases import START_STATES
from forecaster.store.coldstarts import RECENT_COLD_STARTS
from forecaster.store.dashboard import model_exists

router = APIRouter(prefix="/v1/models", tags=["cold starts"], route_class=ModelIdRoute)


class TierPublic(BaseModel):
    tier: str = Field(description="Where the node holds the model before the start: none (nothing), image "
                                  "(image pulled), disk (weights on local disk), host (weights in host memory).")
    predicted_s: float = Field(description="The latency model's predicted cold-start seconds from this tier.")


class ObservedPublic(BaseModel):
    p90_s: float = Field(description=f"Rolling p{OBSERVED_QUANTILE * 100:g} of total seconds over the newest "
                                     f"{RECENT_COLD_STARTS} stored cold starts.")
    n: int = Field(description="Cold starts the figure covers.")


class ColdStartHorizonPublic(BaseModel):
    model_id: str
    node_id: str | None = Field(description="The node asked about (``node``), or None: the fleet's nodes, "
                                            "reduced per tier as the planner does.")
    hour_utc: int = Field(description="UTC hour the prediction is for (the latency model's tables are hourly).")
    latency_model_version: str | None = Field(description="The latency model (None: the physics prior).")
    source: str = Field(description="Where the predicted seconds come from: latency_model; observed (the model "
                                    "has no registered sizes: the p90 of its own starts, per tier where it has "
                                    "some); or default (no sizes and no start of its own: "
                                    "PREWARM_DEFAULT_COLD_START_S).")
    tiers: list[TierPublic] = Field(description="Predicted seconds per start tier, coldest first.")
    start_tier: str = Field(description="The tier a replica started now would start from (warmest cached).")
    predicted_start_s: float = Field(description="Predicted seconds from ``start_tier``.")
    lead_time_s: float = Field(description="The lead time prewarm acts on: ``predicted_start_s`` x "
                                           "(1 + lead_margin_frac) + lead_margin_s.")
    lead_margin_s: float
    lead_margin_frac: float
    observed: ObservedPublic | None = Field(description="Observed rolling p90 over all tiers (None: no cold "
                                                        "start stored).")
    observed_by_cache_state: dict[str, ObservedPublic] = Field(
        description="The same per reported cache state (``unknown`` when the observer did not say).")


@router.get("/{model_id}/cold-start", response_model=ColdStartHorizonPublic,
            responses={404: {"description": "Unknown model, or unknown node"},
                       503: {"description": "Database unavailable"}})
def get_cold_start_horizon(model_id: ModelIdPath, request: Request, engine: EngineDep, settings: SettingsDep,
                           clock: ClockDep, _: ReadToken,
                           node: str | None = Query(None, min_length=1, max_length=256,
                                                    description="A node id: the horizon of a start on that node "
                                                                "(404 when the fleet has no such node).")
                           ) -> ColdStartHorizonPublic:
    """Predicted cold-start seconds per tier, the lead time prewarm uses now, and the observed rolling p90."""
    try:
        with engine.connect() as conn:
            if not model_exists(conn, model_id=model_id):
                raise HTTPException(404, f"model {model_id!r} is not registered")
        horizon = predict_horizon(engine, settings, clock(), [model_id], node=node,
                                  held=getattr(getattr(request.app.state, "snapshot", None), "held_latency", None))
        if horizon is None:
            raise HTTPException(404, f"unknown node {node!r}")
        observed = observed_p90(engine, [model_id])
        by_state = observed_p90(engine, [model_id], by_cache_state=True)
    except OperationalError:
        raise HTTPException(503, "database unavailable",
                            headers={"Retry-After": str(settings.ingest_retry_after_s)}) from None
    predicted = horizon.predicted_s.loc[model_id]
    start_tier = str(horizon.start_state[model_id])
    margins = planner_settings_for(settings)
    return ColdStartHorizonPublic(
        model_id=model_id, node_id=node, hour_utc=horizon.hour_utc,
        latency_model_version=horizon.latency_model_version,
        source="latency_model" if horizon.source is None else str(horizon.source[model_id]),
        tiers=[TierPublic(tier=t, predicted_s=float(predicted[t])) for t in START_STATES],
        start_tier=start_tier, predicted_start_s=float(predicted[start_tier]),
        lead_time_s=float(horizon.lead_time_s[model_id]), lead_margin_s=margins.lead_margin_s,
        lead_margin_frac=margins.lead_margin_frac,
        observed=None if observed.empty else ObservedPublic(p90_s=float(observed["seconds"].iloc[0]),
                                                            n=int(observed["n"].iloc[0])),
        observed_by_cache_state={str(r.cache_state): ObservedPublic(p90_s=float(r.seconds), n=int(r.n))
                                 for r in by_state.itertuples()},
    )
