"""Request and response bodies of the REST API (pydantic), in small families per resource."""

from __future__ import annotations

from datetime import datetime
from typing import Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T")


class ListPublic(BaseModel, Generic[T]):
    data: list[T]
    count: int


class ServingModelBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    image_ref: str | None = Field(default=None, max_length=1024)
    image_size_bytes: int | None = Field(default=None, ge=0)
    weights_uri: str | None = Field(default=None, max_length=2048)
    weights_size_bytes: int | None = Field(default=None, ge=0)
    gpus_per_replica: int = Field(default=1, ge=0, le=64)
    replica_rps: float | None = Field(default=None, gt=0, description="Requests per second one replica sustains.")
    cold_start_slo_s: float | None = Field(default=None, gt=0)
    labels: dict[str, str] = Field(default_factory=dict)


class ServingModelPut(ServingModelBase):
    """Body of ``PUT /v1/models/{id}``."""


class ServingModelPublic(ServingModelBase):
    model_config = ConfigDict(extra="ignore", from_attributes=True)

    id: str
    created_at: datetime | None = None
    updated_at: datetime | None = None


class ForecastPoint(BaseModel):
    target_minute: datetime
    point: float
    p_any: float | None = None
    quantiles: dict[str, float]


class ForecastPublic(BaseModel):
    model_id: str
    issued_at: datetime
    age_s: float
    model_version_id: str | None
    stale: bool = Field(description="True when served from memory because the database is unreachable.")
    horizon_min: int
    points: list[ForecastPoint]


class RecommendationPublic(BaseModel):
    """Replicas to have ready. KEDA's metrics-api scaler reads ``valueLocation: replicas_at_lead_time``."""

    model_id: str
    replicas_now: int | None
    replicas_at_lead_time: int | None
    lead_time_s: float
    quantile: float | None
    demand_now_per_min: float | None
    demand_at_lead_time_per_min: float | None
    reason: str
    forecast_issued_at: datetime | None
    forecast_age_s: float | None
    model_version_id: str | None
    stale: bool = False


class InvocationRow(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_id: str
    minute: datetime | str
    count: int | float | str | None


class InvocationBatch(BaseModel):
    """A pushed batch; the whole batch is rejected with the row and field of the first problem."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(default="push", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    rows: list[dict] = Field(min_length=1, max_length=200_000)


class ColdStartBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(default="push", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    events: list[dict] = Field(min_length=1, max_length=50_000)


class IngestResultPublic(BaseModel):
    batch_id: int | None = None
    duplicate: bool = False
    models: int = 0
    rows_written: int = 0
    invocations: int = 0
    covered_steps: int = 0


class ColdStartResultPublic(BaseModel):
    inserted: int
    updated: int


class ProblemPublic(BaseModel):
    """A rejected batch: which row and field, and why."""

    detail: str
    reason: str
    row: int | None = None
    field: str | None = None
    value: str | None = None
