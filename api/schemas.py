"""Request and response bodies of the REST API (pydantic), in small families per resource."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Generic, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from forecaster.contracts.bursts import MAX_BURST_FACTOR
from forecaster.store import fields as bounds

T = TypeVar("T")


def _text(max_length: int):
    def check(value: str) -> str:
        problem = bounds.text_problem(value, max_length=max_length)
        if problem:
            raise ValueError(problem)
        return value

    return AfterValidator(check)


#: Free text stored as is (image reference, weights URI): no control characters, no lone surrogates.
SafeText = Annotated[str, Field(max_length=bounds.MAX_TEXT_LENGTH), _text(bounds.MAX_TEXT_LENGTH)]
#: An id (model, node, label key): 1-256 characters, no control characters, no lone surrogates.
SafeId = Annotated[str, Field(min_length=1, max_length=bounds.MAX_ID_LENGTH), _text(bounds.MAX_ID_LENGTH)]


def _bounded_time(value: datetime) -> datetime:
    """A query time as UTC (no zone = UTC) between 2000 and 2200; ValueError otherwise."""
    try:
        moment = bounds.parse_timestamp(value)
    except OverflowError:  # e.g. 9999-12-31T23:59-23:59 is past year 9999 in UTC
        raise ValueError("the time is out of range once converted to UTC") from None
    return bounds.check_timestamp_range(moment, latest=datetime(2200, 1, 1, tzinfo=moment.tzinfo))


def _iso_text_only(value: object) -> object:
    if isinstance(value, str):
        problem = bounds.timestamp_text_problem(value)
        if problem:
            raise ValueError(problem)
        return value
    if isinstance(value, datetime):
        return value
    raise ValueError(f"expected ISO 8601 text, got {type(value).__name__}")


#: A time in a query: ISO 8601 text (no zone = UTC; numbers and words like ``now`` refused), 2000 to 2200.
UtcTime = Annotated[datetime, BeforeValidator(_iso_text_only), AfterValidator(_bounded_time)]


def check_model_labels(value: dict[str, str]) -> dict[str, str]:
    """A model's labels as :func:`forecaster.store.fields.check_labels` checks them, and ``catalog`` naming an entry
    of the simulator's catalogue; ValueError naming the label otherwise (the API's 422, the CLI's exit 2)."""
    from forecaster.simulation.catalog import catalog_label_problem

    bounds.check_labels(value)
    problem = catalog_label_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _labels(value: dict[str, str]) -> dict[str, str]:
    return check_model_labels(value)


class ListPublic(BaseModel, Generic[T]):
    data: list[T]
    count: int


class ServingModelBase(BaseModel):
    """A model's spec; bounds in :mod:`forecaster.store.fields` (sizes in bytes, rates per second, SLO in s)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    image_ref: SafeText | None = Field(default=None, max_length=1024)
    image_size_bytes: int | None = Field(default=None, ge=0, le=bounds.MAX_SIZE_BYTES,
                                         description="Bytes, at most 2^50 (1 PiB).")
    weights_uri: SafeText | None = Field(default=None, max_length=2048)
    weights_size_bytes: int | None = Field(default=None, ge=0, le=bounds.MAX_SIZE_BYTES,
                                           description="Bytes, at most 2^50 (1 PiB).")
    gpus_per_replica: int = Field(default=1, ge=0, le=64)
    replica_rps: float | None = Field(default=None, ge=bounds.MIN_REPLICA_RPS, le=bounds.MAX_REPLICA_RPS,
                                      description="Requests per second one replica sustains (0.001 to 1,000,000).")
    cold_start_slo_s: float | None = Field(default=None, ge=bounds.MIN_SLO_S, le=bounds.MAX_SLO_S,
                                           description="Seconds, 0.001 to 86,400.")
    labels: Annotated[dict[SafeId, Annotated[str, Field(max_length=bounds.MAX_TEXT_LENGTH)]],
                      AfterValidator(_labels)] = Field(
        default_factory=dict, max_length=bounds.MAX_LABELS,
        description="Text values. Those the product reads must hold what it accepts (else 422 naming the label): "
                    "cold_cost a number from 0 to 1e9, request_s a number of seconds above 0, prometheus_query and "
                    "prometheus_burst_query a non-empty PromQL expression, k8s_kind Deployment or InferenceService, "
                    "k8s_name and k8s_namespace Kubernetes names, catalog an entry of the simulator's catalogue.")
    burst_factor: float | None = Field(
        default=None, ge=1.0, le=MAX_BURST_FACTOR,
        description="Peak 10-second request rate over the minute's mean, 1 (even arrivals) to 6; replicas are "
                    "sized for it. Unset: even arrivals, until a per-request trace of the model is ingested (a PUT "
                    "replaces the whole spec, this field included).")


class ServingModelPut(ServingModelBase):
    """Body of ``PUT /v1/models/{id}``."""


class ServingModelPublic(BaseModel):
    """A stored model as read back: plain types, so a row stored before the bounds existed still reads."""

    model_config = ConfigDict(extra="ignore", from_attributes=True)

    image_ref: str | None = None
    image_size_bytes: int | None = None
    weights_uri: str | None = None
    weights_size_bytes: int | None = None
    gpus_per_replica: int = 1
    replica_rps: float | None = None
    cold_start_slo_s: float | None = None
    labels: dict = Field(default_factory=dict)
    burst_factor: float | None = None
    id: str
    created_at: datetime | None = None
    updated_at: datetime | None = None


class ActionRecord(BaseModel):
    """The columns of a stored action that every action listing returns (``/v1/actions``, a model's timeline)."""

    id: int
    plan_id: int | None
    kind: str
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
    rows: list[dict] = Field(min_length=1, max_length=200_000,
                             description="Objects with exactly model_id, minute (ISO 8601; no zone = UTC), count, "
                                         "and optionally peak_10s: the most requests of any 10-second bucket of "
                                         "the minute, which moves the model's burst factor (the only row of its "
                                         "minute; each minute moves it once, and a minute older than one already "
                                         "counted does not).")


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
    zeroed_steps: int = Field(default=0, description="Stored non-zero minutes this batch turned into zeros.")
    zeroed_invocations: int = Field(default=0, description="Invocations those minutes held.")
    warnings: list[str] = Field(default_factory=list, description="What the sender should know, e.g. zeroed minutes.")
    burst_factors_stored: int = Field(default=0, description="Models whose burst factor this batch's peak_10s moved.")


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
