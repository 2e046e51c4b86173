"""``/v1/models``: the serving-model catalogue."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.deps import AdminToken, EngineDep, ReadToken
from api.model_routes import ModelIdRoute
from api.schemas import ListPublic, SafeId, ServingModelPublic, ServingModelPut

#: A model id in the path: 1-256 characters, no control characters (the store's ``String(256)``).
ModelIdPath = Annotated[SafeId, Path(description="Model id, 1-256 characters.")]
#: Largest list offset accepted (PostgreSQL's OFFSET is a bigint; 10^19 overflowed it).
MAX_OFFSET = 10_000_000
from forecaster.store.catalog import ServingModelSpec, put_model as put_model_row
from forecaster.store.tables import ServingModel

router = APIRouter(prefix="/v1/models", tags=["models"], route_class=ModelIdRoute)


@router.get("", response_model=ListPublic[ServingModelPublic])
def list_models(engine: EngineDep, _: ReadToken, limit: int = Query(100, ge=1, le=10_000),
                offset: int = Query(0, ge=0, le=MAX_OFFSET)) -> ListPublic[ServingModelPublic]:
    with Session(engine) as session:
        count = session.scalar(select(func.count()).select_from(ServingModel)) or 0
        rows = session.scalars(select(ServingModel).order_by(ServingModel.id).limit(limit).offset(offset)).all()
        return ListPublic(data=[ServingModelPublic.model_validate(r) for r in rows], count=count)


@router.get("/{model_id}", response_model=ServingModelPublic, responses={404: {"description": "Unknown model"}})
def get_model(model_id: ModelIdPath, engine: EngineDep, _: ReadToken) -> ServingModelPublic:
    with Session(engine) as session:
        row = session.get(ServingModel, model_id)
        if row is None:
            raise HTTPException(404, f"model {model_id!r} is not registered")
        return ServingModelPublic.model_validate(row)


def _links_to_the_model() -> dict:
    """OpenAPI links from a registered model to what can be read about it (stateful fuzzing follows them)."""
    targets = {"GetModel": "get_model_v1_models__model_id__get",
               "GetForecast": "get_forecast_v1_models__model_id__forecast_get",
               "GetRecommendation": "get_recommendation_v1_models__model_id__recommendation_get",
               "GetSeries": "get_series_v1_models__model_id__series_get",
               "GetColdStarts": "get_cold_starts_v1_models__model_id__coldstarts_get",
               "GetColdStartHorizon": "get_cold_start_horizon_v1_models__model_id__cold_start_get",
               "GetActions": "get_action_timeline_v1_models__model_id__actions_get",
               "PutModelAgain": "put_model_v1_models__model_id__put"}
    return {name: {"operationId": op, "parameters": {"model_id": "$response.body#/id"}}
            for name, op in targets.items()}


@router.put("/{model_id}", response_model=ServingModelPublic,
            responses={200: {"description": "The model as stored", "links": _links_to_the_model()}})
def put_model(model_id: ModelIdPath, body: ServingModelPut, engine: EngineDep, _: AdminToken) -> ServingModelPublic:
    # the answer is the row this statement wrote (RETURNING): read back in a second transaction, it could be
    # another PUT's to the same id that committed in between
    with engine.begin() as conn:
        row = put_model_row(conn, ServingModelSpec(id=model_id, **body.model_dump()))
    return ServingModelPublic.model_validate(row)
